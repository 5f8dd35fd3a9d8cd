"""Record a training run the way the analyzer reads it, while it trains.

A :class:`StepRecorder` rides along with a training loop through PyTorch's own hooks:

* a forward pre-hook and a forward hook on the model: when a step starts and when its
  forward pass ends (the backward pass starts right after, with the loss);
* a post-accumulate-grad hook on every parameter: when its gradient became ready;
* a wrapper around the DDP comm hook (:meth:`StepRecorder.wrap_hook`): when each bucket
  was launched, which parameters it held, its bytes, how long the hook itself computed
  before handing the collective over (a codec's compute shows here) and when the
  collective finished, so its achieved bandwidth;
* step pre- and post-hooks on the optimizer: its time, and the end of the step; for
  thinwire's 1-bit optimizers also the share of it their compressed exchange took, and
  of that the time spent waiting for the network (the rest is the codec's compute).

It writes one JSON line per recorded step to a file (``record.jsonl``, format
``thinwire.record/1``; the first line is a header naming the parameters, the world size
and what the caller adds under ``meta``). ``thinwire analyze run OUT/`` turns the file
into the what-if table of the job that produced it (:mod:`thinwire.analysis.recorded`),
instead of profiling a separate, lone worker that does not share the cores or the
network as the real run does.

In your own loop it is one line, after building the DDP model and the optimizer::

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters())
    rec = record_run(ddp, opt, "runs/mine/record.jsonl")   # rank 0 writes the file
    for x, y in batches:                                     # the loop is unchanged
        loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()
    rec.close()

With no comm hook on ``ddp`` yet, :func:`record_run` registers thinwire's counted fp32
average (DDP's own math); pass ``hook=(state, fn)`` to record your hook instead, since
DDP takes one hook, once. A DDP model that already has a hook is recorded without its
buckets, and the recorder says so in one line (thinwire's
:class:`~thinwire.comm.resumable_ddp.ResumableDDP`, which the trainer uses, lets the
recorder time its hook in place).

Cost: a clock read per parameter per step and one small JSON line per recorded step.
Every step of the first ``dense_steps`` is recorded, then one in ``every``; the steps
in between only pay for the hooks' early return. On CUDA the times are the host's
(when the work was issued and when its result was waited for), not the GPU stream's.

Tuning: ``dense_steps`` (50) covers warmup and the first stage of a two-stage
optimizer; ``every`` (10) keeps a long run's file small (a few KiB per recorded step
for a model of a hundred tensors).
"""

# No `from __future__ import annotations`: DDP inspects a comm hook's annotations at
# registration and rejects string annotations.
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.accounting import COUNTER
from thinwire.io import atomic_write_text

__all__ = ["RECORD_FORMAT", "RECORD_NAME", "StepRecorder", "record_run"]

RECORD_FORMAT = "thinwire.record/1"
"""The format tag of a record's header line."""

RECORD_NAME = "record.jsonl"
"""The name ``thinwire train`` gives its record in the run's directory."""

_log = logging.getLogger("thinwire.comm")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _exchange_counters(opt: Any) -> tuple[float, float] | None:
    """A 1-bit optimizer's (exchange seconds, of them waiting), as counters; None for
    an optimizer without a compressed exchange."""
    total, wait = getattr(opt, "exchange_s", None), getattr(opt, "exchange_wait_s", None)
    if isinstance(total, float) and isinstance(wait, float):
        return total, wait
    return None


class _Step:
    """What one step has recorded so far."""

    __slots__ = (
        "buckets",
        "exchange0",
        "forward_end",
        "forward_s",
        "opt_start",
        "ready",
        "start",
    )

    def __init__(self, start: float) -> None:
        self.start = start
        self.forward_end: float | None = None
        self.forward_s = 0.0
        self.opt_start: float | None = None
        self.exchange0: tuple[float, float] | None = None
        self.ready: dict[int, float] = {}
        self.buckets: list[dict[str, Any]] = []


class StepRecorder:
    """Records the steps of a training loop (see the module docstring).

    Args:
        model: the module the loop calls (a DDP model, or a plain one).
        optimizer: the optimizer whose ``step()`` ends a training step.
        path: the record file (appended to: a resumed run, ``start_step`` > 0,
            continues it, the steps past ``start_step`` that the stopped run recorded
            dropped first); None records in memory only (:attr:`steps`).
        dense_steps: record every one of the first this many steps.
        every: after them, record one step in this many.
        write: whether this process writes ``path`` (default: rank 0 of the group).
        meta: what the header says besides (the model's name, the batch size, the
            link rate...); it must be JSON.
        start_step: the optimizer steps done before (a resumed run's): step numbers
            continue from it, and the cadence counts from the run's first step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        path: str | Path | None = None,
        *,
        dense_steps: int = 50,
        every: int = 10,
        write: bool | None = None,
        meta: dict[str, Any] | None = None,
        start_step: int = 0,
    ) -> None:
        if dense_steps < 0 or every < 1:
            raise ValueError(f"dense_steps must be >= 0 and every >= 1, got {dense_steps}, {every}")
        self.model, self.optimizer = model, optimizer
        self.dense_steps, self.every = dense_steps, every
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        writes = write if write is not None else rank == 0
        self.path = Path(path) if path is not None and writes else None
        self._in_memory = path is None  # another rank writes the file: keep nothing here
        self.meta = dict(meta or {})
        self.steps: list[dict[str, Any]] = []
        """The recorded steps, when there is no file (``path=None``)."""
        self.step = self._start = start_step
        """Optimizer steps done so far (from ``start_step``)."""
        self._params = list(_inner(model).parameters())
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._open: _Step | None = None
        self._forward_started = 0.0
        self._lock = threading.Lock()
        self._header_written = False
        if self.path is not None and start_step > 0 and self.path.exists():
            self._drop_after_start()
        self._bytes0 = COUNTER.wire_bytes
        self._handles = [
            model.register_forward_pre_hook(self._on_forward_start),
            model.register_forward_hook(self._on_forward_end),
            optimizer.register_step_pre_hook(self._on_opt_start),
            optimizer.register_step_post_hook(self._on_opt_end),
        ]
        for i, p in enumerate(self._params):
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_ready(i)))

    # -- what the hooks see -----------------------------------------------------------

    def _sampled(self) -> bool:
        k = self.step
        return k < self.dense_steps or (k - self.dense_steps) % self.every == 0

    def _on_forward_start(self, module: nn.Module, args: Any) -> None:
        if not (torch.is_grad_enabled() and module.training) or not self._sampled():
            return  # an evaluation pass, or a step not recorded
        now = time.perf_counter()
        if self._open is None:
            self._open = _Step(now)
        self._open.forward_end = None
        self._forward_started = now

    def _on_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        step = self._open
        if step is None or not (torch.is_grad_enabled() and module.training):
            return
        now = time.perf_counter()
        step.forward_s += now - self._forward_started
        step.forward_end = now  # gradient accumulation: the last micro-batch's

    def _on_ready(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            step = self._open
            if step is not None and step.forward_end is not None:
                step.ready[index] = time.perf_counter() - step.forward_end

        return hook

    def _on_opt_start(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._open is not None:
            self._open.opt_start = time.perf_counter()
            self._open.exchange0 = _exchange_counters(opt)

    def _on_opt_end(self, opt: Any, args: Any, kwargs: Any) -> None:
        step, self._open = self._open, None
        self.step += 1
        if step is None or step.forward_end is None or step.opt_start is None:
            return
        now = time.perf_counter()
        wire = COUNTER.wire_bytes
        with self._lock:
            buckets = sorted(step.buckets, key=lambda b: b["launch_s"])
        record = {
            "step": self.step,
            "step_s": now - step.start,
            "forward_s": step.forward_s,
            "backward_s": step.opt_start - step.forward_end,
            "optimizer_s": now - step.opt_start,
            "ready_s": [step.ready.get(i) for i in range(len(self._params))],
            "buckets": buckets,
            "wire_bytes": wire - self._bytes0,
        }
        after = _exchange_counters(opt)
        if after is not None and step.exchange0 is not None:
            # A 1-bit optimizer: its exchange's share of optimizer_s, and the waits in it.
            record["exchange_s"] = after[0] - step.exchange0[0]
            record["exchange_wait_s"] = after[1] - step.exchange0[1]
        self._bytes0 = wire
        self._write(record)

    # -- the comm hook ------------------------------------------------------------------

    def wrap_hook(self, hook: Hook) -> Hook:
        """``hook`` (a DDP comm hook ``hook(state, bucket) -> Future``), timed: register the
        result with DDP in its place."""
        recorder = self

        def timed(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            step = recorder._open
            if step is None or step.forward_end is None:
                return hook(state, bucket)
            launch = time.perf_counter()
            buf = bucket.buffer()
            entry: dict[str, Any] = {
                "params": [recorder._index.get(id(p), -1) for p in bucket.parameters()],
                "bytes": buf.numel() * buf.element_size(),
                "launch_s": launch - step.forward_end,
            }
            fut = hook(state, bucket)
            entry["hook_s"] = time.perf_counter() - launch
            with recorder._lock:
                step.buckets.append(entry)

            def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                entry["done_s"] = time.perf_counter() - (step.forward_end or launch)
                return f.value()

            return fut.then(done)

        timed.__qualname__ = f"recorded({getattr(hook, '__qualname__', 'hook')})"
        return timed

    # -- the file -----------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        """The record's first line: format, parameters, world, optimizer and ``meta``."""
        inner = _inner(self.model)
        names = {id(p): n for n, p in inner.named_parameters()}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        backend = dist.get_backend() if world > 1 or dist.is_initialized() else None
        device = self._params[0].device.type if self._params else "cpu"
        return {
            "format": RECORD_FORMAT,
            "model": type(inner).__name__,
            "optimizer": type(self.optimizer).__name__,
            "world_size": world,
            "backend": backend,
            "device": device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "params": [
                {
                    "name": names.get(id(p), f"param{i}"),
                    "index": i,
                    "nbytes": p.numel() * p.element_size(),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "trainable": p.requires_grad,
                }
                for i, p in enumerate(self._params)
            ],
            "meta": self.meta,
        }

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            if self._in_memory:
                self.steps.append(record)
            return
        lines = []
        if not self._header_written:
            self._header_written = True
            if not (self.path.exists() and self.path.stat().st_size > 0):
                lines.append(json.dumps(self.header()))
        lines.append(json.dumps(record))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("\n".join(lines) + "\n")

    def _drop_after_start(self) -> None:
        """A resumed run continues its file: the steps recorded after its checkpoint by
        the run that stopped are dropped first, so no step is in the file twice."""
        assert self.path is not None
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # cut short by the stop: unreadable, and not a step of the run
            step = record.get("step") if isinstance(record, dict) else None
            if not (isinstance(step, int) and step > self._start):
                kept.append(line)  # the header, and the steps up to the checkpoint
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

    def close(self) -> None:
        """Remove every hook (the comm hook stays registered, and stops recording)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._open = None

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | Path | None = None,
    *,
    hook: tuple[object, Hook] | None = None,
    **kwargs: Any,
) -> StepRecorder:
    """Record a training loop in one line (see the module docstring); the recorder.

    ``model`` is the module the loop calls; when it is a DDP model without a comm hook,
    thinwire's counted fp32 average is registered on it (``hook=(state, fn)``: yours),
    timed. ``kwargs`` go to :class:`StepRecorder`.
    """
    from thinwire.comm.register import register_comm_hook
    from thinwire.comm.resumable_ddp import ResumableDDP

    rec = StepRecorder(model, optimizer, path, **kwargs)
    if isinstance(model, ResumableDDP) and model.has_hook:
        model.wrap_hook(rec.wrap_hook)
    elif isinstance(model, DistributedDataParallel):
        if getattr(model, "_comm_hooks", None):
            _log.warning(
                "thinwire: the DDP model has a comm hook already, so its buckets are not "
                "recorded; pass it as record_run(..., hook=(state, fn)) instead"
            )
        elif hook is not None:
            model.register_comm_hook(hook[0], rec.wrap_hook(hook[1]))
        else:
            register_comm_hook(model, "fp32", wrap=rec.wrap_hook)
    elif hook is not None:
        raise ValueError("hook= needs a DistributedDataParallel model to register it on")
    return rec
