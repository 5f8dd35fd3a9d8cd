"""``thinwire testbed sweep|probe|latency-probe``: measurements on the emulated network,
and the options of ``thinwire compare --testbed`` (:data:`TESTBED_COMPARE_DOC`).

* ``sweep``: the fp32 ring allreduce's bus bandwidth per rate and message size
  (:func:`thinwire.testbed.sweep.sweep`).
* ``probe``: what ``sweep`` runs on every host; run it yourself under ``thinwire testbed
  run -- python -m thinwire testbed probe --mib 8``.
* ``latency-probe rtt|udp|bulk``: what ``check-latency`` runs on the hosts (host 0
  measures, host 1 serves; :mod:`thinwire.testbed.latency`).

Example::

    thinwire testbed sweep --hosts 4 --rates 100mbit,1gbit --mib 1,8,32 --plot sweep.png
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from thinwire.cli.compare import add_compare_arguments, base_and_lrs
from thinwire.cli.parser import add_moved
from thinwire.cli.wan_args import add_wan_arguments, wan_options
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text

__all__ = [
    "TESTBED_COMPARE_DOC",
    "add_testbed_compare_arguments",
    "add_verbs",
    "run_testbed_compare",
]

TESTBED_COMPARE_DOC = """\
``thinwire compare --testbed``: training algorithms end to end on emulated hosts.

The options of ``thinwire compare`` (every ``thinwire train`` option, ``--algos`` run
specs), on ``--hosts`` emulated hosts joined by links of each of ``--rates``, ``--repeats``
rounds per rate, with the wide-area options (``--delay``, ``--jitter``, ``--loss``,
``--host-delay H=V``, ...); needs root. Prints one table row per run and writes
``compare.json`` and each round's ``comparison.json``/``comparison.png`` under ``--out``
(:func:`thinwire.testbed.experiments.compare_on_testbed`).

Examples::

    thinwire compare --testbed --algos lamb onebit-lamb adamw-powersgd --hosts 4 \\
        --rates 100mbit,1gbit --model small --batch-size 8 --steps 80 --out runs/e2e
    thinwire compare --testbed --algos adamw adamw-powersgd onebit-lamb --rates 100mbit \\
        --delay 50ms --out runs/wan        # hosts 50 ms apart (100 ms round trips)

Its old spelling, ``thinwire testbed compare``, still works.
"""


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(t) for t in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB like 1,8,32, got {text!r}") from None
    if not sizes or any(not m > 0 for m in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be > 0 MiB, got {text!r}")
    return sizes


def add_testbed_compare_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``thinwire compare --testbed``: ``thinwire compare``'s, with hosts
    in place of local workers, the link rates, and the wide-area options. ``p`` needs
    ``conflict_handler="resolve"``: ``--hosts`` takes over ``--workers``."""
    add_compare_arguments(p)
    p.add_argument(
        "--hosts", "--workers", dest="workers", type=int, default=4, help="emulated hosts"
    )
    p.add_argument("--rates", type=_comma_list, default=["100mbit"], help="comma list")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all runs per rate")
    add_wan_arguments(p)
    p.set_defaults(func=run_testbed_compare)


def add_verbs(verbs: Any) -> None:
    """Add ``sweep``, ``probe`` and ``latency-probe`` to ``thinwire testbed``'s verbs, and
    ``compare``, the hidden old spelling of ``thinwire compare --testbed``."""
    cmp = add_moved(
        verbs,
        "compare",
        "thinwire compare --testbed",
        description=TESTBED_COMPARE_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # --algos replaces --algo, --hosts replaces --workers
    )
    add_testbed_compare_arguments(cmp)

    sw = verbs.add_parser("sweep", help="fp32 allreduce bus bandwidth per rate and size")
    sw.add_argument("--hosts", type=int, default=4)
    sw.add_argument("--rates", type=_comma_list, default=["100mbit", "1gbit"])
    sw.add_argument("--mib", type=_sizes, default=[1.0, 8.0, 32.0], help="MiB per call")
    sw.add_argument("--iters", type=int, default=3, help="timed calls per size")
    sw.add_argument("--out", default="runs/testbed-sweep", help="logs and rows.json")
    sw.add_argument("--plot", default=None, help="PNG of bus bandwidth against size")
    sw.set_defaults(func=_sweep)

    pr = verbs.add_parser("probe", help="time an fp32 allreduce on this host's group")
    pr.add_argument("--mib", type=_sizes, default=[8.0], help="MiB per call; a comma list")
    pr.add_argument("--iters", type=int, default=3, help="timed calls per size")
    pr.add_argument("--warmup", type=int, default=1, help="untimed calls first, per size")
    pr.set_defaults(func=_probe)

    lp = verbs.add_parser("latency-probe", help="round trips, one-way delays or goodput")
    lp.add_argument("mode", choices=("rtt", "udp", "bulk"))
    lp.add_argument("--count", type=int, default=20, help="pings / round trips / datagrams")
    lp.add_argument("--interval", type=float, default=0.05, help="seconds between round trips")
    lp.add_argument("--rate-pps", type=float, default=2000.0, help="udp: datagrams per second")
    lp.add_argument("--drain", type=float, default=1.0, help="udp: seconds to wait for stragglers")
    lp.add_argument("--seconds", type=float, default=8.0, help="bulk: how long to send")
    lp.add_argument("--skip", type=float, default=3.0, help="bulk: ramp-up seconds not counted")
    lp.add_argument("--server-rank", type=int, default=1, help="the host that serves (not 0)")
    lp.set_defaults(func=_latency_probe)


def run_testbed_compare(args: argparse.Namespace) -> int:
    """Compare ``args.algos`` on emulated hosts at each rate; print the table."""
    from thinwire.testbed.experiments import compare_on_testbed, format_table

    out = Path(args.out or "runs/testbed-compare")
    args.out = str(out)
    base, lrs = base_and_lrs(args)
    rows = compare_on_testbed(
        args.algos,
        base,
        args.workers,
        args.rates,
        out,
        repeats=args.repeats,
        plot=Path(args.plot) if args.plot else out / "comparison.png",
        timeout_s=args.timeout,
        lrs=lrs,
        overwrite=args.overwrite,
        command=shlex.join(["thinwire", *getattr(args, "argv", ["compare", "--testbed"])]),
        cluster_options=wan_options(args, args.workers),
    )
    print(format_table(rows))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from thinwire.testbed.sweep import format_table, plot_sweep, sweep

    if args.iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {args.iters}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep(args.hosts, args.rates, args.mib, args.iters, out)
    atomic_write_text(out / "rows.json", json.dumps(rows, indent=2) + "\n")
    print(format_table(rows))
    if args.plot:
        plot_sweep(rows, Path(args.plot))
    return 0


def _probe(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from thinwire.comm.launch import init_from_env
    from thinwire.testbed.probe import measure

    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    if not init_from_env():
        raise ConfigError("probe: RANK/WORLD_SIZE not set; run it under 'thinwire testbed run'")
    try:
        for mib in args.mib:
            print("PROBE " + json.dumps(measure(mib, args.iters, args.warmup)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _latency_probe(args: argparse.Namespace) -> int:
    from thinwire.testbed.latency import run_probe

    if args.count < 1 or args.server_rank < 1:
        raise ConfigError("--count must be >= 1 and --server-rank >= 1 (host 0 measures)")
    run_probe(
        args.mode,
        count=args.count,
        interval_s=args.interval,
        rate_pps=args.rate_pps,
        drain_s=args.drain,
        seconds=args.seconds,
        skip_s=args.skip,
        server_rank=args.server_rank,
    )
    return 0
