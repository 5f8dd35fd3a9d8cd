"""``thinwire bench native build|status``: what thinwire compiles for this machine.

Two pieces, each optional, each built once at set-up (``make install`` builds both):

* ``packing``: the C++ kernels that pack and unpack sign bits for the 1-bit collective
  (about a minute; without them packing runs on pure torch and says so once per run);
* ``delayline``: the testbed's delay line, a small C program for ``--delay``,
  ``--jitter`` and ``--loss`` (about a second; without it the testbed runs without them).

``thinwire bench native build`` builds both, ``thinwire bench native build packing`` one
of them; the exit status is 1 when one failed. ``thinwire native ...``, the old spelling,
still works.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thinwire.cli.parser import add_moved
from thinwire.errors import ConfigError

__all__ = ["add_native_parser"]

TARGETS = ("packing", "delayline")


def add_native_parser(sub: Any, moved_to: str | None = None) -> None:
    """Add ``native build|status`` to ``sub``: ``thinwire bench``'s verbs, or, with
    ``moved_to``, the top-level commands as the hidden old spelling."""
    kwargs: dict[str, Any] = dict(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if moved_to is None:
        p = sub.add_parser(
            "native", help="build or inspect what thinwire compiles for this machine", **kwargs
        )
    else:
        p = add_moved(sub, "native", moved_to, **kwargs)
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    b = verbs.add_parser("build", help="compile them (skipped if built); exit 1 if one fails")
    b.add_argument(
        "targets", nargs="*", metavar="TARGET", help="packing, delayline (default: both)"
    )
    b.add_argument("--force", action="store_true", help="compile even if built")
    b.add_argument("--verbose", action="store_true", help="print the compiler's command")
    b.set_defaults(func=_build)
    s = verbs.add_parser("status", help="say whether they are built; exit 1 if one is not")
    s.set_defaults(func=_status)


def _builders() -> dict[str, tuple[str, Callable[..., Path], type[Exception], Path]]:
    from thinwire.compress import native
    from thinwire.testbed import delayline

    return {
        "packing": (
            "native packing kernels",
            native.build,
            native.BuildError,
            native.library_path(),
        ),
        "delayline": (
            "testbed delay line",
            delayline.build,
            delayline.BuildError,
            delayline.binary_path(),
        ),
    }


def _build(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        raise ConfigError(f"no native target {unknown[0]!r}; the targets are {', '.join(TARGETS)}")
    failed = 0
    for target, (what, build, error, path) in _builders().items():
        if args.targets and target not in args.targets:
            continue
        if target == "packing" and (args.force or not path.is_file()):
            print(f"thinwire: compiling the {what} (about a minute)", flush=True)
        try:
            built = build(force=args.force, verbose=args.verbose)
        except error as exc:
            first, _, rest = str(exc).partition("\n")
            print(f"thinwire: {what} not built ({first})", file=sys.stderr)
            if args.verbose and rest:
                print(rest, file=sys.stderr)
            failed = 1
            continue
        print(f"thinwire: {what} built: {built}")
    return failed


def _status(args: argparse.Namespace) -> int:
    from thinwire.compress import native

    missing = 0
    reason = native.unavailable_reason()
    if reason is None:
        print(f"thinwire: native packing kernels loaded from {native.library_path()}")
    else:
        print(
            f"thinwire: native packing kernels unavailable: {reason} "
            f"(looked for {native.library_path()}); packing uses pure torch"
        )
        missing = 1
    delay = _builders()["delayline"][3]
    if os.access(delay, os.X_OK):
        print(f"thinwire: testbed delay line built: {delay}")
    else:
        print(
            f"thinwire: testbed delay line not built (looked for {delay}); "
            "the testbed runs without --delay, --jitter, --loss"
        )
        missing = 1
    return missing
