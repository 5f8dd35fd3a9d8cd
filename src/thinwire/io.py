"""Files written whole or not at all: write to a temporary name, fsync, rename.

Every file thinwire leaves behind (summaries, results, tables, checkpoints, server
state) goes through these two helpers, so a crash, a full disk or a kill mid-write
leaves the previous file intact and no half-written one for a reader or a resume to
trip over. The temporary file sits beside the target (``.NAME.tmp-PID``, on the same
file system, so the rename is atomic) and is removed if the write fails.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_save", "atomic_write_text"]


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half."""
    path = Path(path)
    tmp = _tmp_beside(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = _tmp_beside(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
