"""One training loop for every zoo piece: the user's loop, with one thinwire piece in it.

:func:`train_piece` runs inside a process group that is already up (one process per
rank) and trains one zoo model with one piece, wired the way a user wires it into their
own code: DDP plus an optimizer (``register_ddp``), DDP plus a comm hook
(``register_comm_hook``), DiLoCo around an inner AdamW, or ``run_async`` on a
:class:`~thinwire.localsgd.Task`. Every piece of one comparison starts from the same
initialisation and sees the same batches; the 1-bit optimizers get ``total_steps``, as
the docs tell users to, and otherwise their defaults.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import COUNTER
from thinwire.zoo.tasks import Batch, ZooTask

__all__ = ["ASYNC_PIECES", "BASELINES", "PIECES", "PieceResult", "train_piece"]

BASELINES: dict[str, str | None] = {
    "adamw": None,
    "lamb": None,
    "onebit-lamb": "lamb",
    "onebit-adam": "adamw",
    "adamw-onebit-hook": "adamw",
    "diloco": "adamw",
    "async": "adamw",
}
"""Every piece and the uncompressed baseline it is held to (None: it is a baseline).
DiLoCo and asynchronous Local-SGD are held to DDP + AdamW on the same samples: what they
replace."""

PIECES = tuple(BASELINES)
ASYNC_PIECES = frozenset({"async"})
"""Pieces that need a server rank besides the workers (``run_async``)."""


@dataclass
class PieceResult:
    """What one (model, piece) run measured."""

    model: str
    piece: str
    seed: int
    steps: int
    metrics: dict[str, float]
    """Held-out ``loss`` and, for classifiers, ``accuracy`` (rank 0's model)."""
    wire_bytes: int
    """Bytes the busiest rank put on the wire over the run (thinwire's accounting)."""
    skipped_steps: int
    seconds: float
    freeze_step: int | None = None
    """Where a 1-bit optimizer's warmup last ended (None: not compressing at the end)."""
    compressed_steps: int = 0
    """Steps a 1-bit optimizer took in its compression stage."""
    notes: list[str] = field(default_factory=list)
    """What thinwire logged at WARNING and above during the run (rank 0)."""


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Shard:
    """Shard ``index`` of ``count`` as an asynchronous worker's batch source: the same
    batches rank ``index`` of a synchronous run of ``count`` ranks trains on."""

    def __init__(self, task: ZooTask, seed: int, index: int, count: int, batch_size: int) -> None:
        self.task, self.seed, self.index, self.count = task, seed, index, count
        self.batch_size = batch_size

    def __call__(self, step: int) -> Batch:
        return self.task.batch(self.seed, step, self.index, self.count, self.batch_size)


def _build(task: ZooTask, size: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return task.build(size)


def _train_async(
    task: ZooTask, size: str, steps: int, batch_size: int, seed: int, lr: float, opts: dict
) -> tuple[nn.Module | None, int]:
    """``run_async`` with the ranks after 0 as workers; rank 0 gets the trained model."""
    from thinwire.localsgd import AsyncConfig, Task, load_trained, run_async

    workers = dist.get_world_size() - 1
    job = Task(
        model=lambda: _build(task, size, seed),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        shards=lambda n: [_Shard(task, seed, i, n, batch_size) for i in range(n)],
        loss=task.loss,
    )
    summary = run_async(job, AsyncConfig(**({"steps": steps, "seed": seed} | opts)))
    if dist.get_rank() != 0:
        return None, workers
    return load_trained(_build(task, size, seed), summary), workers


def train_piece(
    task: ZooTask,
    piece: str,
    *,
    size: str = "tiny",
    steps: int = 150,
    batch_size: int = 64,
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> PieceResult:
    """Train ``task``'s model with ``piece`` for ``steps`` steps on every rank of the
    default group and evaluate it on rank 0 (other ranks return ``metrics={}``).

    ``options`` go to the piece (e.g. ``{"freeze_step": 40}`` for the 1-bit optimizers,
    ``{"warmup_steps": 15}`` for the hook, ``{"sync_every": 10}`` for DiLoCo, AsyncConfig
    fields for ``async``), on top of thinwire's defaults; ``{"lr": ...}`` replaces the
    task's tuned learning rate.
    """
    if piece not in BASELINES:
        raise ValueError(f"unknown zoo piece {piece!r}; choose from {', '.join(PIECES)}")
    opts = dict(options or {})
    rank = dist.get_rank()
    lr = opts.pop("lr", task.lr["lamb" if "lamb" in piece else "adam"])
    capture = _Capture()
    logger = logging.getLogger("thinwire")
    logger.addHandler(capture)
    COUNTER.reset()
    w = _Wiring()
    compressed = 0
    start = time.perf_counter()
    try:
        if piece in ASYNC_PIECES:
            w.model, _ = _train_async(task, size, steps, batch_size, seed, lr, opts)
        else:
            _wire(w, task, piece, size, seed, lr, opts, steps)
            compressed = _train_steps(w, task, steps, seed, batch_size)
            if w.diloco is not None:
                w.diloco.__exit__(None, None, None)
        seconds = time.perf_counter() - start
        metrics = task.evaluate(w.model, seed) if w.model is not None and rank == 0 else {}
        return PieceResult(
            model=task.name,
            piece=piece,
            seed=seed,
            steps=steps,
            metrics=metrics,
            wire_bytes=COUNTER.wire_bytes,
            skipped_steps=int(getattr(w.opt, "skipped_steps", 0)),
            seconds=seconds,
            freeze_step=getattr(w.opt, "freeze_step", None),
            compressed_steps=compressed,
            notes=capture.lines,
        )
    finally:
        logger.removeHandler(capture)
        if hasattr(w.hook, "close"):
            w.hook.close()
        # Free what holds the group before it is torn down (see docs/reliability.md).
        w.net = w.opt = w.model = w.hook = w.diloco = None
        gc.collect()


@dataclass
class _Wiring:
    """What one piece is wired from. The helpers keep these objects here, never in
    locals of their own, so that :func:`train_piece` frees them all before the group is
    torn down, also when a helper raises."""

    model: nn.Module | None = None
    net: nn.Module | None = None
    opt: Any = None
    hook: Any = None
    diloco: Any = None


def _wire(
    w: _Wiring,
    task: ZooTask,
    piece: str,
    size: str,
    seed: int,
    lr: float,
    opts: dict[str, Any],
    steps: int,
) -> None:
    """Build the model and wire ``piece`` into it the way a user would, into ``w``."""
    from thinwire.comm.register import register_comm_hook
    from thinwire.optim import Lamb, OneBitAdam, OneBitLamb

    w.model = _build(task, size, seed)
    if piece == "diloco":
        from thinwire.localsgd import DiLoCo

        w.net = w.model
        w.opt = torch.optim.AdamW(w.model.parameters(), lr=lr)
        w.diloco = DiLoCo(w.model, w.opt, **({"sync_every": 10} | opts))
        w.diloco.__enter__()
    elif piece in ("adamw", "adamw-onebit-hook"):
        w.net = nn.parallel.DistributedDataParallel(w.model)
        w.opt = torch.optim.AdamW(w.model.parameters(), lr=lr)
        method = "fp32" if piece == "adamw" else "onebit"
        w.hook = register_comm_hook(w.net, method, optimizer=w.opt, **opts)
    else:
        w.net = nn.parallel.DistributedDataParallel(w.model)
        cls = {"lamb": Lamb, "onebit-lamb": OneBitLamb, "onebit-adam": OneBitAdam}
        if piece != "lamb":
            opts.setdefault("total_steps", steps)
        w.opt = cls[piece](w.model.parameters(), lr=lr, **opts)
        w.opt.register_ddp(w.net)


def _train_steps(w: _Wiring, task: ZooTask, steps: int, seed: int, batch_size: int) -> int:
    """The user's loop over ``steps`` batches; returns the steps taken compressing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    compressed = 0
    for step in range(steps):
        loss = task.loss(w.net, task.batch(seed, step, rank, world, batch_size))
        loss.backward()
        compressed += int(getattr(w.opt, "compressing", False))
        w.opt.step()
        w.opt.zero_grad(set_to_none=True)
    return compressed
