"""Measure a :class:`~thinwire.analysis.profile.Profile` by running a model on one worker.

:func:`profile_model` trains any ``nn.Module`` for a few steps and times, per step, the
forward pass, the backward pass, the optimizer step and the whole iteration, and, in
the same backward pass, the moment each parameter's gradient is accumulated
(``Tensor.register_post_accumulate_grad_hook``: all parameters in one pass, where the
paper hooked one parameter per run). Times are medians over the measured steps, so one
slow step (a page fault, another process on the core) does not move the prediction.

:func:`observe_ddp_buckets` wraps a copy of the model in a real
``DistributedDataParallel`` on a one-rank gloo group and records, with a comm hook,
which parameters DDP put in each bucket and in what order it launched them.

Tuning: ``warmup`` steps absorb allocator growth and kernel selection (2-3 is enough on
CPU; use more on GPU with cuDNN autotuning); ``steps`` trades run time for stable
medians (5-20). On CUDA the ready times come from CUDA events recorded in the hooks, so
they are GPU-stream times, not the host's launch times.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from thinwire.analysis.profile import ParamTiming, Profile
from thinwire.comm.launch import free_port
from thinwire.errors import ConfigError

__all__ = ["LossFn", "gpt_loss", "observe_ddp_buckets", "profile_gpt", "profile_model"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss``: runs the forward pass and returns the loss."""


class _Clock:
    """Host clock on CPU; CUDA events (stream time) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def since(self, start: Any, end: Any) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return float(start.elapsed_time(end)) * 1e-3
        return float(end - start)


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Loss function for :class:`thinwire.train.model.GPT` and ``(inputs, targets)`` batches."""
    _, loss = model(*batch)
    return loss


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def profile_model(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    warmup: int = 2,
    steps: int = 5,
    name: str | None = None,
    batch_size: int | None = None,
) -> Profile:
    """Time ``steps`` training steps of ``model`` on ``batch`` after ``warmup`` steps.

    The model is trained in place (``optimizer`` defaults to AdamW at lr 1e-4, so the
    profile includes a realistic optimizer cost). Parameters that never receive a
    gradient keep ``ready_s=None`` and are reported as frozen.

    Raises:
        ConfigError: ``steps < 1``, ``warmup < 0``, a model without parameters, or a
            loss that is not a scalar tensor.
    """
    if steps < 1 or warmup < 0:
        raise ConfigError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    named = list(model.named_parameters())
    if not named:
        raise ConfigError("the model has no parameters; there is nothing to communicate")
    device = _device_of(model)
    clock = _Clock(device)
    trainable = [p for _, p in named if p.requires_grad]
    if optimizer is None and trainable:
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    marks: dict[int, Any] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda _t, i=i: marks.__setitem__(i, clock.mark()))
        for i, (_, p) in enumerate(named)
        if p.requires_grad
    ]
    times = _StepTimes.of(len(named))
    try:
        for step in range(warmup + steps):
            marks.clear()
            t0, t1, t2, t3 = _timed_step(model, batch, loss_fn, optimizer, clock)
            if step < warmup:
                continue
            times.add(clock, marks, t0, t1, t2, t3)
    finally:
        for h in handles:
            h.remove()
    return Profile(
        model=name or type(model).__name__,
        iteration_s=float(np.median(times.it)),
        backward_s=float(np.median(times.bwd)),
        forward_s=float(np.median(times.fwd)),
        optimizer_s=float(np.median(times.opt)),
        params=times.params(named),
        source="measured",
        device=str(device),
        batch_size=batch_size,
        steps=steps,
        meta={"threads": torch.get_num_threads(), "torch": torch.__version__},
    )


def _timed_step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    clock: _Clock,
) -> tuple[Any, Any, Any, Any]:
    """One training step; the clock's marks at its start, after the forward pass, after
    the backward pass and after the optimizer step."""
    t0 = clock.mark()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError("loss_fn must return a scalar tensor")
    t1 = clock.mark()
    if loss.requires_grad:
        loss.backward()
    t2 = clock.mark()
    if optimizer is not None:
        optimizer.step()
    t3 = clock.mark()
    return t0, t1, t2, t3


@dataclass
class _StepTimes:
    """The times of the measured steps, and when each parameter's gradient was ready."""

    fwd: list[float]
    bwd: list[float]
    opt: list[float]
    it: list[float]
    ready: list[list[float]]
    seen: list[int]

    @classmethod
    def of(cls, n_params: int) -> _StepTimes:
        return cls([], [], [], [], [[] for _ in range(n_params)], [0] * n_params)

    def add(self, clock: _Clock, marks: dict[int, Any], t0: Any, t1: Any, t2: Any, t3: Any) -> None:
        self.fwd.append(clock.since(t0, t1))
        self.bwd.append(clock.since(t1, t2))
        self.opt.append(clock.since(t2, t3))
        self.it.append(clock.since(t0, t3))
        for i, m in marks.items():
            self.ready[i].append(max(0.0, clock.since(t1, m)))
            self.seen[i] += 1

    def params(self, named: list[tuple[str, nn.Parameter]]) -> list[ParamTiming]:
        return [
            ParamTiming(
                name=n,
                index=i,
                nbytes=p.numel() * p.element_size(),
                dtype=str(p.dtype).replace("torch.", ""),
                # A gradient seen in only some steps is treated as ready in the median step.
                ready_s=float(np.median(self.ready[i])) if self.seen[i] else None,
            )
            for i, (n, p) in enumerate(named)
        ]


def observe_ddp_buckets(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    bucket_cap_mb: float | None = None,
    iterations: int = 3,
) -> list[list[int]]:
    """Parameter indices of each bucket a real DDP launched, in launch order.

    Runs ``iterations`` backward passes of a deep copy of ``model`` under DDP on a fresh
    one-rank gloo group (so it works on any machine and leaves ``model`` untouched) and
    returns the buckets of the last pass, after DDP's first-iteration rebuild. The
    indices are positions in ``model.parameters()``. ``bucket_cap_mb=None`` is DDP's
    default (25 MiB, first bucket 1 MiB).
    """
    if dist.is_available() and dist.is_initialized():
        raise ConfigError(
            "observe_ddp_buckets makes its own one-rank group; call it outside a process group"
        )
    if iterations < 2:
        raise ConfigError(f"need >= 2 iterations to see DDP's rebuilt buckets, got {iterations}")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        replica = copy.deepcopy(model)
        index = {id(p): i for i, p in enumerate(replica.parameters())}
        ddp = nn.parallel.DistributedDataParallel(replica, bucket_cap_mb=bucket_cap_mb)
        seen: list[tuple[int, list[int]]] = []

        # No annotations on the hook: DDP compares them with the real classes, and this
        # module's postponed (string) annotations would fail that check.
        def record(_state, bucket):  # type: ignore[no-untyped-def]
            seen.append((bucket.index(), [index[id(p)] for p in bucket.parameters()]))
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())  # one rank: the local gradient is the average
            return fut

        ddp.register_comm_hook(None, record)
        try:
            for _ in range(iterations):
                seen.clear()
                ddp.zero_grad(set_to_none=True)
                loss_fn(ddp, batch).backward()
        except RuntimeError as exc:
            # Typically parameters the loss never uses: DDP then needs
            # find_unused_parameters, whose buckets this observation would not represent.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "error"
            raise ConfigError(f"DDP could not train this model: {first}") from None
        return [indices for _, indices in seen]
    finally:
        dist.destroy_process_group()


def _profile_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer | None:
    if name == "adamw":
        return None  # profile_model's default
    if name in ("onebit-lamb", "onebit-adam"):
        from thinwire.optim import OneBitAdam, OneBitLamb

        cls = OneBitLamb if name == "onebit-lamb" else OneBitAdam
        return cls(model.parameters(), lr=1e-4, freeze_step=1)
    raise ConfigError(f"cannot profile optimizer {name!r}; choose adamw, onebit-lamb, onebit-adam")


def profile_gpt(
    preset: str = "tiny",
    batch_size: int = 8,
    *,
    warmup: int = 2,
    steps: int = 5,
    observe_ddp: bool = False,
    bucket_cap_mb: float | None = None,
    seed: int = 0,
    optimizer: str = "adamw",
) -> Profile:
    """Profile thinwire's own GPT (``tiny``/``small``/``base``) on CPU with real text batches.

    ``optimizer``: ``adamw`` (the default), or ``onebit-lamb`` / ``onebit-adam`` past
    their warmup (``freeze_step=1``, so the timed steps run the compression stage's
    update; in one process their collective sends nothing: price it, and its codec,
    with the network model).
    """
    from thinwire.train.data import TextData
    from thinwire.train.model import GPT, PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    torch.manual_seed(seed)
    cfg = PRESETS[preset]
    model = GPT(cfg)
    batch = TextData(None, seq_len=cfg.seq_len).batch(0, batch_size)
    observed = (
        observe_ddp_buckets(model, batch, gpt_loss, bucket_cap_mb=bucket_cap_mb)
        if observe_ddp
        else None
    )
    prof = profile_model(
        model,
        batch,
        gpt_loss,
        _profile_optimizer(optimizer, model),
        warmup=warmup,
        steps=steps,
        name=f"gpt-{preset}",
        batch_size=batch_size,
    )
    prof.observed_buckets = observed
    prof.meta["seq_len"] = cfg.seq_len
    return prof
