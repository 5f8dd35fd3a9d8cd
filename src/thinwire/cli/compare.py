"""``thinwire compare``: every comparison, on the same settings, side by side.

Two choices make the mode, and each mode has options of its own (``--help`` after the
mode's flags lists them):

* what: training algorithms (the default): ``--algos`` run specs (``ALGO`` or
  ``ALGO@key=value,...``) over every ``thinwire train`` option (``--lr``, ``--model``,
  ``--freeze-step``, ``--config FILE``, ...) as the shared base of the runs; an
  asynchronous method is a run spec too (``sync``, ``naive``, ``dn``, ``dn-dylu``: ``--algo
  async-diloco`` with that method's settings, with ``--workers`` 1 server + one per
  ``--slowdown`` factor); or
  ``--async``: asynchronous Local-SGD methods against sync DiLoCo, ``--methods
  sync,naive,dn,dn-dylu`` with ``--slowdown`` factors per worker (what ``thinwire compare
  --async --help`` lists);
* where: local processes (the default), or ``--testbed``: emulated hosts joined by
  rate-limited links, with ``--hosts``, ``--rates``, ``--delay``, ``--jitter``, ``--loss``
  ... (needs root; ``thinwire compare --testbed --help``).

Prints the comparison table. Synchronous algorithms write ``comparison.json`` and
``comparison.png`` to ``--out`` (on the testbed, one of each per round, and
``compare.json``); without ``--lr`` (on the command line or in the file), each algorithm
trains at its own tuned peak lr.

Examples::

    thinwire compare --algos lamb onebit-lamb --workers 4 --steps 300
    thinwire compare --algos lamb@lr=0.01 lamb@lr=0.02 onebit-lamb --out runs/sweep
    thinwire compare --testbed --algos lamb onebit-lamb --hosts 4 --rates 100mbit,1gbit
    thinwire compare --testbed --algos adamw onebit-lamb --rates 100mbit --delay 50ms
    thinwire compare --algos sync dn-dylu@outer_lr=0.3 --workers 3 --slowdown 1,2
    thinwire compare --async --methods sync,naive,dn,dn-dylu --steps 200 \\
        --slowdown 1,1.29,2.6,5.74 --out runs/async
    thinwire compare --async --methods sync,dn-dylu --testbed --rate 100mbit \\
        --delay 10ms,10ms,10ms,10ms,150ms
"""

from __future__ import annotations

import argparse
import shlex
from argparse import ArgumentParser
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thinwire.cli.parser import CommandParser, add_moved
from thinwire.cli.train import add_train_arguments
from thinwire.cli.train_config import config_from_args, lr_given, note_trained_lr
from thinwire.train.compare import compare, parse_run_spec, tuned_lrs
from thinwire.train.compare_report import format_comparison, plot_comparison
from thinwire.train.config import TrainConfig

__all__ = ["add_compare_arguments", "base_and_lrs", "register"]


def add_compare_arguments(p: ArgumentParser) -> None:
    """The ``thinwire train`` options plus the run specs and the comparison's own: the
    options of ``thinwire compare`` (without ``--async``)."""
    add_train_arguments(p)
    p.add_argument(
        "--algos",
        "--algo",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="run specs: ALGO or ALGO@key=value,... (e.g. lamb@lr=0.01); ratios are "
        "against the first unless --reference",
    )
    p.add_argument("--reference", default=None, help="run the ratios refer to (default: first)")
    p.add_argument("--overwrite", action="store_true", help="replace runs already in --out")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/comparison.png)")


def base_and_lrs(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, float] | None]:
    """The shared settings of the runs, and the peak lr per algorithm (None: the one lr
    the user gave, for every run)."""
    args.algo = parse_run_spec(args.algos[0])[0]  # config_from_args wants one algorithm
    base = config_from_args(args)
    if lr_given(args):
        return base, None
    note_trained_lr((parse_run_spec(spec)[0] for spec in args.algos), base)
    return base, tuned_lrs(args.algos, bool(base.pretrain_steps or base.init_from))


def _mode_parser(
    prog: str, description: str | None, add_arguments: Callable[[ArgumentParser], None]
) -> ArgumentParser:
    """The parser of one mode of ``thinwire compare``, e.g. ``thinwire compare --async``."""
    p = CommandParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --algos replaces --algo, --hosts replaces --workers
    )
    add_arguments(p)
    return p


def register(sub: Any) -> None:
    """Add ``thinwire compare`` with its modes, and ``compare-async``, the hidden old
    spelling of ``compare --async``."""
    # imported here, not at the top: testbed_tools imports this module for its options
    from thinwire.cli import async_compare, testbed_tools

    p = sub.add_parser(
        "compare",
        help="compare algorithms (or --async methods), locally or on --testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --algos replaces train's --algo
    )
    # created first so that the help lists the modes before the many training options
    modes = p.add_argument_group("modes (each with options of its own: add --help)")
    add_compare_arguments(p)
    p.set_defaults(func=_main)
    p.add_switch(
        "--async",
        _mode_parser(
            f"{p.prog} --async",
            async_compare.__doc__,
            async_compare.add_async_compare_arguments,
        ),
        help="asynchronous Local-SGD methods (--methods) instead of --algos",
        group=modes,
    )
    p.add_switch(
        "--testbed",
        _mode_parser(
            f"{p.prog} --testbed",
            testbed_tools.TESTBED_COMPARE_DOC,
            testbed_tools.add_testbed_compare_arguments,
        ),
        help="on emulated hosts joined by rate-limited links (needs root)",
        group=modes,
    )
    old = add_moved(
        sub,
        "compare-async",
        "thinwire compare --async",
        description=async_compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    async_compare.add_async_compare_arguments(old)


def _main(args: argparse.Namespace) -> int:
    out_dir = Path(args.out or "runs/compare")
    args.out = str(out_dir)
    base, lrs = base_and_lrs(args)
    result = compare(
        args.algos,
        base,
        args.workers,
        out_dir,
        reference=args.reference,
        overwrite=args.overwrite,
        timeout_s=args.timeout,
        command=shlex.join(["thinwire", *getattr(args, "argv", ["compare"])]),
        lrs=lrs,
    )
    print(format_comparison(result))
    png = plot_comparison(result, args.plot or out_dir / "comparison.png")
    print(f"wrote {out_dir / 'comparison.json'}" + (f" and {png}" if png else ""))
    return 0
