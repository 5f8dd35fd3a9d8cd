"""``thinwire compare``: several algorithms on the same settings, side by side.

Takes every ``thinwire train`` option (``--lr``, ``--model``, ``--freeze-step``,
``--config FILE``, ...) as the shared base of the runs and ``--algos`` as the run specs
(``ALGO`` or ``ALGO@key=value,...``); prints the comparison table and writes
``comparison.json`` and ``comparison.png`` to ``--out``. Without ``--lr`` (on the command
line or in the file), each algorithm trains at its own tuned peak lr.

Examples::

    thinwire compare --algos lamb onebit-lamb --workers 4 --steps 300
    thinwire compare --algos lamb@lr=0.01 lamb@lr=0.02 onebit-lamb --out runs/sweep

``thinwire testbed compare`` takes the same options and runs on emulated hosts joined by
slow links (see :mod:`thinwire.cli.testbed_tools`).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from thinwire.cli.train import add_train_arguments
from thinwire.cli.train_config import EXPLICIT, config_from_args
from thinwire.train.compare import compare, parse_run_spec, tuned_lrs
from thinwire.train.compare_report import format_comparison, plot_comparison
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import read_config_file

__all__ = ["add_compare_arguments", "base_and_lrs", "register"]


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """The ``thinwire train`` options plus the run specs and the comparison's own."""
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
    lr_given = "lr" in getattr(args, EXPLICIT, ()) or (
        args.config is not None and "lr" in read_config_file(args.config)
    )
    return base, None if lr_given else tuned_lrs(args.algos)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="train several algorithms on the same settings and compare loss, bytes, time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --algos replaces train's --algo
    )
    add_compare_arguments(p)
    p.set_defaults(func=_main)


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
