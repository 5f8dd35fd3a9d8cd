"""The trainer's output directory: whose it is, and where a run in it starts.

Rank 0 calls these; the trainer broadcasts the outcome, so every rank agrees.

* :func:`claim` locks the directory for the whole run (:mod:`thinwire.runlock`) and,
  for a new run, refuses a directory that holds any earlier run (:mod:`thinwire.rundir`).
* :func:`decide_start` picks the step to start from: 0 with a fresh run id written to
  ``run.json`` (and the resolved settings to ``config.json``, which ``thinwire train
  --config`` reads back), or the latest checkpoint of the run being resumed, after checking that
  the settings match. A resumed run that has nothing left to do returns its saved
  summary instead, so resuming a finished run changes nothing.
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
from thinwire.runlock import RunLock
from thinwire.train import checkpoint as ckpt
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import CONFIG_NAME, write_config_file

__all__ = ["claim", "decide_start", "finished_summary"]


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
    if step is None:
        raise ConfigError(
            f"--resume: no checkpoint in {out_dir} to resume from (a run that stopped "
            "before its first checkpoint cannot be resumed: choose another --out)"
        )
    ckpt.check_run_identity(out_dir, identity)
    if step > cfg.steps:
        raise ConfigError(f"--resume: the checkpoint is at step {step}, past --steps {cfg.steps}")
    if cfg.stop_after is not None and cfg.stop_after < step:
        raise ConfigError(
            f"--resume: the checkpoint is at step {step}, past --stop-after {cfg.stop_after}"
        )
    return step, ckpt.read_run_id(out_dir), finished_summary(cfg, out_dir, step)


def finished_summary(cfg: TrainConfig, out_dir: Path, step: int) -> dict[str, Any] | None:
    """The saved summary of a run resumed at ``step`` with nothing left to do, with a
    ``note`` saying so; None if there is work left or no summary of that step."""
    if step < min(cfg.steps, cfg.stop_after or cfg.steps):
        return None
    try:
        saved = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None  # stopped after its last checkpoint: the trainer writes it anew
    if not isinstance(saved, dict) or saved.get("steps") != step:
        return None
    saved["note"] = (
        f"the run in {out_dir} already reached step {step}; nothing was changed "
        "(raise --steps to train further)"
    )
    return saved
