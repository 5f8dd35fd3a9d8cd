"""``python -m thinwire.train.compare``: the flags of :func:`thinwire.train.compare.compare`.

Takes every ``thinwire train`` option (``--lr``, ``--model``, ``--freeze-step``, ...) as
the shared base of the runs, ``--algos`` as the run specs; prints the comparison table
and writes ``comparison.json`` and ``comparison.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from thinwire.cli.train import add_train_arguments, config_from_args
from thinwire.errors import ConfigError
from thinwire.train import compare as _compare
from thinwire.train.compare import compare, format_comparison, parse_run_spec, plot_comparison

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m thinwire.train.compare",
        description=_compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --algos replaces train's --algo
    )
    add_train_arguments(p)
    p.add_argument(
        "--algos",
        "--algo",
        nargs="+",
        required=True,
        help="run specs: ALGO or ALGO@key=value,... (e.g. lamb@lr=0.01)",
    )
    p.add_argument("--reference", default=None, help="run the ratios refer to (default: first)")
    p.add_argument("--overwrite", action="store_true", help="replace runs already in --out")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/comparison.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out or "runs/compare")
    args.out = str(out_dir)
    command = shlex.join(["python", "-m", "thinwire.train.compare", *(argv or sys.argv[1:])])
    try:
        args.algo = parse_run_spec(args.algos[0])[0]  # config_from_args wants one algorithm
        base = config_from_args(args)
        result = compare(
            args.algos,
            base,
            args.workers,
            out_dir,
            reference=args.reference,
            overwrite=args.overwrite,
            timeout_s=args.timeout,
            command=command,
        )
    except ConfigError as exc:
        print(f"thinwire: error: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    png = plot_comparison(result, args.plot or out_dir / "comparison.png")
    print(f"wrote {out_dir / 'comparison.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
