"""``thinwire compare-async``: the flags of
:func:`thinwire.testbed.async_compare.compare_methods`.

Arguments after ``--`` are ``thinwire train`` flags applied to every method.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire.cli.main import build_parser
from thinwire.cli.train import config_from_args
from thinwire.errors import ConfigError
from thinwire.testbed import async_compare as _async_compare
from thinwire.testbed.async_compare import compare_methods, save_results
from thinwire.train.config import TrainConfig

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare-async",
        help="asynchronous Local-SGD methods for real: local processes or testbed hosts",
        description=_async_compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--methods", default="sync,naive,dn,dn-dylu")
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--slowdown", default="1,1.29,2.6,5.74", help="one factor per worker")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--eval-interval", type=int, default=10, help="steps per worker")
    p.add_argument("--hosts", type=int, default=None, help="testbed hosts (default: local)")
    p.add_argument("--rate", default="100mbit", help="testbed link rate")
    p.add_argument(
        "--delay",
        default=None,
        help="testbed one-way delay: one value, or one per host (server first), e.g. "
        "10ms,10ms,10ms,10ms,150ms",
    )
    p.add_argument("--out", default="runs/async-compare")
    p.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- thinwire train flags")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    extra = list(args.train_flags)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        slowdown = tuple(float(x) for x in args.slowdown.split(","))
        base = TrainConfig(
            algo="async-diloco",
            model=args.model,
            batch_size=args.batch_size,
            steps=args.steps,
            local_steps=args.local_steps,
            seed=args.seed,
            data=args.data,
            slowdown=slowdown,
            eval_interval=args.eval_interval,
            checkpoint_interval=0,
            progress=False,
            device="cpu",
        )
        if extra:
            given = build_parser().parse_args(["train", "--algo", "async-diloco", *extra])
            flags = config_from_args(given)
            keep_lr = "--lr" in extra
            base = replace(base, **{k: getattr(flags, k) for k in _changed(flags, keep_lr)})
        if args.hosts is not None and args.hosts != len(slowdown) + 1:
            raise ConfigError(f"--hosts must be {len(slowdown) + 1}: 1 server + one per factor")
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.delay is not None and args.hosts is None:
            raise ConfigError("--delay needs the testbed: give --hosts")
        delay = args.delay.split(",") if args.delay and "," in args.delay else args.delay
        result = compare_methods(base, methods, Path(args.out), args.hosts, args.rate, delay)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    command = shlex.join(["thinwire", *getattr(args, "argv", ["compare-async"])])
    table = save_results(result, Path(args.out), command)
    print(table)
    return 0


def _changed(cfg: TrainConfig, keep_lr: bool) -> list[str]:
    default = TrainConfig(algo="async-diloco")
    skip = {"out_dir"} if keep_lr else {"out_dir", "lr"}
    return [k for k, v in cfg.to_dict().items() if k not in skip and v != getattr(default, k)]
