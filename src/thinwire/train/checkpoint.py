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
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
from thinwire.io import atomic_save, atomic_write_text, read_input
from thinwire.optim.sharded import reshard_optimizer_state
from thinwire.safeload import safe_load as _safe_load
from thinwire.train.checkpoint_check import (
    applying,
    check_groups_fit,
    check_model_state,
    check_rank_state,
)
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
    check_model_state(path, blob["model"], model if model is not None else _model_of_run(out_dir))
    return blob["model"]


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
    check_rank_state(path, blob, model if model is not None else _model_of_run(out_dir))
    return blob


def restore_model(model: nn.Module, out_dir: Path, step: int, run_id: str | None) -> None:
    """Rank 0: put checkpoint ``step``'s weights into ``model``, checked against it first
    (:func:`load_model_state`); any failure is one :class:`ConfigError` line."""
    state = load_model_state(out_dir, step, run_id, model=model)
    applying(_step_dir(out_dir, step) / "model.pt", lambda: model.load_state_dict(state))


def restore_rank_state(
    strategy: Any, model: nn.Module, out_dir: Path, step: int, rank: int, run_id: str | None
) -> float:
    """Put this rank's state of checkpoint ``step`` into ``strategy`` (its optimizer and
    algorithm state), the random-number generator and the byte counters; returns the
    training seconds so far. Checked first against ``model`` (:func:`load_rank_state`);
    any failure is one :class:`ConfigError` line naming the file."""
    state = load_rank_state(out_dir, step, rank, run_id, model=model)
    path = _step_dir(out_dir, step) / f"rank{rank}.pt"
    check_groups_fit(path, state["optimizer"]["param_groups"], strategy.optimizer.param_groups)

    def apply() -> None:
        # a sharded run's plain shards back into DTensors laid out as the parameters
        strategy.optimizer.load_state_dict(
            reshard_optimizer_state(state["optimizer"], strategy.optimizer)
        )
        if strategy.load_state_dict is not None:
            if state["strategy"] is None:
                raise ValueError("the algorithm's own state is missing")
            strategy.load_state_dict(state["strategy"])
        torch.set_rng_state(state["rng"])
        COUNTER.load_snapshot(state["bytes"])

    applying(path, apply)
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


_ADDED_LATER = {"shard_within": 1, "exchange": "onebit"}
"""Identity settings added after runs were first written: a ``run.json`` without one ran
at this value."""


def check_run_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    """Raise a ConfigError naming every setting that differs from the saved run's."""
    saved = _read_run_record(out_dir)
    if saved is None:
        path = out_dir / "run.json"
        raise ConfigError(f"{path} is missing; {out_dir} does not hold a thinwire run to resume")
    saved = {**_ADDED_LATER, **saved}
    diffs = [
        f"{k}: checkpoint has {short_repr(saved.get(k))}, this run has {identity[k]!r}"
        for k in sorted(identity)
        if saved.get(k) != identity[k]
    ]
    if diffs:
        raise ConfigError(f"cannot resume the run in {out_dir}: " + "; ".join(diffs))
