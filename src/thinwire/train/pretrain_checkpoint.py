"""The pretraining of a run, kept as it goes, so that ``--resume`` goes on from it.

A run that starts from N steps of ordinary training (``--pretrain-steps``) spends them
before its algorithm's first checkpoint; the paper's setting is 24k of them. Without a
save a stop there loses the whole pretraining, and the run cannot even be resumed. So
the pretraining saves itself every ``--checkpoint-interval`` steps and at its end::

    checkpoints/pretrain-00000300.pt   step, run id, settings, model, AdamW state,
                                       torch's generator, the step's loss

written by rank 0 alone (every rank holds the same weights and moments: the gradients
are averaged), then renamed into place, the one before removed. ``--resume`` on a run
that has no checkpoint of its own yet goes on from the newest such file: rank 0 reads
it and sends it to the others (so on several machines only the first needs the
directory; the weights and the optimizer's tensors go one tensor at a time, so no
rank holds a second copy of the whole state), and the pretraining ends with the very
weights an unstopped one reaches.
The file goes once the run's first checkpoint lands.

A file that cannot be used (unreadable, another run's, altered, or made with other
pretraining settings: warmup, clip, betas, weight decay, ranks) is said in one line and
the pretraining starts over: nothing the run has is lost with it. Torch's CPU generator
is kept, as the run's own checkpoints keep it: a pretraining with dropout on a GPU
resumes close to, not exactly on, an unstopped one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.launch import rank as get_rank
from thinwire.comm.launch import world_size as get_world_size
from thinwire.errors import ConfigError, first_line
from thinwire.io import atomic_save
from thinwire.safeload import safe_load

__all__ = ["discard", "latest", "resume", "save"]

_NAME = re.compile(r"pretrain-([0-9]{8,16})\.pt")


def _root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest(out_dir: Path) -> tuple[int, Path] | None:
    """The newest pretraining save in ``out_dir``: ``(step, path)``, or None."""
    found = []
    for path in _root(out_dir).glob("pretrain-*.pt"):
        match = _NAME.fullmatch(path.name)
        if match is not None and path.is_file():
            found.append((int(match.group(1)), path))
    return max(found, default=None)


def save(
    out_dir: Path,
    step: int,
    run_id: str | None,
    settings: dict[str, Any],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss: float,
) -> None:
    """Rank 0: keep the pretraining after ``step`` steps (``loss``: that step's, the mean
    over ranks; ``settings``: what it trains with, which a resume must match); the save
    before goes once this one is in place. A failed write is one line, and the
    pretraining goes on."""
    path = _root(out_dir) / f"pretrain-{step:08d}.pt"
    blob = {
        "step": step,
        "run_id": run_id,
        "settings": settings,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "loss": loss,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(blob, path)
    except OSError as exc:
        before = latest(out_dir)
        kept = f"the save at step {before[0]:,} is kept" if before else "there is no save yet"
        _say(
            f"warning: could not save the pretraining to {path} ({exc.strerror or exc}); it "
            f"goes on ({kept})"
        )
        return
    discard(out_dir, keep=path)


def discard(out_dir: Path, keep: Path | None = None) -> None:
    """Remove the pretraining's saves (all but ``keep``); one that cannot be removed is
    one line (it only takes space: a resume finds the run's own checkpoint first)."""
    for path in _root(out_dir).glob("pretrain-*.pt"):
        if path != keep and _NAME.fullmatch(path.name):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                _say(f"warning: could not remove {path} ({exc.strerror or exc})")


def resume(
    out_dir: Path,
    run_id: str | None,
    steps: int,
    settings: dict[str, Any],
    model: nn.Module,
    opt: torch.optim.Optimizer,
) -> tuple[int, float]:
    """Collective: put the newest pretraining save of this run into ``model`` and
    ``opt`` on every rank; returns its step and that step's loss (``(0, 0.0)``: none, or
    one that cannot be used: other ``settings``, another run's, damaged)."""
    state = _read(out_dir, run_id, steps, settings, model) if get_rank() == 0 else None
    if get_world_size() > 1:
        state = _share(state, model)
    if state is None:
        return 0, 0.0
    if get_rank() == 0:
        model.load_state_dict(state["model"])
    if get_world_size() > 1:  # rank 0's weights, tensor by tensor (no pickled copy)
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["loss"]


def _share(state: dict[str, Any] | None, model: nn.Module) -> dict[str, Any] | None:
    """Rank 0's save on every rank but its weights (sent afterwards, in place): the small
    parts in one message, the optimizer's tensors one by one, so that no rank holds a
    pickled copy of the whole state (a model's size three times over)."""
    outline: list[Any] = [None]
    if state is not None:  # rank 0: every part with each tensor's shape and type only
        outline = [{**state, "model": None, "optimizer": _outline(state["optimizer"])}]
    dist.broadcast_object_list(outline, src=0)
    if outline[0] is None:
        return None
    shared = outline[0]
    tensors = state["optimizer"]["state"] if state is not None else {}
    device = next(model.parameters()).device if dist.get_backend() == "nccl" else None
    for index, entries in shared["optimizer"]["state"].items():
        for name, value in entries.items():
            if not isinstance(value, _Shape):
                continue
            t = (
                tensors[index][name]
                if state is not None
                else torch.empty(value.shape, dtype=value.dtype)
            )
            on = t.to(device) if device is not None else t
            dist.broadcast(on, src=0)
            entries[name] = on.cpu()
    shared["model"] = state["model"] if state is not None else None
    return shared


class _Shape(NamedTuple):
    """A tensor of the optimizer's state, as its outline says it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _outline(opt_state: dict[str, Any]) -> dict[str, Any]:
    """``opt_state`` with each tensor of its ``state`` replaced by its :class:`_Shape`."""
    return {
        "param_groups": opt_state["param_groups"],
        "state": {
            index: {
                name: _Shape(tuple(v.shape), v.dtype) if torch.is_tensor(v) else v
                for name, v in entries.items()
            }
            for index, entries in opt_state["state"].items()
        },
    }


def _read(
    out_dir: Path, run_id: str | None, steps: int, settings: dict[str, Any], model: nn.Module
) -> dict[str, Any] | None:
    """Rank 0: the newest save, checked; None (and one line) when it cannot be used."""
    found = latest(out_dir)
    if found is None:
        return None
    step, path = found
    try:
        blob = safe_load(path, "pretraining save")
        _check(path, blob, step, steps, run_id, settings, model)
    except ConfigError as exc:
        _say(f"warning: {first_line(exc)}; the pretraining starts over")
        return None
    _say(f"the pretraining goes on from {path} at step {step:,} of {steps:,}")
    return {k: blob[k] for k in ("step", "model", "optimizer", "rng", "loss")}


def _check(
    path: Path,
    blob: Any,
    step: int,
    steps: int,
    run_id: str | None,
    settings: dict[str, Any],
    model: nn.Module,
) -> None:
    """That ``blob`` is this run's pretraining at ``step``, with every part of the right
    kind (a ConfigError naming the first that is not)."""
    if not isinstance(blob, dict) or blob.get("run_id") != run_id:
        raise ConfigError(f"pretraining save {path} belongs to another run")
    if blob.get("step") != step or not 0 < step <= steps:
        raise ConfigError(f"pretraining save {path} holds step {blob.get('step')!r}, not {step}")
    if blob.get("settings") != settings:
        raise ConfigError(
            f"pretraining save {path} was made with {blob.get('settings')}, this run "
            f"pretrains with {settings}"
        )
    weights, opt, rng = blob.get("model"), blob.get("optimizer"), blob.get("rng")
    want = model.state_dict()
    if not isinstance(weights, dict) or weights.keys() != want.keys():
        raise ConfigError(f"pretraining save {path} does not hold this model's weights")
    for name, value in want.items():
        if not torch.is_tensor(weights[name]) or weights[name].shape != value.shape:
            raise ConfigError(f"pretraining save {path}: {name!r} is not of the model's shape")
    if not (
        isinstance(opt, dict)
        and isinstance(opt.get("state"), dict)
        and isinstance(opt.get("param_groups"), list)
    ):
        raise ConfigError(f"pretraining save {path} does not hold an optimizer state")
    if not (torch.is_tensor(rng) and rng.dtype == torch.uint8):
        raise ConfigError(f"pretraining save {path} does not hold a random generator state")
    if not isinstance(blob.get("loss"), float):
        raise ConfigError(f"pretraining save {path} does not hold its loss")


def _say(line: str) -> None:
    print(f"thinwire: {line}", file=sys.stderr, flush=True)
