"""``thinwire demo``: the whole story on built-in defaults, in a few minutes on a laptop CPU.

It trains the small GPT on the bundled Shakespeare corpus with 4 local workers and prints
the run summary. As the project grows, the demo grows with it.
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire.cli.train import config_from_args, format_summary, run_training

__all__ = ["register"]


def register(sub: Any) -> None:
    from thinwire.cli.train import add_train_arguments

    p = sub.add_parser(
        "demo", help="run the main job on its built-in defaults", description=__doc__
    )
    add_train_arguments(p)
    p.set_defaults(func=_main, out=None)


def _main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.out_dir = args.out or "runs/demo"
    if not args.resume:
        cfg.resume = False
    print(f"thinwire demo: training {cfg.model} GPT with {cfg.algo} on {args.workers} workers")
    summary = run_training(cfg, args.workers, args.timeout)
    print(format_summary(summary))
    return 0
