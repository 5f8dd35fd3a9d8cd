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
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from thinwire.errors import ConfigError
from thinwire.io import atomic_save, atomic_write_text
from thinwire.safeload import safe_load as _safe_load

__all__ = [
    "KEEP",
    "check_run_identity",
    "latest_step",
    "load_model_state",
    "load_rank_state",
    "read_run_id",
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

    A missing, truncated or foreign file, or one that asks to run code (a crafted
    pickle), is a one-line ConfigError; see :mod:`thinwire.safeload`.
    """
    return _safe_load(path, "checkpoint file")


def latest_step(out_dir: Path) -> int | None:
    """Step of the newest complete checkpoint in ``out_dir``, or None."""
    marker = _ckpt_root(out_dir) / "LATEST"
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    try:
        step = int(name.removeprefix("step-"))
    except ValueError:
        raise ConfigError(f"checkpoint marker {marker} is corrupt (holds {name!r})") from None
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


def _check_stamp(path: Path, blob: Any, step: int, run_id: str | None) -> None:
    """The file must belong to this step of this run (see :func:`save_checkpoint`)."""
    if blob.get("step") != step:
        raise ConfigError(
            f"checkpoint {path} holds step {blob.get('step')}, not {step}: it was copied "
            "from another checkpoint; restore the directory as it was written"
        )
    if run_id is not None and blob.get("run_id") != run_id:
        raise ConfigError(
            f"checkpoint {path} belongs to run {blob.get('run_id')}, not to this run "
            f"({run_id}, see run.json): it was copied from another run"
        )


def load_model_state(out_dir: Path, step: int, run_id: str | None = None) -> dict[str, Any]:
    """Rank 0's model weights of checkpoint ``step``, checked to be this run's."""
    path = _step_dir(out_dir, step) / "model.pt"
    blob = safe_load(path)
    if not isinstance(blob, dict) or "model" not in blob:
        raise ConfigError(f"checkpoint {path} is not a thinwire model")
    _check_stamp(path, blob, step, run_id)
    return blob["model"]


def load_rank_state(
    out_dir: Path, step: int, rank: int, run_id: str | None = None
) -> dict[str, Any]:
    """This rank's state of checkpoint ``step``, checked to be this run's and rank's.

    ``run_id`` None skips the run check (checkpoints written before runs had ids).
    """
    path = _step_dir(out_dir, step) / f"rank{rank}.pt"
    if not path.exists():
        raise ConfigError(
            f"checkpoint {path} is missing: the run was saved with fewer ranks, or on "
            "multi-node runs this node's output directory is not the one it wrote"
        )
    blob = safe_load(path)
    if not isinstance(blob, dict) or blob.get("rank") != rank:
        raise ConfigError(f"checkpoint {path} does not hold rank {rank}'s state")
    _check_stamp(path, blob, step, run_id)
    return blob


def read_run_id(out_dir: Path) -> str | None:
    """The run id recorded in ``run.json`` (None for runs written without one)."""
    try:
        saved = json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    run_id = saved.get("run_id") if isinstance(saved, dict) else None
    return run_id if isinstance(run_id, str) else None


def write_run_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "run.json", json.dumps(identity, indent=2, sort_keys=True) + "\n")


def check_run_identity(out_dir: Path, identity: dict[str, Any]) -> None:
    """Raise a ConfigError naming every setting that differs from the saved run's."""
    path = out_dir / "run.json"
    if not path.exists():
        raise ConfigError(f"{path} is missing; {out_dir} does not hold a thinwire run to resume")
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is corrupt ({exc})") from None
    diffs = [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {identity[k]!r}"
        for k in sorted(identity)
        if saved.get(k) != identity[k]
    ]
    if diffs:
        raise ConfigError(f"cannot resume the run in {out_dir}: " + "; ".join(diffs))
