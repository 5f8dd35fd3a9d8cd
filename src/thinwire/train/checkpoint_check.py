"""What a checkpoint must hold before a resume trusts it (:mod:`thinwire.train.checkpoint`).

A checkpoint file is plain data (``safe_load``), but plain data can still be wrong: a
tensor of another shape, a missing entry, an optimizer switch flipped, a random-number
state the generator refuses. Each would fail later, mid-resume, with a traceback from
deep inside torch, or worse, train on silently. These checks run first and turn every
such file into one :class:`~thinwire.errors.ConfigError` line that names the file and
what is wrong with it, before anything of the resume has happened.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from thinwire.errors import ConfigError
from thinwire.optim.sharded import local
from thinwire.train.config import short_repr

__all__ = ["applying", "check_groups_fit", "check_model_state", "check_rank_state", "damaged"]


def damaged(path: Path, what: str) -> ConfigError:
    """The one line for a checkpoint file whose content is not what thinwire wrote."""
    return ConfigError(
        f"checkpoint {path} is damaged: {what}; restore it, or resume from an earlier checkpoint"
    )


def check_model_state(path: Path, state: Any, model: nn.Module | None) -> None:
    """``state`` holds exactly ``model``'s weights: every name, shape and dtype, finite."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise damaged(
            path, f"the model weights are a {type(state).__name__}, not a table of tensors"
        )
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            raise damaged(
                path, f"weight {short_repr(name)} is a {type(tensor).__name__}, not a tensor"
            )
    if model is not None:
        expected = model.state_dict()
        missing = [k for k in expected if k not in state]
        if missing:
            raise damaged(path, f"weight {missing[0]!r} is missing ({len(missing)} missing in all)")
        unknown = [k for k in state if k not in expected]
        if unknown:
            raise damaged(path, f"it holds {short_repr(unknown[0])}, which the model does not have")
        for name, want in expected.items():
            got = state[name]
            if got.shape != want.shape:
                raise damaged(
                    path,
                    f"weight {name!r} has shape {list(got.shape)}, the model's is "
                    f"{list(want.shape)}",
                )
            if got.dtype != want.dtype:
                raise damaged(path, f"weight {name!r} is {got.dtype}, the model's is {want.dtype}")
    for name, tensor in state.items():
        # The divergence guard never lets a non-finite model be saved: such a file was
        # altered, and training from it would fail at its first step.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise damaged(path, f"weight {name!r} holds nan or inf")


_RANK_KEYS = ("rank", "step", "optimizer", "strategy", "rng", "bytes", "elapsed_s")
"""What every ``rank{r}.pt`` holds (see the trainer's ``_save``)."""

_GROUP_NUMBERS = ("lr", "weight_decay", "eps", "momentum")
"""Optimizer group settings that are numbers in every optimizer that has them."""


def _check_optimizer_state(path: Path, opt: Any, model: nn.Module | None) -> None:
    """``opt`` is an optimizer ``state_dict`` over ``model``'s parameters: groups that
    list each parameter once, and per-parameter tensors of that parameter's shape."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict):
        raise damaged(path, "the optimizer state is not a table with a 'state' entry")
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise damaged(path, "the optimizer's parameter groups are missing or not tables")
    order: list[int] = []
    for g in groups:
        params = g.get("params")
        if not isinstance(params, list) or not all(type(i) is int for i in params):
            raise damaged(path, "an optimizer parameter group does not list its parameters")
        order += params
        for key in _GROUP_NUMBERS:
            value = g.get(key, 0.0)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise damaged(path, f"the optimizer's {key} is {short_repr(value)}, not a number")
        betas = g.get("betas", (0.9, 0.999))
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise damaged(path, f"the optimizer's betas are {short_repr(betas)}, not two numbers")
    if len(set(order)) != len(order):
        raise damaged(path, "the optimizer lists a parameter twice")
    # this rank's shard of a parameter FSDP2 split (the file holds plain shards)
    shapes = [local(p).shape for p in model.parameters()] if model is not None else None
    if shapes is not None and len(order) != len(shapes):
        raise damaged(
            path, f"the optimizer holds {len(order)} parameters, the model has {len(shapes)}"
        )
    # Every parameter with state has the same entries (AdamW: step, exp_avg, exp_avg_sq);
    # one without an entry the others have fails at the next step, with a KeyError.
    kinds = {frozenset(v) for v in opt["state"].values() if isinstance(v, dict)}
    if len(kinds) > 1:
        common = frozenset.intersection(*kinds)
        odd = next(k for k in frozenset.union(*kinds) if k not in common)
        raise damaged(path, f"the optimizer's {short_repr(odd)} is missing for some parameters")
    # Every algorithm builds its optimizer over model.parameters(), in that order.
    shape_of = dict(zip(order, shapes, strict=True)) if shapes is not None else {}
    for index, per_param in opt["state"].items():
        if index not in order or not isinstance(per_param, dict):
            raise damaged(
                path, f"the optimizer holds state for an unknown parameter {short_repr(index)}"
            )
        for key, value in per_param.items():
            want = shape_of.get(index)
            if (
                torch.is_tensor(value)
                and value.dim() > 0
                and want is not None
                and value.shape != want
            ):
                raise damaged(
                    path,
                    f"the optimizer's {key!r} of parameter {index} has shape "
                    f"{list(value.shape)}, the parameter's is {list(want)}",
                )
            if not (
                torch.is_tensor(value) or value is None or isinstance(value, int | float | bool)
            ):
                raise damaged(
                    path,
                    f"the optimizer's {key!r} of parameter {index} is a "
                    f"{type(value).__name__}, not a tensor or a number",
                )


def _check_rng(path: Path, rng: Any) -> None:
    """``rng`` is a state the CPU generator takes: tried on it, then the current one put
    back, so a bad state is refused before anything of the resume happened."""
    current = torch.get_rng_state()
    try:
        torch.set_rng_state(rng)
    except (RuntimeError, TypeError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise damaged(path, f"its random-number state is unusable ({detail})") from None
    finally:
        torch.set_rng_state(current)


def check_rank_state(path: Path, blob: dict[str, Any], model: nn.Module | None) -> None:
    missing = [k for k in _RANK_KEYS if k not in blob]
    if missing:
        raise damaged(path, f"{missing[0]!r} is missing")
    _check_optimizer_state(path, blob["optimizer"], model)
    if blob["strategy"] is not None and not isinstance(blob["strategy"], dict):
        raise damaged(path, f"the algorithm's state is a {type(blob['strategy']).__name__}")
    _check_rng(path, blob["rng"])
    counts = blob["bytes"]
    fields = {"calls", "payload_bytes", "wire_bytes"}
    if not isinstance(counts, dict) or not all(
        isinstance(v, dict)
        and set(v) <= fields
        and all(type(n) is int and n >= 0 for n in v.values())
        for v in counts.values()
    ):
        raise damaged(path, "its byte counters are not counts")
    elapsed = blob["elapsed_s"]
    if type(elapsed) not in (int, float) or not 0 <= elapsed < math.inf:
        raise damaged(path, f"its training time is {short_repr(elapsed)}, not seconds")


def applying(path: Path, apply: Callable[[], None]) -> None:
    """Run ``apply`` (loading a checked state into live objects); whatever it raises is
    the checkpoint's fault (the objects are fresh), so it becomes one line naming the
    file, with the exception's own first line so that the cause stays visible."""
    try:
        apply()
    except ConfigError:
        raise
    except Exception as exc:  # every loader raises its own types for state it cannot take
        text = str(exc).strip()
        detail = f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise damaged(path, f"its state does not load ({detail})") from None


def check_groups_fit(path: Path, saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """The saved parameter groups have the live optimizer's settings: the same names,
    numbers where it has numbers, and the same switches (``amsgrad``, ``capturable``,
    ``foreach``: how the optimizer was built, which a resume cannot change, and which
    fail only at the next step when they differ)."""
    if len(saved) != len(live):
        raise damaged(path, f"the optimizer has {len(saved)} parameter groups, not {len(live)}")
    for got, want in zip(saved, live, strict=True):
        for key in sorted(set(got) ^ set(want)):
            where = "is missing" if key in want else "is not an option of this optimizer"
            raise damaged(path, f"the optimizer's {short_repr(key)} {where}")
        for key, value in want.items():
            if key == "params":
                continue
            found = got[key]
            if isinstance(value, bool) or value is None or isinstance(value, str):
                if found != value or type(found) is not type(value):
                    raise damaged(
                        path,
                        f"the optimizer's {key} is {short_repr(found)}, this run builds it "
                        f"with {value!r}",
                    )
            elif isinstance(value, int | float):
                if not (isinstance(found, int | float) and not isinstance(found, bool)):
                    raise damaged(
                        path, f"the optimizer's {key} is {short_repr(found)}, not a number"
                    )
            elif isinstance(value, list | tuple):
                ok = isinstance(found, list | tuple) and len(found) == len(value)
                if not ok or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in found
                ):
                    raise damaged(
                        path,
                        f"the optimizer's {key} is {short_repr(found)}, not {len(value)} numbers",
                    )
