"""Checkpoints that are never half-written, with per-rank state.

Layout under the run's output directory::

    run.json                     identity of the run (config fields that must match on resume)
                                 and its run id
    checkpoints/LATEST           name of the newest complete checkpoint, e.g. "step-00000300"
    checkpoints/step-00000300/
        model.pt                 model weights (rank 0)
        rank0.pt, rank1.pt, ...  each rank's optimizer state, error-feedback buffers, RNG,
                                 byte counters: state that differs between ranks

Every file is written to a temporary name and renamed into place, and ``LATEST`` moves
only after every rank has finished writing (a barrier), so an interrupted save (Ctrl-C,
a crash, a full disk) leaves the previous checkpoint as the one a resume finds.

Every file carries its step and the run id of ``run.json``; a resume refuses a file of
another step or another run (e.g. copied in by hand), instead of continuing from a
mixture.

Multi-node runs: each rank writes and reads only its own ``rank{r}.pt``, and rank 0 alone
reads ``model.pt`` and broadcasts the weights. So the output directory may be shared
storage, or a local directory of the same path on every node.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
from thinwire.io import atomic_save, atomic_write_text, read_input
from thinwire.safeload import safe_load as _safe_load
from thinwire.train.config import TrainConfig, short_repr
from thinwire.train.model import GPT

__all__ = [
    "KEEP",
    "check_run_identity",
    "latest_step",
    "load_model_state",
    "load_rank_state",
    "read_run_id",
    "restore_model",
    "restore_rank_state",
    "safe_load",
    "save_checkpoint",
    "write_run_identity",
]

KEEP = 2
"""Complete checkpoints kept on disk; older ones are removed after a new one lands."""


def _ckpt_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def _step_dir(out_dir: Path, step: int) -> Path:
    return _ckpt_root(out_dir) / f"step-{step:08d}"


def safe_load(path: Path) -> Any:
    """Load a checkpoint file as plain data (tensors, numbers, containers), never code.

    A missing, truncated or foreign file, one that is not a regular file (a FIFO would
    block the resume forever, a directory is no checkpoint), or one that asks to run
    code (a crafted pickle), is a one-line ConfigError; see :mod:`thinwire.safeload`.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {path} is missing") from None
    except OSError as exc:
        raise ConfigError(f"checkpoint file {path} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        kind = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO"}.get(
            stat.S_IFMT(mode), "a special file"
        )
        raise ConfigError(f"checkpoint file {path} is {kind}, not a regular file")
    return _safe_load(path, "checkpoint file")


_MARKER_LIMIT = 4096
"""The most bytes ``LATEST`` may hold; it names one directory."""

_MARKER = re.compile(r"step-([0-9]{1,16})")
"""What ``LATEST`` holds: ASCII digits only (``int()`` would also take ``+4``, ``4_0``
or other scripts' digits, none of which names a directory thinwire wrote)."""


def latest_step(out_dir: Path) -> int | None:
    """Step of the newest complete checkpoint in ``out_dir``, or None.

    Raises:
        ConfigError: ``LATEST`` is not a regular file, not UTF-8 text, or does not name
            an existing checkpoint (one line naming the marker).
    """
    marker = _ckpt_root(out_dir) / "LATEST"
    if not os.path.lexists(marker):  # a dangling link is an error below, not "no run"
        return None
    name = read_input(marker, "checkpoint marker", _MARKER_LIMIT).strip()
    found = _MARKER.fullmatch(name)
    if found is None:
        raise ConfigError(
            f"checkpoint marker {marker} is corrupt (holds {short_repr(name)}, not a "
            "name like 'step-00000300')"
        )
    step = int(found.group(1))
    if not _step_dir(out_dir, step).is_dir():
        raise ConfigError(f"checkpoint marker {marker} names {name}, which does not exist")
    return step


def save_checkpoint(
    out_dir: Path,
    step: int,
    rank: int,
    model_state: dict[str, Any] | None,
    rank_state: dict[str, Any],
    run_id: str | None = None,
) -> None:
    """Collective: every rank calls it; rank 0 passes ``model_state``.

    Every file is stamped with ``step`` and the run's ``run_id``, which a resume checks
    (:func:`load_model_state`, :func:`load_rank_state`). Returns once ``LATEST`` names
    this step on rank 0.

    Raises:
        ConfigError: a file could not be written (a full disk, a lost mount: one line);
            ``LATEST`` still names the previous checkpoint, which is untouched.
    """
    step_dir = _step_dir(out_dir, step)
    stamp = {"step": step, "run_id": run_id}
    try:
        step_dir.mkdir(parents=True, exist_ok=True)
        atomic_save({**rank_state, **stamp}, step_dir / f"rank{rank}.pt")
        if rank == 0:
            if model_state is None:
                raise ValueError("rank 0 must pass the model state")
            atomic_save({**stamp, "model": model_state}, step_dir / "model.pt")
    except OSError as exc:
        previous = latest_step(out_dir)
        kept = f"step {previous} is still the latest" if previous else "there is no earlier one"
        raise ConfigError(
            f"cannot write checkpoint {step_dir}: {exc.strerror or exc}; {kept}"
        ) from None
    if dist.is_initialized():
        dist.barrier()  # every rank's file is in place before LATEST moves
    if rank == 0:
        atomic_write_text(_ckpt_root(out_dir) / "LATEST", step_dir.name + "\n")
    _prune(out_dir, rank, keep_from=step_dir.name)


def _prune(out_dir: Path, rank: int, keep_from: str) -> None:
    dirs = sorted(p for p in _ckpt_root(out_dir).glob("step-*") if p.is_dir())
    newest = [p for p in dirs if p.name <= keep_from][-KEEP:]
    for old in dirs:
        if old in newest or old.name > keep_from:
            continue
        (old / f"rank{rank}.pt").unlink(missing_ok=True)
        if rank == 0:
            shutil.rmtree(old, ignore_errors=True)


def _check_stamp(path: Path, blob: dict[str, Any], step: int, run_id: str | None) -> None:
    """The file must belong to this step of this run (see :func:`save_checkpoint`)."""
    found = blob.get("step")
    if type(found) is not int:  # "4" or 4.0 or True: equal-looking, never written so
        raise ConfigError(
            f"checkpoint {path} holds step {short_repr(found)} (a {type(found).__name__}), "
            f"not the whole number {step}: the file was altered; restore the directory as "
            "it was written"
        )
    if found != step:
        raise ConfigError(
            f"checkpoint {path} holds step {found}, not {step}: it was copied "
            "from another checkpoint; restore the directory as it was written"
        )
    if run_id is not None and blob.get("run_id") != run_id:
        raise ConfigError(
            f"checkpoint {path} belongs to run {short_repr(blob.get('run_id'))}, not to this "
            f"run ({run_id}, see run.json): it was copied from another run"
        )


def _bad(path: Path, what: str) -> ConfigError:
    """The one line for a checkpoint file whose content is not what thinwire wrote."""
    return ConfigError(
        f"checkpoint {path} is damaged: {what}; restore it, or resume from an earlier checkpoint"
    )


def _model_of_run(out_dir: Path) -> nn.Module | None:
    """The run's model, built without memory (``meta`` tensors: shapes and dtypes only)
    from the shape settings in ``run.json``; None if they are not all there (a run
    written by an older thinwire) or describe no valid model."""
    try:
        saved = _read_run_record(out_dir)
        keys = ("model", "seq_len", "n_layer", "n_head", "n_embd")
        if saved is None or not all(k in saved for k in keys):
            return None
        gcfg = TrainConfig.from_dict({k: saved[k] for k in keys}).gpt_config()
        with torch.device("meta"):
            return GPT(gcfg)
    except (ConfigError, TypeError, ValueError):
        return None  # run.json itself is checked, with its own message, on resume


def _check_model_state(path: Path, state: Any, model: nn.Module | None) -> None:
    """``state`` holds exactly ``model``'s weights: every name, shape and dtype, finite."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _bad(path, f"the model weights are a {type(state).__name__}, not a table of tensors")
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            raise _bad(
                path, f"weight {short_repr(name)} is a {type(tensor).__name__}, not a tensor"
            )
    if model is not None:
        expected = model.state_dict()
        missing = [k for k in expected if k not in state]
        if missing:
            raise _bad(path, f"weight {missing[0]!r} is missing ({len(missing)} missing in all)")
        unknown = [k for k in state if k not in expected]
        if unknown:
            raise _bad(path, f"it holds {short_repr(unknown[0])}, which the model does not have")
        for name, want in expected.items():
            got = state[name]
            if got.shape != want.shape:
                raise _bad(
                    path,
                    f"weight {name!r} has shape {list(got.shape)}, the model's is "
                    f"{list(want.shape)}",
                )
            if got.dtype != want.dtype:
                raise _bad(path, f"weight {name!r} is {got.dtype}, the model's is {want.dtype}")
    for name, tensor in state.items():
        # The divergence guard never lets a non-finite model be saved: such a file was
        # altered, and training from it would fail at its first step.
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _bad(path, f"weight {name!r} holds nan or inf")


def load_model_state(
    out_dir: Path, step: int, run_id: str | None = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """Rank 0's model weights of checkpoint ``step``, checked to be this run's and to fit
    ``model`` (None: the model ``run.json`` describes) name by name, shape by shape.

    Raises:
        ConfigError: a file of another step or run, or weights that are missing, extra,
            of another shape or dtype, or not finite (one line naming the file).
    """
    path = _step_dir(out_dir, step) / "model.pt"
    blob = safe_load(path)
    if not isinstance(blob, dict) or "model" not in blob:
        raise ConfigError(f"checkpoint {path} is not a thinwire model")
    _check_stamp(path, blob, step, run_id)
    _check_model_state(path, blob["model"], model if model is not None else _model_of_run(out_dir))
    return blob["model"]


_RANK_KEYS = ("rank", "step", "optimizer", "strategy", "rng", "bytes", "elapsed_s")
"""What every ``rank{r}.pt`` holds (see the trainer's ``_save``)."""

_GROUP_NUMBERS = ("lr", "weight_decay", "eps", "momentum")
"""Optimizer group settings that are numbers in every optimizer that has them."""


def _check_optimizer_state(path: Path, opt: Any, model: nn.Module | None) -> None:
    """``opt`` is an optimizer ``state_dict`` over ``model``'s parameters: groups that
    list each parameter once, and per-parameter tensors of that parameter's shape."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict):
        raise _bad(path, "the optimizer state is not a table with a 'state' entry")
    groups = opt.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise _bad(path, "the optimizer's parameter groups are missing or not tables")
    order: list[int] = []
    for g in groups:
        params = g.get("params")
        if not isinstance(params, list) or not all(type(i) is int for i in params):
            raise _bad(path, "an optimizer parameter group does not list its parameters")
        order += params
        for key in _GROUP_NUMBERS:
            value = g.get(key, 0.0)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise _bad(path, f"the optimizer's {key} is {short_repr(value)}, not a number")
        betas = g.get("betas", (0.9, 0.999))
        if not isinstance(betas, list | tuple) or len(betas) != 2:
            raise _bad(path, f"the optimizer's betas are {short_repr(betas)}, not two numbers")
    if len(set(order)) != len(order):
        raise _bad(path, "the optimizer lists a parameter twice")
    shapes = [p.shape for p in model.parameters()] if model is not None else None
    if shapes is not None and len(order) != len(shapes):
        raise _bad(
            path, f"the optimizer holds {len(order)} parameters, the model has {len(shapes)}"
        )
    # Every parameter with state has the same entries (AdamW: step, exp_avg, exp_avg_sq);
    # one without an entry the others have fails at the next step, with a KeyError.
    kinds = {frozenset(v) for v in opt["state"].values() if isinstance(v, dict)}
    if len(kinds) > 1:
        common = frozenset.intersection(*kinds)
        odd = next(k for k in frozenset.union(*kinds) if k not in common)
        raise _bad(path, f"the optimizer's {short_repr(odd)} is missing for some parameters")
    # Every algorithm builds its optimizer over model.parameters(), in that order.
    shape_of = dict(zip(order, shapes, strict=True)) if shapes is not None else {}
    for index, per_param in opt["state"].items():
        if index not in order or not isinstance(per_param, dict):
            raise _bad(
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
                raise _bad(
                    path,
                    f"the optimizer's {key!r} of parameter {index} has shape "
                    f"{list(value.shape)}, the parameter's is {list(want)}",
                )
            if not (
                torch.is_tensor(value) or value is None or isinstance(value, int | float | bool)
            ):
                raise _bad(
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
        raise _bad(path, f"its random-number state is unusable ({detail})") from None
    finally:
        torch.set_rng_state(current)


def _check_rank_state(path: Path, blob: dict[str, Any], model: nn.Module | None) -> None:
    missing = [k for k in _RANK_KEYS if k not in blob]
    if missing:
        raise _bad(path, f"{missing[0]!r} is missing")
    _check_optimizer_state(path, blob["optimizer"], model)
    if blob["strategy"] is not None and not isinstance(blob["strategy"], dict):
        raise _bad(path, f"the algorithm's state is a {type(blob['strategy']).__name__}")
    _check_rng(path, blob["rng"])
    counts = blob["bytes"]
    fields = {"calls", "payload_bytes", "wire_bytes"}
    if not isinstance(counts, dict) or not all(
        isinstance(v, dict)
        and set(v) <= fields
        and all(type(n) is int and n >= 0 for n in v.values())
        for v in counts.values()
    ):
        raise _bad(path, "its byte counters are not counts")
    elapsed = blob["elapsed_s"]
    if type(elapsed) not in (int, float) or not 0 <= elapsed < math.inf:
        raise _bad(path, f"its training time is {short_repr(elapsed)}, not seconds")


def load_rank_state(
    out_dir: Path,
    step: int,
    rank: int,
    run_id: str | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """This rank's state of checkpoint ``step``, checked to be this run's and rank's and
    to fit ``model`` (None: the model ``run.json`` describes).

    ``run_id`` None skips the run check (checkpoints written before runs had ids).

    Raises:
        ConfigError: a missing file, a file of another step, run or rank, or state that
            is not what thinwire writes (a missing entry, an optimizer tensor of the
            wrong shape, an unusable random-number state): one line naming the file.
    """
    path = _step_dir(out_dir, step) / f"rank{rank}.pt"
    if not os.path.lexists(path):
        raise ConfigError(
            f"checkpoint {path} is missing: the run was saved with fewer ranks, or on "
            "multi-node runs this node's output directory is not the one it wrote"
        )
    blob = safe_load(path)
    if not isinstance(blob, dict) or type(blob.get("rank")) is not int or blob["rank"] != rank:
        raise ConfigError(f"checkpoint {path} does not hold rank {rank}'s state")
    _check_stamp(path, blob, step, run_id)
    _check_rank_state(path, blob, model if model is not None else _model_of_run(out_dir))
    return blob


def _applying(path: Path, apply: Callable[[], None]) -> None:
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
        raise _bad(path, f"its state does not load ({detail})") from None


def _check_groups_fit(path: Path, saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """The saved parameter groups have the live optimizer's settings: the same names,
    numbers where it has numbers, and the same switches (``amsgrad``, ``capturable``,
    ``foreach``: how the optimizer was built, which a resume cannot change, and which
    fail only at the next step when they differ)."""
    if len(saved) != len(live):
        raise _bad(path, f"the optimizer has {len(saved)} parameter groups, not {len(live)}")
    for got, want in zip(saved, live, strict=True):
        for key in sorted(set(got) ^ set(want)):
            where = "is missing" if key in want else "is not an option of this optimizer"
            raise _bad(path, f"the optimizer's {short_repr(key)} {where}")
        for key, value in want.items():
            if key == "params":
                continue
            found = got[key]
            if isinstance(value, bool) or value is None or isinstance(value, str):
                if found != value or type(found) is not type(value):
                    raise _bad(
                        path,
                        f"the optimizer's {key} is {short_repr(found)}, this run builds it "
                        f"with {value!r}",
                    )
            elif isinstance(value, int | float):
                if not (isinstance(found, int | float) and not isinstance(found, bool)):
                    raise _bad(path, f"the optimizer's {key} is {short_repr(found)}, not a number")
            elif isinstance(value, list | tuple):
                ok = isinstance(found, list | tuple) and len(found) == len(value)
                if not ok or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in found
                ):
                    raise _bad(
                        path,
                        f"the optimizer's {key} is {short_repr(found)}, not {len(value)} numbers",
                    )


def restore_model(model: nn.Module, out_dir: Path, step: int, run_id: str | None) -> None:
    """Rank 0: put checkpoint ``step``'s weights into ``model``, checked against it first
    (:func:`load_model_state`); any failure is one :class:`ConfigError` line."""
    state = load_model_state(out_dir, step, run_id, model=model)
    _applying(_step_dir(out_dir, step) / "model.pt", lambda: model.load_state_dict(state))


def restore_rank_state(
    strategy: Any, model: nn.Module, out_dir: Path, step: int, rank: int, run_id: str | None
) -> float:
    """Put this rank's state of checkpoint ``step`` into ``strategy`` (its optimizer and
    algorithm state), the random-number generator and the byte counters; returns the
    training seconds so far. Checked first against ``model`` (:func:`load_rank_state`);
    any failure is one :class:`ConfigError` line naming the file."""
    state = load_rank_state(out_dir, step, rank, run_id, model=model)
    path = _step_dir(out_dir, step) / f"rank{rank}.pt"
    _check_groups_fit(path, state["optimizer"]["param_groups"], strategy.optimizer.param_groups)

    def apply() -> None:
        strategy.optimizer.load_state_dict(state["optimizer"])
        if strategy.load_state_dict is not None:
            if state["strategy"] is None:
                raise ValueError("the algorithm's own state is missing")
            strategy.load_state_dict(state["strategy"])
        torch.set_rng_state(state["rng"])
        COUNTER.load_snapshot(state["bytes"])

    _applying(path, apply)
    return float(state["elapsed_s"])


_RECORD_LIMIT = 1 << 20
"""The most bytes ``run.json`` may hold; it lists a dozen settings."""


def _read_run_record(out_dir: Path) -> dict[str, Any] | None:
    """The object in ``out_dir/run.json``; None if there is no such file.

    Raises:
        ConfigError: it is not a regular file, too large, not UTF-8, not JSON or not a
            JSON object (one line naming it and what it is).
    """
    path = out_dir / "run.json"
    if not os.path.lexists(path):
        return None
    text = read_input(path, "run record", _RECORD_LIMIT)
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else "nested too deeply"
        raise ConfigError(f"{path} is corrupt ({detail})") from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(saved).__name__}, not an object: it is not a "
            "thinwire run record"
        )
    return saved


def read_run_id(out_dir: Path) -> str | None:
    """The run id recorded in ``run.json`` (None for runs written without one)."""
    try:
        saved = _read_run_record(out_dir)
    except ConfigError:
        return None  # check_run_identity reports a damaged record before this is read
    run_id = saved.get("run_id") if saved is not None else None
    return run_id if isinstance(run_id, str) else None


def write_run_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "run.json", json.dumps(identity, indent=2, sort_keys=True) + "\n")


def check_run_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    """Raise a ConfigError naming every setting that differs from the saved run's."""
    saved = _read_run_record(out_dir)
    if saved is None:
        path = out_dir / "run.json"
        raise ConfigError(f"{path} is missing; {out_dir} does not hold a thinwire run to resume")
    diffs = [
        f"{k}: checkpoint has {short_repr(saved.get(k))}, this run has {identity[k]!r}"
        for k in sorted(identity)
        if saved.get(k) != identity[k]
    ]
    if diffs:
        raise ConfigError(f"cannot resume the run in {out_dir}: " + "; ".join(diffs))
