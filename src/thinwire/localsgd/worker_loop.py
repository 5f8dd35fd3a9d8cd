"""A worker's loop: hello, then pull / train / push until the server says stop.

The loop speaks the messages of :mod:`thinwire.localsgd.messages` over a
:class:`~thinwire.localsgd.transport.Transport`, and leaves the training itself to a
transport-free :class:`~thinwire.localsgd.worker.LocalWorker`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.compression import CODECS, PullDecoder, PushEncoder
from thinwire.localsgd.messages import Hello, Refused, Update, Why, Work
from thinwire.localsgd.task import shape_signature
from thinwire.localsgd.transport import Transport
from thinwire.localsgd.worker import LocalWorker

__all__ = ["work_loop"]


def work_loop(
    worker: LocalWorker,
    transport: Transport,
    *,
    server: int = 0,
    compress: str | torch.dtype = "none",
    on_round: Callable[[int], None] | None = None,
    heartbeat_s: float = 0.5,
    max_restarts: int = 3,
    late: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Run ``worker`` for the server until it says stop; returns rounds, steps, restarts.

    A background thread bumps the worker's heartbeat every ``heartbeat_s`` seconds. A
    round that raises is abandoned; the worker resets its inner optimizer and joins
    again, at most ``max_restarts`` times. ``compress``: the push codec (``none``,
    ``fp16``, ``bf16``, ``onebit``; a dtype names the cast). Pulls are decoded as the
    server's header says (theta whole, or a delta to this worker's copy).
    ``late``: this process joins a running run (see
    :func:`thinwire.localsgd.rejoin_async`), so a model mismatch turns only this worker
    away instead of stopping the run; ``force``: it replaces its rank even if the server
    considers that worker alive. The worker's link to the server is opened by its hello
    and closed when the loop returns or raises.

    Raises:
        ConfigError: the server turned this worker away (another model, a rejoin of a
            live worker, too many refused pushes), with the reason in one line.
    """
    stop_beating = threading.Event()

    def beat() -> None:
        while not stop_beating.wait(heartbeat_s):
            try:
                transport.beat()
            except RuntimeError:
                return  # the store is gone with the server; the main loop will find out

    if isinstance(compress, torch.dtype):
        compress = next(name for name, d in CODECS.items() if d == compress)
    transport.beat()
    threading.Thread(target=beat, daemon=True, name="thinwire-heartbeat").start()
    try:
        hello = Hello(*shape_signature(worker.model), late, force)
        return _rounds(worker, transport, server, compress, on_round, max_restarts, hello)
    finally:
        stop_beating.set()
        transport.close()


def _rounds(
    worker: LocalWorker,
    transport: Transport,
    server: int,
    compress: str,
    on_round: Callable[[int], None] | None,
    max_restarts: int,
    hello: Hello,
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
            return {"rounds": rounds, "steps": steps, "restarts": restarts}
        payload = transport.recv_payload(server, numel, msg.dtype)
        theta = view.delta(payload) if msg.delta else view.whole(payload)
        try:
            result = worker.run_round(theta, msg)
            rounds += 1
            if on_round is not None:
                on_round(rounds)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception:
            # The round failed (out of memory, a bad batch, a hardware hiccup): rebuild the
            # inner optimizer, say hello again, and the server re-admits this worker.
            if restarts >= max_restarts:
                raise
            restarts += 1
            worker.reset()
            transport.send(server, hello)
            continue
        steps += result.steps
        update = Update(
            msg.epoch, result.steps, result.seconds_per_step, result.loss, push.dtype, msg.version
        )
        transport.send(server, update, push.encode(result.pseudo_grad))


def _refusal(msg: Refused, rank: int, numel: int, crc: int) -> str:
    if msg.reason == Why.ALIVE:
        return (
            f"the run's worker {rank} is alive: a rejoin replaces only a worker the server "
            "considers dead (silent for dead_after_s); stop that process first, or force "
            "the rejoin (--force-rejoin)"
        )
    if msg.reason == Why.EVICTED:
        return (
            f"the server stopped worker {rank}: it refused its pushes (non-finite, or far "
            "larger than the others') several times in a row; check its learning rate"
        )
    return (
        f"the server's model has {msg.numel} parameters (checksum {msg.checksum}), "
        f"this worker's has {numel} (checksum {crc})"
    )
