"""Output paths: writable before the work starts, and never another run's.

Every command that writes results calls one of these first, so a path that cannot be
written (a file where a directory should be, no permission, a read-only or full file
system) fails in one line before minutes of work, not with a traceback after them:

* :func:`writable_dir` for an output directory (``thinwire train --out``,
  ``bench allreduce --out``, ``simulate --out``, ``testbed run --logs``);
* :func:`writable_file` for an output file (``analyze ... -o FILE``).

:func:`existing_run` and :func:`refuse_existing_run` keep a new run from overwriting
the files of an earlier one of *any* kind (the trainer's, the asynchronous server's):
such a directory needs ``--resume`` or another ``--out``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from thinwire.errors import ConfigError

__all__ = ["RUN_FILES", "existing_run", "refuse_existing_run", "writable_dir", "writable_file"]

RUN_FILES: tuple[str, ...] = (
    "run.json",
    "metrics.jsonl",
    "summary.json",
    "checkpoints",
    "localsgd_server.pt",
    "localsgd_pretrain.pt",
)
"""Entries whose presence means a directory holds a run (of the trainer, of DiLoCo, or of
the asynchronous server)."""


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def writable_dir(path: Path | str, what: str = "--out") -> Path:
    """Create ``path`` (and its parents) and prove it writable with a scratch file.

    Raises:
        ConfigError: naming ``what``, the path and the reason (e.g. "Not a directory",
            "Permission denied", "Read-only file system", "No space left on device").
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".thinwire-write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {what} {path}: {_why(exc)}") from None
    return path


def writable_file(path: Path | str, what: str = "-o") -> Path:
    """Check that ``path`` can be written as a file (its directory is made if needed).

    Nothing is written at ``path`` itself, so an existing file stays as it is until the
    command replaces it with its result.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{what} {path} is a directory; give a file name, e.g. {path / 'out.json'}"
        )
    parent = path.parent
    for above in (parent, *parent.parents):
        if above.exists() and not above.is_dir():
            raise ConfigError(f"cannot write {what} {path}: {above} is a file, not a directory")
    writable_dir(parent, f"the directory of {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"cannot write to {what} {path}: Permission denied")
    return path


def existing_run(out_dir: Path | str) -> list[str]:
    """The run files (see :data:`RUN_FILES`) present in ``out_dir``."""
    out_dir = Path(out_dir)
    found = []
    for name in RUN_FILES:
        entry = out_dir / name
        with contextlib.suppress(OSError):
            if entry.is_dir() and not any(entry.iterdir()):
                continue  # an empty checkpoints/ is not a run
            if entry.exists():
                found.append(name)
    return found


def refuse_existing_run(out_dir: Path | str) -> None:
    """Raise unless ``out_dir`` holds no run: a new run never overwrites another one."""
    found = existing_run(out_dir)
    if found:
        raise ConfigError(
            f"output directory {out_dir} already holds a run ({', '.join(found)}); pass "
            "--resume to continue it, or choose another --out"
        )
