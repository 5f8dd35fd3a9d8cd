"""``thinwire compare --async``: asynchronous Local-SGD methods for real, side by side.

Runs each of ``--methods`` (sync DiLoCo through the server's sync barrier, naive async,
Poly, PolyThres, the async buffer, Delayed Nesterov, DN + DyLU) as ``thinwire train
--algo async-diloco`` on the same inner-step budget: 1 server + one worker per
``--slowdown`` factor, which stretches that worker's steps to emulate uneven machines.
Reports each method's final validation loss, its training time, and the time it took to
reach sync DiLoCo's final loss (:func:`thinwire.testbed.async_compare.compare_methods`).

Local processes by default; ``--testbed`` runs one process per emulated host (needs
root): ``--hosts`` is 1 server + one per factor (``--hosts`` alone also means the
testbed), ``--rate`` the link rate, ``--delay`` one one-way delay or one per host, server
first. Each method runs at its tuned outer lr and momentum unless ``--`` passes other
``thinwire train`` flags to all of them. Writes ``comparison.json`` (as every
``thinwire compare`` does), ``results.json`` and ``table.md`` to ``--out``; a method that
finished there with the same settings is read back, not run again (``--overwrite``
trains it anew).

Examples::

    thinwire compare --async --methods sync,naive,dn,dn-dylu \\
        --steps 200 --local-steps 10 --slowdown 1,1.29,2.6,5.74 --out runs/async-real
    thinwire compare --async --methods sync,dn-dylu --testbed --rate 100mbit
    thinwire compare --async --methods sync,dn-dylu --testbed --rate 100mbit \\
        --delay 10ms,10ms,10ms,10ms,150ms      # host 4 (the slowest worker) far away
    thinwire compare --async --methods dn --out runs/dn -- --outer-lr 0.3

The simulator, ``thinwire simulate``, compares the same methods on a virtual clock.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace
from pathlib import Path

from thinwire.cli.main import build_parser
from thinwire.cli.train import config_from_args
from thinwire.errors import ConfigError
from thinwire.testbed.async_compare import compare_methods, save_results
from thinwire.train.config import TrainConfig

__all__ = ["add_async_compare_arguments", "run_async_compare"]


def add_async_compare_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``thinwire compare --async`` (and of its old spelling,
    ``thinwire compare-async``); ``func`` is :func:`run_async_compare`."""
    p.add_argument("--methods", default="sync,naive,dn,dn-dylu")
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--slowdown", default="1,1.29,2.6,5.74", help="one factor per worker")
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--eval-interval", type=int, default=10, help="steps per worker")
    p.add_argument(
        "--testbed",
        action="store_true",
        help="one process per emulated host (needs root); default --hosts: 1 + one per factor",
    )
    p.add_argument(
        "--hosts", type=int, default=None, help="testbed hosts, implies --testbed (default: local)"
    )
    # --rates: the spelling of the synchronous comparison on the testbed; one rate here
    p.add_argument("--rate", "--rates", dest="rate", default="100mbit", help="testbed link rate")
    p.add_argument(
        "--delay",
        default=None,
        help="testbed one-way delay: one value, or one per host (server first), e.g. "
        "10ms,10ms,10ms,10ms,150ms",
    )
    p.add_argument("--out", default="runs/async-compare")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="train every method again, replacing its run in --out (by default a method "
        "that finished there with the same settings is read back)",
    )
    p.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- thinwire train flags")
    p.set_defaults(func=run_async_compare)


def _base_config(args: argparse.Namespace, slowdown: tuple[float, ...]) -> TrainConfig:
    """The ``async-diloco`` run every method starts from: the options, then the
    ``thinwire train`` flags after ``--``."""
    extra = list(args.train_flags)
    if extra and extra[0] == "--":
        extra = extra[1:]
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
    if not extra:
        return base
    given = build_parser().parse_args(["train", "--algo", "async-diloco", *extra])
    flags = config_from_args(given)
    keep_lr = "--lr" in extra
    return replace(base, **{k: getattr(flags, k) for k in _changed(flags, keep_lr)})


def _hosts(args: argparse.Namespace, slowdown: tuple[float, ...]) -> int | None:
    """The testbed's host count, or None for local processes."""
    needed = len(slowdown) + 1
    if args.hosts is not None and args.hosts != needed:
        raise ConfigError(f"--hosts must be {needed}: 1 server + one per factor")
    if args.hosts is None and getattr(args, "testbed", False):
        return needed
    return args.hosts


def run_async_compare(args: argparse.Namespace) -> int:
    """Run ``args.methods`` and print the table (also written to ``args.out``)."""
    try:
        slowdown = tuple(float(x) for x in args.slowdown.split(","))
        base = _base_config(args, slowdown)
        hosts = _hosts(args, slowdown)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.delay is not None and hosts is None:
            raise ConfigError("--delay needs the testbed: give --testbed")
        if hosts is not None and "," in args.rate:
            raise ConfigError(f"--rate: the methods run at one link rate, got {args.rate!r}")
        delay = args.delay.split(",") if args.delay and "," in args.delay else args.delay
        command = shlex.join(["thinwire", *getattr(args, "argv", ["compare", "--async"])])
        result = compare_methods(
            base, methods, Path(args.out), hosts, args.rate, delay, command, args.overwrite
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    table = save_results(result, Path(args.out), command)
    print(table)
    return 0


def _changed(cfg: TrainConfig, keep_lr: bool) -> list[str]:
    default = TrainConfig(algo="async-diloco")
    skip = {"out_dir"} if keep_lr else {"out_dir", "lr"}
    return [k for k, v in cfg.to_dict().items() if k not in skip and v != getattr(default, k)]
