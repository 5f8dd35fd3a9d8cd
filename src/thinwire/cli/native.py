"""``thinwire native build|status``: the compiled packing kernels of the 1-bit collective.

``make install`` runs ``thinwire native build`` once per machine (about a minute); where
they do not build, packing falls back to pure torch and says so once per run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from thinwire.compress import native

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "native",
        help="build or inspect the compiled packing kernels for this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    b = verbs.add_parser("build", help="compile them (skipped if built); exit 1 if it fails")
    b.add_argument("--force", action="store_true", help="compile even if built")
    b.add_argument("--verbose", action="store_true", help="print the compiler's command")
    b.set_defaults(func=_build)
    s = verbs.add_parser("status", help="say whether they are built and load; exit 1 if not")
    s.set_defaults(func=_status)


def _build(args: argparse.Namespace) -> int:
    if args.force or not native.library_path().is_file():
        print("thinwire: compiling the native packing kernels (about a minute)", flush=True)
    try:
        path = native.build(force=args.force, verbose=args.verbose)
    except native.BuildError as exc:
        first, _, rest = str(exc).partition("\n")
        print(
            f"thinwire: native packing kernels not built ({first}); packing uses pure torch",
            file=sys.stderr,
        )
        if args.verbose and rest:
            print(rest, file=sys.stderr)
        return 1
    print(f"thinwire: native packing kernels built: {path}")
    return 0


def _status(args: argparse.Namespace) -> int:
    reason = native.unavailable_reason()
    if reason is None:
        print(f"thinwire: native packing kernels loaded from {native.library_path()}")
        return 0
    where = native.library_path()
    print(f"thinwire: native packing kernels unavailable: {reason} (looked for {where})")
    return 1
