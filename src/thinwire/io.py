"""Files written whole or not at all, and files read with a limit.

**Writing.**
Every file thinwire leaves behind (summaries, results, tables, checkpoints, server
state) goes through these two helpers, so a crash, a full disk or a kill mid-write
leaves the previous file intact and no half-written one for a reader or a resume to
trip over. The temporary file sits beside the target (``.NAME.tmp-PID``, on the same
file system, so the rename is atomic) and is removed if the write fails.

**Reading.** Every file a user or another process hands thinwire (a config, a token
file, a run's ``LATEST`` or ``run.json``) is read through :func:`read_input`: regular
files only (a FIFO would block forever, ``/dev/zero`` never ends), at most ``limit``
bytes, UTF-8 checked. Anything else is one :class:`~thinwire.errors.ConfigError` line
that names the file and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from thinwire.errors import ConfigError

__all__ = ["INPUT_LIMIT", "atomic_save", "atomic_write_text", "read_input", "read_input_bytes"]

INPUT_LIMIT = 16 << 20
"""The default cap on a file thinwire reads as input: 16 MiB, far above any config,
token or run record, far below what would strain memory."""

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def read_input_bytes(path: str | os.PathLike[str], what: str, limit: int = INPUT_LIMIT) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    ``what`` names the file for the error (``"--config"``, ``"the token file"``). Raises
    :class:`ConfigError` in one line when the path is missing, is not a regular file
    (it is never opened then, so a FIFO cannot block), cannot be read, or holds more
    than ``limit`` bytes. Files whose size the kernel does not know (``/proc``) are read
    up to the limit as well.
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{what}: no such file: {path}") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
        raise ConfigError(f"{what}: {path} is {kind}, not a regular file")
    if info.st_size > limit:
        raise ConfigError(
            f"{what}: {path} holds {info.st_size} bytes, more than the {limit} allowed"
        )
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, open returns at once
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(f"{what}: {path} holds more than the {limit} bytes allowed")
    return data


def read_input(path: str | os.PathLike[str], what: str, limit: int = INPUT_LIMIT) -> str:
    """The text of the regular file ``path``, UTF-8 checked; see :func:`read_input_bytes`."""
    data = read_input_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what}: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _stream(path: Path) -> bool:
    """Whether ``path`` names a device, FIFO or socket (``/dev/stdout``, a pipe).

    Those are written in place, as a shell redirect would: a rename over them would
    swap the device node for a plain file (``-o /dev/full`` as root replaced the device).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def _written(path: Path, mode: str) -> Iterator[IO[Any]]:
    """A file to write ``path`` through: a temporary beside it, fsynced and renamed over
    ``path`` when the block ends without an error (removed when it does not); or, for a
    device or FIFO, ``path`` itself. Any ``OSError`` names ``path``."""
    try:
        if _stream(path):
            with open(path, mode) as f:
                yield f
            return
        tmp = _tmp_beside(path)
        try:
            with open(tmp, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        # name the file the caller meant, not the temporary one (or none at all)
        raise OSError(e.errno, e.strerror, str(path)) from None


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half.

    A device or FIFO (``-o /dev/stdout``) is written in place instead.

    Raises:
        OSError: the write failed, with ``path`` as its ``filename``; ``path`` is as it was.
    """
    with _written(Path(path), "w") as f:
        f.write(text)


class _Recorded:
    """A file for ``torch.save`` that keeps the first write error it sees.

    torch's zip writer swallows the ``OSError`` of a failed write (a full disk) and then
    raises ``RuntimeError: ... unexpected pos``, which names neither the file nor the
    cause; the recorded error is raised in its place."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self._f.write(data))
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``.

    Raises:
        OSError: the write failed (a full disk: ``errno.ENOSPC``), with ``path`` named;
            ``path`` is as it was and no temporary file is left.
    """
    with _written(Path(path), "wb") as f:
        sink = _Recorded(f)
        try:
            torch.save(obj, sink)
        except RuntimeError as e:
            if _interrupted(e):
                # Ctrl-C inside torch's zip writer, which then failed to close the file:
                # the interrupt is what happened (the temporary file goes, path stays).
                raise KeyboardInterrupt from None
            if sink.error is None:
                raise
            raise sink.error from None


def _interrupted(error: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is in ``error``'s chain of context."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__context__
    return False
