"""One run per output directory: a lock on ``--out`` held for the run's whole life.

Two runs writing into one directory interleave silently (one's ``run.json``, the
other's checkpoints), and a later ``--resume`` then continues a run that never existed.
:func:`acquire` prevents that: the first run to claim a directory holds
``OUT/.thinwire.lock`` until it ends; a second one fails at once with a one-line error
naming the holder (pid, host, start time and command).

How it works, and why it needs no cleanup:

* The lock is an exclusive ``flock`` on the lock file, kept by an open file descriptor.
  The kernel drops it when the holder exits in any way (including SIGKILL or a power
  loss on a local disk), so a dead run never blocks the next one.
* The file's content records the holder. A clean release empties it; a file that is
  not empty but not locked was left by a run that died, and the next run takes it over
  (:attr:`RunLock.took_over` names the dead holder).
* Where the file system refuses ``flock`` (some network file systems), the holder
  record alone decides: a holder on this host whose process is gone is stale and taken
  over; a live one, or one on another host (which cannot be checked from here), holds.

On shared storage only one process of a multi-node run takes the lock (the trainer's
rank 0). The asynchronous runtime's server calls :func:`acquire` the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "acquire", "holder", "pid_alive"]

LOCK_NAME = ".thinwire.lock"
"""The lock file, inside the output directory."""


def _os_error(out_dir: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"cannot write to output directory {out_dir}: {exc.strerror or exc}")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (also one of another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _describe(record: dict[str, Any]) -> str:
    since = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return (
        f"pid {record.get('pid', '?')} on {record.get('host', '?')} since {when} "
        f"({record.get('command', '?')})"
    )


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        record = json.loads(raw.decode()) if raw.strip() else {}
    except (UnicodeDecodeError, ValueError):
        return {"pid": "?", "command": "an unreadable lock record"}
    return record if isinstance(record, dict) else {}


class RunLock:
    """A held lock on an output directory; :meth:`release` it (or use ``with``)."""

    def __init__(self, out_dir: Path, fd: int, took_over: str | None) -> None:
        self.out_dir = out_dir
        self.path = out_dir / LOCK_NAME
        self._fd: int | None = fd
        self.took_over = took_over
        """The dead holder whose stale lock this run took over, described; or None."""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the holder record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):  # a vanished directory has nothing to clean
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(out_dir: Path | str) -> dict[str, Any] | None:
    """The record of the run holding ``out_dir`` now, or None if it is free."""
    path = Path(out_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire(out_dir: Path | str, command: str | None = None) -> RunLock:
    """Create ``out_dir`` if needed and claim it for this process until released.

    Raises:
        ConfigError: another live run holds it (naming pid, host, time and command), or
            the directory cannot be created or written (one line each).
    """
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _os_error(out_dir, exc) from None
    try:
        stale = _claim(out_dir, fd)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": command or " ".join(sys.argv) or "python",
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
    except ConfigError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise _os_error(out_dir, exc) from None
    return RunLock(out_dir, fd, stale)


def _claim(out_dir: Path, fd: int) -> str | None:
    """Take the flock (or, without flock, judge the record); return a stale holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(
            f"output directory {out_dir} is in use by another run: {_describe(_read(fd))}; "
            "wait for it to end or choose another --out"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return _judge_record(out_dir, _read(fd))
    record = _read(fd)
    return _describe(record) if record else None


def _judge_record(out_dir: Path, record: dict[str, Any]) -> str | None:
    """No flock here: a record of a live process (or of another host) holds the directory."""
    if not record:
        return None
    pid = record.get("pid")
    here = record.get("host") == socket.gethostname()
    if here and isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid):
        return _describe(record)
    if here and pid == os.getpid():
        return None
    raise ConfigError(
        f"output directory {out_dir} is in use by another run: {_describe(record)}; "
        f"this file system cannot lock files, so if that run is gone, delete "
        f"{out_dir / LOCK_NAME}"
    )
