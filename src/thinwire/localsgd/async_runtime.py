"""Asynchronous Local-SGD on torch.distributed: rank 0 serves, ranks 1..W train.

``thinwire train --algo async-diloco --workers 5`` starts 5 ranks: **rank 0 is the
server** (global parameters, outer optimizer, evaluation, checkpoints) and ranks 1-4 are
the 4 workers. Under torchrun the same holds across machines: put rank 0 on a machine
with a good link to the others; it does no training.

Per round a worker pulls theta (fp32), runs ``H`` (or DyLU's ``H_w``) inner AdamW steps
on the shard the server gave it, and pushes ``theta - theta_w`` (fp32, or fp16/bf16 with
``--compress``). The server applies each push on arrival (:class:`ServerCore`).

Fault tolerance:

* A worker that dies is noticed when a send to it fails, or when its heartbeat (a store
  counter bumped twice a second by a background thread) stops for ``dead_after_s``:
  independent of the round length, so nothing to tune for the model size. The run
  continues with the others.
* A worker whose round fails with an exception reports nothing, rebuilds its inner
  optimizer and joins again (``HELLO``); the server re-admits it. A *process* that was
  killed cannot re-enter a running gloo group (its membership is fixed at start); under
  ``torchrun --max-restarts`` the group restarts and ``--resume`` continues from the
  server's checkpoint.
* The server checkpoints ``theta, m, Delta, t``, shard progress and lr clocks every
  ``checkpoint_interval`` inner steps; ``--resume`` continues from it in a new epoch and
  rejects updates computed before the restart.

``cfg.extra`` options: ``grace_s`` (grace period, default 0), ``shards`` (default W),
``c`` (DN's c, default 0), ``sync`` (True: every round waits for all workers, which with
DN's N = W and c = 0 is synchronous DiLoCo through the server; the baseline for
``--slowdown`` comparisons, since the allreduce DiLoCo of ``--algo diloco`` has no
slowdown emulation), ``dead_after_s`` (heartbeat silence that means a dead worker,
default 10), ``dylu_ema`` (default 0.5).
"""

from __future__ import annotations

import json
import math
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
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

__all__ = ["check_async_config", "evaluate_theta", "run", "serve", "shape_signature", "work_loop"]

_COMPRESS = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    """
    numel, crc = signature
    start = time.monotonic()
    heard: set[int] = set()
    beats: dict[int, tuple[int, float]] = {w: (-1, start) for w in workers}
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

    while not (core.finished and accounted()):
        now = time.monotonic()
        if max_wall_s is not None and now - start > max_wall_s:
            raise TimeoutError(f"the server ran past max_wall_s={max_wall_s}")
        msg = transport.poll()
        if msg is not None:
            heard.add(msg.src)
            if msg.kind == HELLO:
                if (int(msg.fields[0]), int(msg.fields[1])) != (numel, crc):
                    transport.send(msg.src, ERROR, [numel, crc])
                    raise ConfigError(
                        f"worker rank {msg.src} has a model of {int(msg.fields[0])} parameters "
                        f"(shape checksum {int(msg.fields[1])}), the server's has {numel} "
                        f"(checksum {crc}); start every rank with the same model settings"
                    )
                if msg.src in core.live:
                    core.drop(msg.src)  # a restarted worker: its round in flight is lost
                core.join(msg.src, now)
            elif msg.kind == UPDATE:
                epoch, steps, sps, code = (
                    int(msg.fields[0]),
                    int(msg.fields[1]),
                    msg.fields[2],
                    int(msg.fields[4]),
                )
                grad = transport.recv_payload(msg.src, numel, DTYPES[code]).float()
                core.submit(msg.src, epoch, grad, steps, sps, time.monotonic())
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
            except RuntimeError:  # gloo: connection closed by a dead peer
                core.drop(w)
        for w in core.overdue(now, hung_after_factor, hung_after_min_s):
            core.drop(w)
        if now >= next_beat_check:
            next_beat_check = now + min(1.0, dead_after_s / 4)
            for w in workers:
                if w in core.retired:
                    continue
                count = transport.heartbeat(w)
                if count != beats[w][0]:
                    beats[w] = (count, now)
                    if w in core.dead:
                        # Only stalled (an overloaded host): it is alive. Offer it work, so
                        # that a worker waiting for a reply is never left behind.
                        core.join(w, now)
                elif w not in core.dead and now - beats[w][1] > dead_after_s:
                    core.drop(w)
                    core.dead.add(w)  # also covers a worker that died before its hello
        if msg is None:
            time.sleep(0.001)
    if checkpoint is not None:
        checkpoint(core)
    out = {"wall_s": time.monotonic() - start, "dead_workers": sorted(core.dead)}
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
) -> dict[str, Any]:
    """A worker's loop: hello, then pull / train / push until the server says stop.

    A background thread bumps the worker's heartbeat every ``heartbeat_s`` seconds. A
    round that raises is abandoned; the worker resets its inner optimizer and joins
    again, at most ``max_restarts`` times.
    """
    numel, crc = shape_signature(worker.model)
    stop_beating = threading.Event()

    def beat() -> None:
        while not stop_beating.wait(heartbeat_s):
            transport.beat()

    transport.beat()
    threading.Thread(target=beat, daemon=True, name="thinwire-heartbeat").start()
    try:
        return _work_rounds(worker, transport, server, compress, on_round, numel, crc, max_restarts)
    finally:
        stop_beating.set()


def _work_rounds(
    worker: LocalWorker,
    transport: Transport,
    server: int,
    compress: torch.dtype,
    on_round: Callable[[int], None] | None,
    numel: int,
    crc: int,
    max_restarts: int,
) -> dict[str, Any]:
    transport.send(server, HELLO, [numel, crc])
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
            transport.send(server, HELLO, [numel, crc])
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
    if cfg.compress not in _COMPRESS:
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
    applied and rejected, inner steps, samples/s, bytes) and the worker's counts elsewhere.
    """
    from thinwire.train.checkpoint import (
        atomic_save,
        check_run_identity,
        safe_load,
        write_run_identity,
    )
    from thinwire.train.data import TextData
    from thinwire.train.metrics import MetricsWriter, atomic_write_text
    from thinwire.train.model import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - 1
    check_async_config(cfg, workers)
    extra = cfg.extra
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    transport = Transport(group)
    device = torch.device(
        "cuda"
        if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    gcfg = cfg.gpt_config()
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    data = TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
    shards = data.shards(int(extra.get("shards", workers)))

    if rank != 0:
        if device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            model = model.to(device)
        worker = LocalWorker(
            model, shards, seq_len=gcfg.seq_len, batch_size=cfg.batch_size, lr=cfg.lr,
            warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio, betas=cfg.betas,
            weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, seed=cfg.seed,
            slowdown=cfg.slowdown[rank - 1] if cfg.slowdown else 1.0,
        )  # fmt: skip
        return work_loop(worker, transport, compress=_COMPRESS[cfg.compress])

    out_dir = Path(cfg.out_dir)
    identity = {k: cfg.to_dict()[k] for k in cfg.IDENTITY} | {
        "workers": workers,
        "outer": cfg.outer,
    }
    core = ServerCore(
        parameters_to_vector(model.parameters()), workers=workers, local_steps=cfg.local_steps,
        total_steps=cfg.steps * workers, shard_sizes=[len(s) for s in shards], outer=cfg.outer,
        outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, c=float(extra.get("c", 0.0)),
        dylu=cfg.dylu, grace_s=float(extra.get("grace_s", 0.0)), sync=bool(extra.get("sync")),
        dylu_ema=float(extra.get("dylu_ema", 0.5)),
    )  # fmt: skip
    ckpt_path = out_dir / "localsgd_server.pt"
    resume_step = None
    if cfg.resume:
        check_run_identity(out_dir, identity)
        core.load_state_dict(safe_load(ckpt_path))
        resume_step = core.steps_applied
    else:
        if ckpt_path.exists():
            raise ConfigError(
                f"output directory {out_dir} already holds an asynchronous run; pass --resume "
                "to continue it or choose another --out"
            )
        write_run_identity(out_dir, identity)
    metrics = MetricsWriter(out_dir, True, resume_step, cfg.tensorboard)
    batches = data.val_batches(cfg.eval_sequences, cfg.batch_size)
    sent0, t0 = COUNTER.wire_bytes, time.monotonic()
    steps0 = core.steps_applied
    try:
        stats = serve(
            core, transport, list(range(1, world)), shape_signature(model),
            evaluate=lambda theta: evaluate_theta(model, theta, batches),
            eval_every_steps=cfg.eval_interval * workers, on_eval=metrics.write,
            checkpoint=lambda c: atomic_save(c.state_dict(), ckpt_path),
            checkpoint_every_steps=cfg.checkpoint_interval * workers,
            dead_after_s=float(extra.get("dead_after_s", 10.0)),
        )  # fmt: skip
    finally:
        metrics.close()
    wall = time.monotonic() - t0
    trained = (core.steps_applied - steps0) * cfg.batch_size
    summary = {
        "algo": cfg.algo,
        "world_size": world,
        "workers": workers,
        "outer": cfg.outer,
        "dylu": cfg.dylu,
        "sync": bool(extra.get("sync")),
        "steps": core.steps_applied // workers,
        "inner_steps": core.steps_applied,
        "updates_applied": core.updates_applied,
        "updates_rejected": core.updates_rejected,
        "dead_workers": stats["dead_workers"],
        "parameters": model.num_parameters(),
        "final_val_loss": stats["val_loss"],
        "final_val_ppl": math.exp(min(stats["val_loss"], 50.0)),
        "train_time_s": wall,
        "samples_per_s": trained / wall if wall > 0 else float("nan"),
        "comm_bytes": COUNTER.wire_bytes - sent0 + transport.bytes_received,
        "comm_by_op": COUNTER.snapshot(),
        "out_dir": str(out_dir),
    }
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
