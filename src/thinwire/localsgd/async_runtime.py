"""Asynchronous Local-SGD on torch.distributed: rank 0 serves, ranks 1..W train.

``thinwire train --algo async-diloco --workers 5`` starts 5 ranks: **rank 0 is the
server** (global parameters, outer optimizer, evaluation, checkpoints) and ranks 1-4 are
the 4 workers. Under torchrun the same holds across machines: put rank 0 on a machine
with a good link to the others; it does no training.

Per round a worker pulls theta (fp32), runs ``H`` (or DyLU's ``H_w``) inner AdamW steps
on the shard the server gave it, and pushes ``theta - theta_w`` (fp32, or fp16/bf16 with
``--compress``). The server applies each push on arrival (:class:`ServerCore`). The
worker's AdamW first moment restarts at every round when ``cfg.inner_momentum`` is
``round``, the default with DyLU (see :mod:`thinwire.localsgd.inner_state`).

Fault tolerance:

* A worker that dies is noticed when a send to it fails, or when its heartbeat (a store
  counter bumped twice a second by a background thread) stops for ``dead_after_s``:
  independent of the round length, so nothing to tune for the model size. The run
  continues with the others.
* A worker whose round fails with an exception reports nothing, rebuilds its inner
  optimizer and joins again (``HELLO``); the server re-admits it.
* A worker *process* that was killed comes back with
  :func:`thinwire.localsgd.rejoin.rejoin` (``thinwire train
  ... --rejoin RANK`` with ``MASTER_ADDR``/``MASTER_PORT`` of rank 0): every worker
  talks to the server over a two-rank gloo link of its own, never over the launch's
  process group, so a fresh process needs only the store's address. It is a new
  *incarnation* of its rank; the server admits it as a worker that joined late and
  ignores what the old incarnation left in flight. Launch each rank as its own process
  for this (the local launcher and torchrun stop the whole group when one rank dies).
* The server checkpoints ``theta, m, Delta, t``, shard progress and lr clocks every
  ``checkpoint_interval`` inner steps; ``--resume`` continues from it in a new epoch and
  rejects updates computed before the restart.

``cfg.extra`` options: ``grace_s`` (grace period, default 0), ``shards`` (default W),
``c`` (DN's c, default 0), ``sync`` (True: every round waits for all workers, which with
DN's N = W and c = 0 is synchronous DiLoCo through the server; the baseline for
``--slowdown`` comparisons, since the allreduce DiLoCo of ``--algo diloco`` has no
slowdown emulation), ``dead_after_s`` (heartbeat silence that means a dead worker,
default 10), ``dylu_ema`` (default 0.5), ``connect_timeout_s`` (opening a worker's link,
default 120; the server waits that long at most for a worker that said hello and died),
``link_timeout_s`` (any later send or receive, default 1800; above the slowest round).
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.errors import ConfigError
from thinwire.localsgd.inner_state import resolve_inner_momentum
from thinwire.localsgd.server import OUTER_CHOICES, ServerCore, Work
from thinwire.localsgd.transport import (
    DTYPES,
    ERROR,
    HELLO,
    STOP,
    UPDATE,
    WORK,
    Transport,
    dtype_code,
)
from thinwire.localsgd.worker import LocalWorker, load_flat_

__all__ = [
    "COMPRESS",
    "check_async_config",
    "evaluate_theta",
    "make_worker",
    "run",
    "serve",
    "shape_signature",
    "work_loop",
]

COMPRESS = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Push dtype for each ``--compress`` choice."""


def shape_signature(model: nn.Module) -> tuple[int, int]:
    """``(numel, crc32 of the parameter shapes)``: equal for models of the same shape."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    return sum(p.numel() for p in model.parameters()), zlib.crc32(repr(shapes).encode())


@torch.no_grad()
def evaluate_theta(
    model: nn.Module, theta: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Mean loss of ``model`` with parameters ``theta`` over ``batches``."""
    load_flat_(list(model.parameters()), theta.to(next(model.parameters()).device))
    model.eval()
    total, n = 0.0, 0
    for x, y in batches:
        dev = next(model.parameters()).device
        _, loss = model(x.to(dev), y.to(dev))
        total += float(loss) * len(x)
        n += len(x)
    model.train()
    return total / max(n, 1)


def serve(
    core: ServerCore,
    transport: Transport,
    workers: list[int],
    signature: tuple[int, int],
    *,
    evaluate: Callable[[torch.Tensor], float] | None = None,
    eval_every_steps: int = 0,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: Callable[[ServerCore], None] | None = None,
    checkpoint_every_steps: int = 0,
    dead_after_s: float = 10.0,
    hung_after_min_s: float = 600.0,
    hung_after_factor: float = 10.0,
    max_wall_s: float | None = None,
) -> dict[str, Any]:
    """The server loop; returns counters when every worker is stopped or dead.

    A worker is dead when its heartbeat has not moved for ``dead_after_s`` (a killed
    process), or when a send to it fails; it is *hung* (and dropped too) when a round
    takes ``max(hung_after_min_s, hung_after_factor * expected round time)``.

    A worker process that says hello with a newer incarnation than the one admitted
    (a restarted process, see :func:`thinwire.localsgd.rejoin.rejoin`) replaces it: the
    older incarnation's link is closed, its round in flight is lost (rewound and handed
    out again), and whatever it still had queued is ignored. The newcomer starts as a
    worker that joined late: no DyLU speed yet, back in Delayed Nesterov's N, the free
    shard with least progress.
    """
    numel, crc = signature
    start = time.monotonic()
    transport.publish(len(workers), numel, crc, len(core.shards))
    admitted: dict[int, int] = {}  # worker -> incarnation whose link is open
    beats: dict[int, tuple[int, int, float]] = {w: (0, -1, start) for w in workers}
    updates: dict[tuple[int, int], list[int]] = {}  # (worker, incarnation) -> [pushes, steps]
    joins: list[dict[str, Any]] = []
    stale = 0
    next_beat_check = start
    next_eval = eval_every_steps or math.inf
    next_ckpt = (
        (core.steps_applied // checkpoint_every_steps + 1) * checkpoint_every_steps
        if checkpoint_every_steps
        else math.inf
    )
    if core.steps_applied >= core.total_steps:
        core.steps_assigned = core.total_steps  # resumed a finished run: just stop everyone

    if evaluate is not None and core.steps_applied == 0:
        _report(core, evaluate, on_eval, start)

    def accounted() -> bool:
        return all(w in core.retired or w in core.dead for w in workers)

    def lost(w: int) -> None:
        # The link broke (the process is gone): drop it, and let only a new incarnation
        # back in, since nothing can reach the old one any more.
        core.drop(w)
        transport.close(w)

    while not (core.finished and accounted()):
        now = time.monotonic()
        if max_wall_s is not None and now - start > max_wall_s:
            raise TimeoutError(f"the server ran past max_wall_s={max_wall_s}")
        msg = transport.poll()
        if msg is not None and (
            msg.src not in workers
            or msg.incarnation < admitted.get(msg.src, 0)
            or (msg.kind != HELLO and msg.incarnation != admitted.get(msg.src))
        ):
            # An unknown rank, or a replaced process's leftovers (its link is closed, so
            # there is no payload to drain).
            stale += 1
        elif msg is not None and msg.kind == HELLO:
            w, inc = msg.src, msg.incarnation
            if (int(msg.fields[0]), int(msg.fields[1])) != (numel, crc):
                transport.refuse(w, inc, [numel, crc])
                if msg.fields[2]:
                    continue  # a late joiner with another model: it got the error, go on
                raise ConfigError(
                    f"worker rank {w} has a model of {int(msg.fields[0])} parameters "
                    f"(shape checksum {int(msg.fields[1])}), the server's has {numel} "
                    f"(checksum {crc}); start every rank with the same model settings"
                )
            if admitted.get(w) != inc:
                if w in core.live:
                    core.drop(w)  # the older incarnation's round in flight is lost
                try:
                    transport.accept(w, inc)
                except RuntimeError:  # it died between its hello and connecting
                    core.drop(w)
                    core.dead.add(w)
                    continue
                admitted[w] = inc
                joins.append({"worker": w, "incarnation": inc, "time_s": now - start})
            elif w in core.live:
                core.drop(w)  # the same process after a failed round: that round is lost
            core.join(w, now)
        elif msg is not None and msg.kind == UPDATE:
            w = msg.src
            epoch, steps, sps, code = (
                int(msg.fields[0]),
                int(msg.fields[1]),
                msg.fields[2],
                int(msg.fields[4]),
            )
            try:
                grad = transport.recv_payload(w, numel, DTYPES[code]).float()
            except RuntimeError:  # killed between its header and its payload
                lost(w)
            else:
                if core.submit(w, epoch, grad, steps, sps, time.monotonic()):
                    tally = updates.setdefault((w, msg.incarnation), [0, 0])
                    tally[0] += 1
                    tally[1] += steps
        if msg is not None:
            if core.steps_applied >= next_eval and evaluate is not None:
                while next_eval <= core.steps_applied:
                    next_eval += eval_every_steps
                _report(core, evaluate, on_eval, start)
            if checkpoint is not None and core.steps_applied >= next_ckpt:
                while next_ckpt <= core.steps_applied:
                    next_ckpt += checkpoint_every_steps
                checkpoint(core)
        now = time.monotonic()
        for w in core.due(now):
            work = core.work_for(w, now)
            if work is None:
                continue
            try:
                if work.stop:
                    transport.send(w, STOP, [])
                else:
                    fields = [
                        work.epoch,
                        work.version,
                        work.shard,
                        work.steps,
                        work.lr_clock,
                        work.planned,
                    ]
                    transport.send(w, WORK, fields, core.theta.detach())
            except RuntimeError:  # gloo: connection closed by a dead peer (or no link)
                lost(w)
        for w in core.overdue(now, hung_after_factor, hung_after_min_s):
            core.drop(w)
        if now >= next_beat_check:
            next_beat_check = now + min(1.0, dead_after_s / 4)
            for w in workers:
                if w in core.retired:
                    continue
                # Watch the admitted incarnation; before the first hello, the newest drawn.
                inc = admitted.get(w) or transport.latest_incarnation(w)
                count = transport.heartbeat(w, inc)
                watched, last, since = beats[w]
                if inc != watched or count != last:
                    beats[w] = (inc, count, now)
                    if inc == watched and w in core.dead and transport.linked(w):
                        # Only stalled (an overloaded host): it is alive. Offer it work, so
                        # that a worker waiting for a reply is never left behind.
                        core.join(w, now)
                elif w not in core.dead and now - since > dead_after_s:
                    core.drop(w)
                    core.dead.add(w)  # also covers a worker that died before its hello
        if msg is None:
            time.sleep(0.001)
    if checkpoint is not None:
        checkpoint(core)
    transport.mark_finished()
    out = {
        "wall_s": time.monotonic() - start,
        "dead_workers": sorted(core.dead),
        "incarnations": dict(sorted(admitted.items())),
        "joins": joins,
        "updates_by_incarnation": [
            {"worker": w, "incarnation": i, "updates": n, "inner_steps": s}
            for (w, i), (n, s) in sorted(updates.items())
        ],
        "stale_messages": stale,
    }
    if evaluate is not None:
        out.update(_report(core, evaluate, on_eval, start))
    return out


def _report(
    core: ServerCore,
    evaluate: Callable[[torch.Tensor], float],
    on_eval: Callable[[dict[str, Any]], None] | None,
    start: float,
) -> dict[str, Any]:
    rec = {
        "step": core.steps_applied,
        "updates": core.updates_applied,
        "rejected": core.updates_rejected,
        "time_s": time.monotonic() - start,
        "val_loss": evaluate(core.theta.detach()),
    }
    if on_eval is not None:
        on_eval(rec)
    return rec


def work_loop(
    worker: LocalWorker,
    transport: Transport,
    *,
    server: int = 0,
    compress: torch.dtype = torch.float32,
    on_round: Callable[[int], None] | None = None,
    heartbeat_s: float = 0.5,
    max_restarts: int = 3,
    late: bool = False,
) -> dict[str, Any]:
    """A worker's loop: hello, then pull / train / push until the server says stop.

    A background thread bumps the worker's heartbeat every ``heartbeat_s`` seconds. A
    round that raises is abandoned; the worker resets its inner optimizer and joins
    again, at most ``max_restarts`` times. ``late``: this process joins a running run
    (see :func:`thinwire.localsgd.rejoin.rejoin`), so a model mismatch turns only this
    worker away instead of stopping the run. The worker's link to the server is opened
    by its hello and closed when the loop returns or raises.
    """
    numel, crc = shape_signature(worker.model)
    stop_beating = threading.Event()

    def beat() -> None:
        while not stop_beating.wait(heartbeat_s):
            try:
                transport.beat()
            except RuntimeError:
                return  # the store is gone with the server; the main loop will find out

    transport.beat()
    threading.Thread(target=beat, daemon=True, name="thinwire-heartbeat").start()
    try:
        return _work_rounds(
            worker, transport, server, compress, on_round, numel, crc, max_restarts, late
        )
    finally:
        stop_beating.set()
        transport.close()


def _work_rounds(
    worker: LocalWorker,
    transport: Transport,
    server: int,
    compress: torch.dtype,
    on_round: Callable[[int], None] | None,
    numel: int,
    crc: int,
    max_restarts: int,
    late: bool,
) -> dict[str, Any]:
    hello = [numel, crc, float(late)]
    transport.send(server, HELLO, hello)
    rounds = steps = restarts = 0
    while True:
        msg = transport.recv(server)
        if msg.kind == ERROR:
            raise ConfigError(
                f"the server's model has {int(msg.fields[0])} parameters (checksum "
                f"{int(msg.fields[1])}), this worker's has {numel} (checksum {crc})"
            )
        if msg.kind == STOP:
            return {"rounds": rounds, "steps": steps, "restarts": restarts}
        if msg.kind != WORK:
            raise RuntimeError(f"unexpected message kind {msg.kind} from the server")
        f = [int(x) for x in msg.fields[:6]]
        work = Work(epoch=f[0], version=f[1], shard=f[2], steps=f[3], lr_clock=f[4], planned=f[5])
        theta = transport.recv_payload(server, numel, torch.float32)
        try:
            result = worker.run_round(theta, work)
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
            transport.send(server, HELLO, hello)
            continue
        steps += result.steps
        fields = [
            work.epoch,
            result.steps,
            result.seconds_per_step,
            result.loss,
            dtype_code(compress),
        ]
        transport.send(server, UPDATE, fields, result.pseudo_grad.to(compress))


def check_async_config(cfg: Any, workers: int) -> None:
    """Every bad setting of an asynchronous run, as a one-line ConfigError, before any message."""
    cfg.validate()
    if workers < 1:
        raise ConfigError(
            "async-diloco needs at least 2 ranks: rank 0 is the server, ranks 1.. are workers"
        )
    if cfg.outer not in OUTER_CHOICES:
        raise ConfigError(f"unknown outer optimizer {cfg.outer!r}; choose one of {OUTER_CHOICES}")
    if cfg.compress not in COMPRESS:
        raise ConfigError(
            f"async-diloco compresses pushes with none, fp16 or bf16, got {cfg.compress!r}"
        )
    if cfg.slowdown is not None:
        if len(cfg.slowdown) != workers:
            raise ConfigError(
                f"--slowdown lists {len(cfg.slowdown)} factors but there are {workers} workers "
                f"(ranks 1..{workers}; rank 0 is the server)"
            )
        if any(not (s >= 1.0 and math.isfinite(s)) for s in cfg.slowdown):
            raise ConfigError(f"--slowdown factors must be >= 1, got {list(cfg.slowdown)}")
    c = float(cfg.extra.get("c", 0.0))
    if not 0.0 <= c <= 1.0 / workers:
        raise ConfigError(
            f"Delayed Nesterov c must be in [0, 1/N] = [0, {1 / workers:.4g}], got {c}"
        )
    if cfg.extra.get("sync") and (cfg.outer != "dn" or cfg.dylu or c != 0):
        raise ConfigError(
            "sync mode is synchronous DiLoCo: it needs outer dn with c = 0 and no DyLU"
        )
    if float(cfg.extra.get("grace_s", 0.0)) < 0:
        raise ConfigError(f"grace_s must be >= 0, got {cfg.extra['grace_s']}")


def run(cfg: Any) -> dict[str, Any]:
    """Trainer runner for ``--algo async-diloco``; call on every rank of a process group.

    Returns the run summary on rank 0 (final validation loss and perplexity, updates
    applied and rejected, inner steps, samples/s, bytes, and which worker incarnations
    pushed how much) and the worker's counts elsewhere. Workers talk to the server over
    links of their own (:mod:`~thinwire.localsgd.transport`); the launch's process group
    only starts the processes, so a rank that dies leaves nothing in it to wait for.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - 1
    check_async_config(cfg, workers)
    extra = cfg.extra
    transport = Transport(
        connect_timeout_s=float(extra.get("connect_timeout_s", 120.0)),
        timeout_s=float(extra.get("link_timeout_s", 1800.0)),
    )
    if rank != 0:
        worker = make_worker(cfg, rank, workers)
        return work_loop(worker, transport, compress=COMPRESS[cfg.compress])
    from thinwire.localsgd.server_run import run_server

    try:
        return run_server(cfg, transport, workers)
    finally:
        transport.mark_finished()  # late joiners are turned away, even after a failure
        transport.close()


def make_worker(cfg: Any, rank: int, workers: int) -> LocalWorker:
    from thinwire.train.data import TextData
    from thinwire.train.model import GPT

    gcfg = cfg.gpt_config()
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    data = TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
    shards = data.shards(int(cfg.extra.get("shards", workers)))
    if _device(cfg).type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        model = model.to("cuda")
    return LocalWorker(
        model, shards, seq_len=gcfg.seq_len, batch_size=cfg.batch_size, lr=cfg.lr,
        warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio, betas=cfg.betas,
        weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=cfg.seed,
        slowdown=cfg.slowdown[rank - 1] if cfg.slowdown else 1.0,
        inner_momentum=resolve_inner_momentum(cfg.inner_momentum, cfg.dylu),
    )  # fmt: skip


def _device(cfg: Any) -> torch.device:
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")
