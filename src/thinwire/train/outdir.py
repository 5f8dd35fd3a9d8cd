"""The trainer's output directory: whose it is, and where a run in it starts.

Rank 0 calls these; the trainer broadcasts the outcome, so every rank agrees.

* :func:`claim` locks the directory for the whole run (:mod:`thinwire.runlock`) and,
  for a new run, refuses a directory that holds any earlier run (:mod:`thinwire.rundir`).
* :func:`decide_start` picks the step to start from: 0 with a fresh run id written to
  ``run.json`` (and the resolved settings to ``config.json``, which ``thinwire train
  --config`` reads back), or the latest checkpoint of the run being resumed, after checking that
  the settings match (0 again for a run stopped before its first checkpoint whose
  pretraining left a save: :mod:`thinwire.train.pretrain_checkpoint`). A resumed run
  that has nothing left to do returns its saved summary instead, so resuming a finished
  run changes nothing.
"""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire import rundir, runlock
from thinwire.errors import ConfigError
from thinwire.io import read_input
from thinwire.runlock import RunLock
from thinwire.train import checkpoint as ckpt
from thinwire.train import pretrain_checkpoint
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import CONFIG_NAME, write_config_file

__all__ = ["claim", "decide_start", "finished_summary", "read_summary"]

_SUMMARY_LIMIT = 16 << 20
"""The most bytes a run's ``summary.json`` may hold (a few KiB in practice)."""

_SUMMARY_NUMBERS = ("world_size", "steps", "samples", "parameters", "final_val_loss")
_SUMMARY_NUMBERS += ("final_val_ppl", "samples_per_s", "train_time_s", "comm_bytes")
"""The numbers of a summary that ``thinwire train`` prints when a finished run is resumed."""


def claim(out_dir: str | Path, resume: bool) -> RunLock:
    """Lock ``out_dir`` for this process; unless ``resume``, it must hold no run.

    Raises:
        ConfigError: the directory is locked by a live run, cannot be written, or holds
            another run and ``resume`` is False.
    """
    lock = runlock.acquire(out_dir)
    try:
        if not resume:
            rundir.refuse_existing_run(out_dir)
    except BaseException:
        lock.release()
        raise
    if lock.took_over:
        print(f"thinwire: took over the lock of a run that died: {lock.took_over}", file=sys.stderr)
    return lock


def decide_start(
    cfg: TrainConfig, out_dir: Path, identity: dict[str, Any]
) -> tuple[int, str | None, dict[str, Any] | None]:
    """``(start step, run id, saved summary if there is nothing left to do)``.

    Raises:
        ConfigError: nothing to resume, settings that differ from the saved run's, or a
            checkpoint past ``--steps`` / ``--stop-after``.
    """
    if not cfg.resume:
        run_id = uuid.uuid4().hex[:16]
        ckpt.write_run_identity(out_dir, identity | {"run_id": run_id})
        write_config_file(replace(cfg, resume=False), out_dir / CONFIG_NAME)
        return 0, run_id, None
    step = ckpt.latest_step(out_dir)
    if step is None and pretrain_checkpoint.latest(out_dir) is not None:
        ckpt.check_run_identity(out_dir, identity)  # stopped in its pretraining: on from there
        return 0, ckpt.read_run_id(out_dir), None
    if step is None:
        raise ConfigError(
            f"--resume: no checkpoint in {out_dir} to resume from (a run that stopped "
            "before its first checkpoint, and not in a pretraining, cannot be resumed: "
            "choose another --out)"
        )
    ckpt.check_run_identity(out_dir, identity)
    if step > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {step}, past --steps {cfg.steps}")
    if cfg.stop_after is not None and cfg.stop_after < step:
        raise ConfigError(
            f"--resume: the checkpoint is at step {step}, past --stop-after {cfg.stop_after}"
        )
    return step, ckpt.read_run_id(out_dir), finished_summary(cfg, out_dir, step)


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    """The object in ``out_dir/summary.json``, or None when there is none to trust.

    The summary is only a report of the run: one that is missing, not a regular file,
    too large, not UTF-8, not JSON or not an object is rebuilt by the trainer (and
    written over atomically), so none of these stops a resume.
    """
    try:
        text = read_input(out_dir / "summary.json", "summary", _SUMMARY_LIMIT)
        saved = json.loads(text)
    except (ConfigError, ValueError, RecursionError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("algo"), str):
        return None
    numbers = [saved.get(k) for k in _SUMMARY_NUMBERS]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
        return None  # a summary the end-of-run table could not print is rebuilt
    return saved


def finished_summary(cfg: TrainConfig, out_dir: Path, step: int) -> dict[str, Any] | None:
    """The saved summary of a run resumed at ``step`` with nothing left to do, with a
    ``note`` saying so; None if there is work left or no summary of that step."""
    if step < min(cfg.steps, cfg.stop_after or cfg.steps):
        return None
    saved = read_summary(out_dir)
    if saved is None or type(saved.get("steps")) is not int or saved["steps"] != step:
        return None  # stopped after its last checkpoint: the trainer writes it anew
    # The directory may have moved since the run finished; report where it is now.
    saved["out_dir"] = str(out_dir)
    saved["note"] = (
        f"the run in {out_dir} already reached step {step}; nothing was changed "
        "(raise --steps to train further)"
    )
    return saved
