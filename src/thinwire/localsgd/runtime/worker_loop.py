"""A worker's loop: hello, then pull / train / push until the server says stop.

The loop speaks the messages of :mod:`thinwire.localsgd.messages` over a
:class:`~thinwire.localsgd.runtime.transport.Transport`, and leaves the training itself to a
transport-free :class:`~thinwire.localsgd.algorithm.worker_core.LocalWorker`.

**Its state across a stop** (``state_path``): the server's checkpoint holds theta, the
outer optimizer, shard clocks and speeds, but what a worker carries from one round to
the next lives in the worker: its inner optimizer's state (Adam's second moment and step
count under every rule but ``fresh``), the 1-bit push codec's error feedback, and its
random generator. On a stop order after it trained, the worker writes them to
``state_path`` (on its own host), tagged with the theta version of the stop order; a
resumed worker loads them when its first round starts from that same version, which is
the case when the server's checkpoint is the one written at that stop (``stop_after``,
or every worker gone). Then a resumed synchronous run (``sync``) continues bit for bit
as if it had never stopped. Otherwise (an older checkpoint, a worker on another host
without the file) the worker starts with fresh inner state, as a new worker would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.io import atomic_save
from thinwire.localsgd.algorithm.compression import CODECS, PullDecoder, PushEncoder
from thinwire.localsgd.algorithm.push_guard import REASONS, describe
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.messages import Hello, Refused, Update, Why, Work
from thinwire.localsgd.runtime.island import Island
from thinwire.localsgd.runtime.transport import Transport
from thinwire.localsgd.task import shape_signature
from thinwire.optim.sharded import local_state, reshard_optimizer_state
from thinwire.safeload import safe_load

__all__ = ["LoopSettings", "follow_loop", "load_worker_state", "save_worker_state", "work_loop"]

_WORD_WAIT_S = 5.0
"""How long a worker whose link failed waits for the server's reason in the store: the
server leaves it before it closes a link, but a link can also fail first on the worker's
side while the server is still reading the push that decides it."""


def save_worker_state(
    path: Path, worker: LocalWorker, push: PushEncoder, version: int, rank: int
) -> None:
    """Write what ``worker`` carries across rounds, tagged with theta ``version``."""
    residual = push.feedback.residual if push.feedback is not None else None
    state = {
        "rank": rank,
        "version": version,
        "optimizer": local_state(worker.opt.state_dict()),  # a sharded model's own shards
        "rng": torch.get_rng_state(),
        "residual": residual,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(state, path)


def load_worker_state(
    path: Path, worker: LocalWorker, push: PushEncoder, version: int, rank: int
) -> bool:
    """Load :func:`save_worker_state`'s file into ``worker`` if it was written at theta
    ``version`` by worker ``rank``; True if it was. A missing, unreadable or other file
    is left alone (the worker starts fresh)."""
    if not path.is_file():
        return False
    try:
        state = safe_load(path, "worker state file")
        if state.get("rank") != rank or state.get("version") != version:
            return False
        worker.opt.load_state_dict(reshard_optimizer_state(state["optimizer"], worker.opt))
        torch.set_rng_state(state["rng"])
        if push.feedback is not None and state.get("residual") is not None:
            push.feedback.residual = state["residual"].clone()
    except (ConfigError, KeyError, TypeError, ValueError, RuntimeError, AttributeError):
        worker.reset()  # a half-loaded optimizer is worse than a fresh one
        return False
    return True


@dataclass(frozen=True)
class LoopSettings:
    """How :func:`work_loop` runs a worker (the defaults: a worker of a fresh run)."""

    server: int = 0
    """The server's rank."""
    compress: str | torch.dtype = "none"
    """The push codec (``none``, ``fp16``, ``bf16``, ``onebit``; a dtype names the cast)."""
    heartbeat_s: float = 0.5
    """Seconds between the background thread's heartbeats."""
    max_restarts: int = 3
    """How many times a round that raised is abandoned and the worker joins again."""
    late: bool = False
    """This process joins a running run (see :func:`thinwire.localsgd.rejoin_async`), so
    a model mismatch turns only this worker away instead of stopping the run."""
    force: bool = False
    """Replace its rank even if the server considers that worker alive."""
    state_path: Path | None = None
    """Where the worker keeps its inner state across a stop (see the module docstring)."""
    resume: bool = False
    """Load the state kept at ``state_path``."""
    island: Island | None = None
    """This worker's island when it is the leader of several ranks (see
    :mod:`thinwire.localsgd.runtime.island`); ``None``: a worker of one rank."""


def work_loop(
    worker: LocalWorker,
    transport: Transport,
    settings: LoopSettings | None = None,
    *,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run ``worker`` for the server until it says stop; returns rounds, steps, restarts
    (and ``state_restored``: whether a kept state was loaded).

    A background thread bumps the worker's heartbeat every ``heartbeat_s`` seconds. A
    round that raises is abandoned; the worker resets its inner optimizer and joins
    again, at most ``max_restarts`` times (both in ``settings``, :class:`LoopSettings`).
    Pulls are decoded as the server's header says (theta whole, or a delta to this
    worker's copy). The worker's link to the server is opened by its hello and closed
    when the loop returns or raises. ``on_round``: called with the rounds done after
    each round.

    Raises:
        ConfigError: the server turned this worker away (another model, a rejoin of a
            live worker, too many refused pushes), with the reason in one line.
    """
    st = settings or LoopSettings()
    heartbeat_s, compress = st.heartbeat_s, st.compress
    stop_beating = threading.Event()

    def beat() -> None:
        while not stop_beating.wait(heartbeat_s):
            try:
                transport.beat()
            except RuntimeError:
                return  # the store is gone with the server; the main loop will find out

    if isinstance(compress, torch.dtype):
        compress = next(name for name, d in CODECS.items() if d == compress)
    try:
        transport.beat()
        threading.Thread(target=beat, daemon=True, name="thinwire-heartbeat").start()
        hello = Hello(*shape_signature(worker.model), st.late, st.force)
        keep = _Keeper(st.state_path, st.resume, transport.rank, st.island)
        try:
            return _rounds(
                worker, transport, st.server, compress, on_round, st.max_restarts, hello, keep
            )
        except RuntimeError:
            # A link that closed while this worker was sending (a round under way) never
            # delivered the server's reason; the server leaves it in the store as well.
            word = transport.word_left(_WORD_WAIT_S)
            if word is None:
                raise
            raise ConfigError(_refusal(word, transport.rank, hello.numel, hello.checksum)) from None
    finally:
        stop_beating.set()
        if st.island is not None:
            st.island.abort()  # between rounds the others hear it; mid-round they time out
        transport.close()


def follow_loop(
    worker: LocalWorker, island: Island, state_path: Path | None = None, resume: bool = False
) -> dict[str, Any]:
    """A rank of an island other than its leader: run the rounds the leader orders (its
    shards of the model, its part of each batch) until it says stop; returns rounds,
    steps and ``state_restored``, as :func:`work_loop` does.

    Raises:
        RuntimeError: a collective of the island failed or timed out (a partner died, or
            a round failed on some rank): the island is lost to the run. (On NCCL the
            watchdog may end the process instead.)
    """
    keep = _Keeper(state_path, resume, island.rank, island)
    rounds = steps = 0
    while True:
        work = island.next_order()
        if work.stop:
            if work.version >= 0:  # the server's stop, not the leader leaving
                keep.stopped(worker, PushEncoder("none"), work.version, rounds)
            return {"rounds": rounds, "steps": steps, "restarts": 0} | {
                "state_restored": keep.restored
            }
        if rounds == 0:
            keep.first_round(worker, PushEncoder("none"), work.version)
        steps += worker.run_round(None, work).steps
        rounds += 1


class _Keeper:
    """When to save and load a worker's state (see the module docstring).

    ``member``: the island this rank belongs to, leader or not, whose ranks restore their
    states all or none; :attr:`island` is it when this rank leads it (sends the orders).
    """

    def __init__(self, path: Path | None, resume: bool, rank: int, member: Island | None) -> None:
        self.path, self.resume, self.rank = path, resume, rank
        self.member = member
        self.island = member if member is not None and member.leader else None
        self.restored = False

    def first_round(self, worker: LocalWorker, push: PushEncoder, version: int) -> None:
        if self.path is not None and self.resume:
            self.restored = load_worker_state(self.path, worker, push, version, self.rank)
        if self.member is not None and not self.member.all_agree(self.restored):
            # Some rank of the island has no state to load (a file lost on one host): the
            # shards of one optimizer must not be half kept, half fresh.
            if self.restored:
                worker.reset()
                push.reset()
            self.restored = False

    def stopped(self, worker: LocalWorker, push: PushEncoder, version: int, rounds: int) -> None:
        if self.path is not None and rounds > 0:  # a stop before any round changes nothing
            save_worker_state(self.path, worker, push, version, self.rank)


def _rounds(
    worker: LocalWorker,
    transport: Transport,
    server: int,
    compress: str,
    on_round: Callable[[int], None] | None,
    max_restarts: int,
    hello: Hello,
    keep: _Keeper,
) -> dict[str, Any]:
    numel, crc = hello.numel, hello.checksum
    push, view = PushEncoder(compress), PullDecoder()
    transport.send(server, hello)
    rounds = steps = restarts = 0
    while True:
        msg = transport.recv(server)
        if isinstance(msg, Refused):
            raise ConfigError(_refusal(msg, transport.rank, numel, crc))
        if not isinstance(msg, Work):
            raise RuntimeError(f"unexpected {msg.kind.name} message from the server")
        if msg.stop:
            if keep.island is not None:
                keep.island.stop(msg.version)
            keep.stopped(worker, push, msg.version, rounds)
            out = {"rounds": rounds, "steps": steps, "restarts": restarts}
            return out | {"state_restored": keep.restored}
        payload = transport.recv_payload(server, numel, msg.dtype)
        theta = view.delta(payload) if msg.delta else view.whole(payload)
        if keep.island is not None:
            keep.island.order(msg)  # before the state's load: its ranks agree on it
        if rounds == 0 and restarts == 0:
            keep.first_round(worker, push, msg.version)
        try:
            result = worker.run_round(theta, msg)
            if keep.island is not None:
                keep.island.round_done()
            rounds += 1
            if on_round is not None:
                on_round(rounds)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception:
            # The round failed (out of memory, a bad batch, a hardware hiccup): rebuild the
            # inner optimizer, say hello again, and the server re-admits this worker. An
            # island's ranks may have stopped at different collectives: it ends instead.
            if restarts >= max_restarts or keep.island is not None:
                raise
            restarts += 1
            worker.reset()
            transport.send(server, hello)
            continue
        steps += result.steps
        update = Update(
            msg.epoch, result.steps, result.seconds_per_step, result.loss, push.dtype, msg.version
        )
        assert result.pseudo_grad is not None  # a worker of one rank, or an island's leader
        transport.send(server, update, push.encode(result.pseudo_grad))


def _refusal(msg: Refused, rank: int, numel: int, crc: int) -> str:
    if msg.reason == Why.ALIVE:
        return (
            f"the run's worker {rank} is alive: a rejoin replaces only a worker the server "
            "considers dead (silent for dead_after_s); stop that process first, or force "
            "the rejoin (--force-rejoin)"
        )
    if msg.reason == Why.EVICTED:
        why = REASONS[msg.detail - 1] if 1 <= msg.detail <= len(REASONS) else None
        # Only these two can come of training itself; the others are a wrong message.
        hint = "check its learning rate" if why in ("non-finite", "norm") else "check its code"
        return (
            f"the server stopped worker {rank}: it refused its pushes, the last one for "
            f"{describe(why)}; {hint}"
        )
    return (
        f"the server's model has {msg.numel} parameters (checksum {msg.checksum}), "
        f"this worker's has {numel} (checksum {crc})"
    )
