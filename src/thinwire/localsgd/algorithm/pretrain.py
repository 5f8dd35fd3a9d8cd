"""Where Local-SGD starts: from scratch, from N steps of ordinary training, or from a file.

Local-SGD and its asynchronous variants are methods for the long middle of a training
run. The asynchronous Local-SGD paper starts every method from a checkpoint of 24k steps
of ordinary training; DiLoCo's outer lr 0.7 and momentum 0.9 were tuned there. From
scratch, the first rounds move the model so far that outer momentum mostly amplifies
noise, and short runs from scratch say little about the regime users run. The run's
config says where it starts, and the simulator and ``run_async`` apply it; a
:class:`Start` applies it to any :class:`~thinwire.localsgd.Task` for other uses::

    cfg = AsyncConfig(pretrain_steps=1000)        # or init_from="base.pt"
    summary = run_async(task, cfg)                # summary["start"] says which
    task = Start(pretrain_steps=1000).apply(task, shards=4)   # the pretrained Task

* ``pretrain_steps=N``: ``N`` steps of ordinary synchronous data-parallel training of
  ``task.model()`` with ``task.optimizer``, one batch per shard per step (gradients
  averaged: with one shard per worker, the default, what DDP on W ranks computes), the
  learning rate warming up linearly over ``warmup_steps`` and then held at its peak.
* ``init_from=PATH``: a file holding the model's ``state_dict`` (``torch.save``), or a
  dict with it under ``"model"``; loaded with thinwire's plain-data loader, names and
  shapes checked against ``task.model()`` in one line.

The pretrained Task's shards continue where the pretraining left off: ``source(step)``
of the Local-SGD phase reads the pretraining's ``source(N + step)``, so no batch of the
pretraining is seen again as if it were new. A file gives no such offset (its data is
not the Task's).

A pretraining of hours survives a stop: hand :func:`pretrain` a
:class:`~thinwire.localsgd.SimCheckpoint` and it keeps the model, the optimizer, the step
and the random generators every ``every_s`` seconds; run again with the same checkpoint and
settings, it goes on from there and returns the very weights an unstopped pretraining
returns (a sweep does this on its own, beside its runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.sim_checkpoint import (
    SimCheckpoint,
    generator_states,
    restore_generators,
)
from thinwire.localsgd.task import BatchSource, Task, make_sources, to_device

__all__ = ["ProgressFn", "Start", "load_start_state", "pretrain"]

ProgressFn = Callable[[int, float], None]
"""Called after each pretraining step with ``(step, loss)``."""


@dataclass(frozen=True)
class Start:
    """How a Local-SGD run starts (see the module docstring); the default is scratch."""

    pretrain_steps: int = 0
    """Steps of ordinary data-parallel training before Local-SGD begins (0: none)."""
    init_from: str | None = None
    """A model state file to start from instead (not together with pretrain_steps)."""
    warmup_steps: int = 0
    """Linear lr warmup of the pretraining (then constant at the optimizer's lr)."""
    grad_clip: float = 0.0
    """Global gradient-norm clip of the pretraining (0: none)."""

    def __post_init__(self) -> None:
        for name in ("pretrain_steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be an integer >= 0, got {value!r}"
                )
        if not isinstance(self.grad_clip, int | float) or not self.grad_clip >= 0:
            raise ConfigError(f"grad-clip must be a number >= 0, got {self.grad_clip!r}")
        if self.init_from is not None and self.pretrain_steps:
            raise ConfigError(
                "give init-from or pretrain-steps, not both: a file is already a trained start"
            )
        if self.init_from is not None and not str(self.init_from).strip():
            raise ConfigError("init-from is an empty path")

    @property
    def from_scratch(self) -> bool:
        return not self.pretrain_steps and self.init_from is None

    def describe(self) -> str:
        """One phrase for summaries and comparison tables."""
        if self.init_from is not None:
            return f"from {self.init_from}"
        if self.pretrain_steps:
            return f"after {self.pretrain_steps:,} steps of ordinary training"
        return "from scratch"

    def apply(
        self,
        task: Task,
        shards: int,
        progress: ProgressFn | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> Task:
        """``task`` starting here: its ``model()`` returns the pretrained (or loaded)
        weights, and after a pretraining its shards continue where it left off. From
        scratch, ``task`` itself. ``shards``: the run's shard count (one per worker by
        default), each of which gives the pretraining one batch per step. ``state``: this start's pretrained weights, computed
        before (a sweep pretrains once per seed, not once per run)."""
        if self.from_scratch:
            return task
        if self.init_from is not None:
            state = load_start_state(Path(self.init_from), task.model())
            offset = 0
        else:
            state = state if state is not None else self.pretrained(task, shards, progress)
            offset = self.pretrain_steps
        return _started(task, state, offset)

    def pretrained(
        self,
        task: Task,
        shards: int,
        progress: ProgressFn | None = None,
        checkpoint: SimCheckpoint | None = None,
        save_every: int = 0,
    ) -> dict[str, torch.Tensor]:
        """This start's pretraining of ``task`` over ``shards`` shards: the weights
        (``checkpoint``, ``save_every``: see :func:`pretrain`)."""
        return pretrain(
            task,
            self.pretrain_steps,
            shards,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
            progress=progress,
            checkpoint=checkpoint,
            save_every=save_every,
        )

    def saved_step(self, checkpoint: SimCheckpoint, shards: int, model: nn.Module) -> int:
        """The step this start's pretraining of ``model`` over ``shards`` shards would go
        on from in ``checkpoint`` (0: no save of these settings there, or one whose
        weights do not fit ``model``). Reads the file, trains nothing: what a caller
        tells processes that wait on the pretraining."""
        plan = _Pretraining(self.pretrain_steps, shards, self.warmup_steps, self.grad_clip)
        state = checkpoint.peek((plan,))
        if state is None or _misfit(state.get("model"), model) is not None:
            return 0
        step = state.get("step")
        return step if type(step) is int and 0 <= step <= self.pretrain_steps else 0

    def continued(self, task: Task) -> Task:
        """``task`` with its shards read on after the pretraining (its weights as they
        are): what a resumed run, or a rank that does not need the weights, uses."""
        if not self.pretrain_steps:
            return task
        return replace(task, shards=_offset_shards(task.shards, self.pretrain_steps))


def pretrain(
    task: Task,
    steps: int,
    shards: int,
    *,
    warmup_steps: int = 0,
    grad_clip: float = 0.0,
    progress: ProgressFn | None = None,
    checkpoint: SimCheckpoint | None = None,
    save_every: int = 0,
) -> dict[str, torch.Tensor]:
    """``steps`` steps of synchronous data-parallel training of a fresh ``task.model()``
    over ``task.shards(shards)`` in this process (each step one batch per shard, the
    gradients averaged); returns the model's ``state_dict`` (CPU tensors).

    ``checkpoint``: keep the pretraining in progress there every ``checkpoint.every_s``
    seconds and go on from a save of the same settings (``checkpoint.resumed_at`` is
    then the step it resumed at; ``progress`` is first called with the step after it).
    The file stays once the pretraining is done: the caller keeps the weights, then
    calls ``checkpoint.discard()``. ``save_every``: save every that many steps and after
    the last one instead (0: by time, and not after the last), for a caller that counts
    in steps and keeps no weights of its own (:func:`~thinwire.localsgd.run_async`: a
    resume after the pretraining goes on from its last save without training)."""
    if shards < 1:
        raise ConfigError(f"pretraining needs at least one shard, got {shards}")
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 0:
        raise ConfigError(f"save_every must be an integer >= 0, got {save_every!r}")
    model = task.model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = task.optimizer(params)
    peaks = [float(g["lr"]) for g in opt.param_groups]
    sources: Sequence[BatchSource] = make_sources(task, shards)
    device = params[0].device
    first = 0
    if checkpoint is not None:
        plan = _Pretraining(steps, shards, warmup_steps, grad_clip)
        saved: list[int] = []
        if checkpoint.resume((plan,), lambda state: saved.append(_restore(state, model, opt))):
            first = checkpoint.resumed_at = saved[0]
    model.train()
    for step in range(first, steps):
        ramp = (step + 1) / warmup_steps if step < warmup_steps else 1.0
        for group, peak in zip(opt.param_groups, peaks, strict=True):
            group["lr"] = peak * ramp
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for source in sources:
            # Each shard's loss scaled by 1/S: the gradient DDP averages over S ranks.
            loss = task.loss(model, to_device(source(step), device)) / len(sources)
            loss.backward()
            total += float(loss.detach())
        if not torch.isfinite(torch.tensor(total)):
            raise ConfigError(
                f"pretraining diverged at step {step + 1} (loss {total}): lower the lr or "
                "add warmup-steps"
            )
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        if checkpoint is not None and _save_now(checkpoint, step + 1, steps, save_every):
            checkpoint.save(
                {
                    "step": step + 1,
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "generators": generator_states(),
                }
            )
        if progress is not None:
            progress(step + 1, total)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _save_now(checkpoint: SimCheckpoint, done: int, steps: int, save_every: int) -> bool:
    """Whether to save after ``done`` of ``steps`` steps."""
    if save_every > 0:
        return done == steps or done % save_every == 0
    return done < steps and checkpoint.due()


@dataclass(frozen=True)
class _Pretraining:
    """What a pretraining's save must match to be resumed from (with the caller's tag)."""

    steps: int
    shards: int
    warmup_steps: int
    grad_clip: float


def _restore(state: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Put a pretraining's save back into ``model`` and ``opt``; returns its step."""
    step = state["step"]
    if type(step) is not int or step < 1:
        raise ValueError(f"the save's step is {step!r}, not a positive whole number")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if "generators" in state:
        restore_generators(state["generators"])
    else:  # saved by a version that kept torch's generator alone
        torch.set_rng_state(state["rng"])
    return step


def load_start_state(path: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model state in ``path``, checked against ``model``'s names and shapes (one-line
    ``ConfigError`` naming the file and the first mismatch)."""
    from thinwire.safeload import safe_load

    blob = safe_load(path, "init-from file")
    if isinstance(blob, dict) and isinstance(blob.get("model"), dict):
        blob = blob["model"]
    if not isinstance(blob, dict) or not all(torch.is_tensor(v) for v in blob.values()):
        raise ConfigError(
            f"init-from file {path} does not hold a model state_dict (name -> tensor)"
        )
    misfit = _misfit(blob, model)
    if misfit is not None:
        raise ConfigError(f"init-from file {path} does not fit the model: {misfit}")
    want = model.state_dict()
    for name in want:
        if blob[name].is_floating_point() and not bool(torch.isfinite(blob[name]).all()):
            raise ConfigError(f"init-from file {path}: {name!r} holds NaN or Inf")
    return {k: blob[k] for k in want}


def _misfit(weights: Any, model: nn.Module) -> str | None:
    """How ``weights`` fail to be a state_dict of ``model``'s names and shapes (the first
    mismatch, as a phrase), or None when they fit."""
    if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
        return "it is not a state_dict (name -> tensor)"
    want = model.state_dict()
    missing = [k for k in want if k not in weights]
    extra = [k for k in weights if k not in want]
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the model lacks"
        return f"it {what} ({len(missing)} missing, {len(extra)} extra)"
    for name, value in want.items():
        if weights[name].shape != value.shape:
            return f"{name!r} has shape {list(weights[name].shape)}, the model's is {list(value.shape)}"
    return None


class _Offset:
    """A batch source read ``offset`` steps further on."""

    def __init__(self, source: BatchSource, offset: int) -> None:
        self.source, self.offset = source, offset

    def __call__(self, step: int) -> Any:
        return self.source(step + self.offset)


class _SizedOffset(_Offset):
    """The same, for a source with a size (shards are planned in proportion to it)."""

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]


def _offset_shards(shards: Callable[[int], Sequence[BatchSource]], offset: int) -> Callable:
    def offset_shards(n: int) -> list[Any]:
        sources = list(shards(n))
        return [(_SizedOffset if hasattr(s, "__len__") else _Offset)(s, offset) for s in sources]

    return offset_shards


def _started(task: Task, state: dict[str, torch.Tensor], offset: int) -> Task:
    build = task.model

    def model() -> nn.Module:
        m = build()
        m.load_state_dict(state)
        return m

    shards = _offset_shards(task.shards, offset) if offset else task.shards
    return replace(task, model=model, shards=shards)
