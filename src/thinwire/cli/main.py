"""The ``thinwire`` command: one subcommand per module listed in :data:`SUBCOMMANDS`.

Each subcommand module exposes ``register(subparsers) -> None``, which adds its parser
and sets ``func`` (``func(args) -> int``) as a default. It also adds the old spellings
that now lead to its command, hidden from the help (:func:`thinwire.cli.parser.add_moved`:
``compare-async`` is ``compare --async``, ``native`` is ``bench native``). Bad input raises
:class:`thinwire.ConfigError`; it is printed as one line and the exit status is 2. A run
that diverged (:class:`thinwire.DivergedError`) exits with status 3, an interrupted one
with 130, any other failure with 1.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys
from collections.abc import Sequence

from thinwire import __version__
from thinwire.cli.parser import CommandParser
from thinwire.comm.launch import DistributedError
from thinwire.errors import ConfigError, DivergedError

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: tuple[str, ...] = (
    "thinwire.cli.train",
    "thinwire.cli.compare",
    "thinwire.cli.demo",
    "thinwire.cli.testbed",
    "thinwire.cli.analyze",
    "thinwire.cli.bench",
    "thinwire.cli.simulate",
)
"""The modules of the top-level commands, in the order ``thinwire --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; every parser in it is a :class:`CommandParser`."""
    parser = CommandParser(
        prog="thinwire",
        description="Train across machines joined by slow or uneven networks.",
    )
    parser.add_argument("--version", action="version", version=f"thinwire {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


_EXIT_CODES = {
    "ConfigError": 2,
    "UnsafeContentError": 2,
    "DivergedError": 3,
    "OSError": 2,
    "PermissionError": 2,
    "FileNotFoundError": 2,
    "IsADirectoryError": 2,
    "NotADirectoryError": 2,
}
"""Exit status for an error a rank raised, by its class name (a spawned rank's exception
reaches the launcher as text). File errors are the environment's (a full disk, a lost
mount, permissions), reported as such; a rank's connection errors are not among them."""

_FILE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO, errno.EACCES, errno.EPERM}
)


def _file_error(exc: OSError) -> str | None:
    """One line for an OSError about a file (a full disk, a read-only mount, permissions);
    None for any other OSError, which is a bug to show in full."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return None
    if exc.filename is None and exc.errno not in _FILE_ERRNOS:
        return None
    where = f"{exc.filename}: " if exc.filename is not None else ""
    return f"{where}{exc.strerror or exc}"


def _one_line(msg: str) -> str:
    return msg.strip().splitlines()[0] if msg.strip() else "unknown error"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line, for the records a command writes
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"thinwire: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except DivergedError as exc:
        print(f"thinwire: error: {_one_line(str(exc))}", file=sys.stderr)
        return 3
    except DistributedError as exc:
        # A rank's error travels back as "rank R failed: ConfigError: msg\n<traceback>".
        first = _one_line(str(exc))
        known = re.match(r"rank \d+ failed: (\w+): (.*)", first)
        if known and known.group(1) in _EXIT_CODES:
            # an OSError's text starts with "[Errno 28] "; the reason reads better alone
            said = re.sub(r"^\[Errno \d+\] ", "", known.group(2))
            print(f"thinwire: error: {said}", file=sys.stderr)
            return _EXIT_CODES[known.group(1)]
        print(f"thinwire: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        line = _file_error(exc)
        if line is None:
            raise
        print(f"thinwire: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # only a command that keeps state says what survived (``args.on_interrupt``,
        # set by e.g. ``train`` once it knows its run directory); others claim nothing
        note = getattr(args, "on_interrupt", None)
        try:
            said = note() if note is not None else None
        except Exception:
            said = None
        print("thinwire: interrupted" + (f"; {said}" if said else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
