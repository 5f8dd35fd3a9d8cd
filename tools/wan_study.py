"""What latency changes: the measurements of issue 17, part 3, on the delayed testbed.

Each subcommand brings up testbed clusters with a one-way delay (``--delay``; the
round trip is twice it) and measures one question; each appends its rows to
``OUT/wan_study.jsonl`` and prints a markdown table. They take minutes to hours and
need a quiet machine (root, the delay line built: ``make install``)::

    # the 1-bit allreduce's piece count at 0, 10 and 50 ms (fp32 beside it), 16 MiB
    python tools/wan_study.py pieces --delays 0,10ms,50ms --pieces 1,2,4,8,auto --out runs/wan

    # step times of DDP, PowerSGD and 1-bit LAMB at 50 ms (and 0 for reference)
    python tools/wan_study.py steps --delays 0,50ms --algos adamw,adamw-powersgd,onebit-lamb \\
        --steps 40 --out runs/wan

Asynchronous Local-SGD (DN + DyLU) against synchronous DiLoCo, 5 hosts, the slowest
worker's host far away, uses the comparison that already exists::

    thinwire compare-async --methods sync,dn-dylu --hosts 5 \\
        --rate 100mbit --delay 10ms,10ms,10ms,10ms,150ms --out runs/wan/async

What it needs and costs (estimates on the 2-core machine): ``pieces`` ~2 min per delay
(5 piece counts x (2 warm-up + 5 timed calls) of 16 MiB at 100 Mbit/s, 4 hosts);
``steps`` one ``thinwire train`` per algorithm and delay, ~2-5 min each at 40 steps of
the tiny model; ``async_compare`` ~10 min per method. The analyzer's prediction against
these runs is ``thinwire analyze validate --delay``.

Not covered: the phase-2 scheme of the 1-bit allreduce (ring all_gather vs fan-out) has
no switch to measure the fan-out with; ``pieces`` measures the ring's piece count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from thinwire.testbed import Cluster
from thinwire.testbed.experiments import compare_on_testbed, format_table
from thinwire.testbed.wan import parse_duration
from thinwire.train.algorithms import default_lr
from thinwire.train.config import TrainConfig


def _delays(text: str) -> list[str | None]:
    out: list[str | None] = []
    for tok in text.split(","):
        tok = tok.strip()
        out.append(tok if tok and parse_duration(tok) > 0 else None)
    return out


def _append(out: Path, rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "wan_study.jsonl").open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row, default=str) + "\n")


def pieces(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median time of one 1-bit allreduce (and fp32) per delay and piece count."""
    rows = []
    for delay in _delays(args.delays):
        with Cluster(args.hosts, args.rate, delay=delay) as c:
            for p in args.pieces.split(","):
                with tempfile.TemporaryDirectory(prefix="wan-pieces-") as tmp:
                    argv = [sys.executable, "-m", "thinwire", "bench", "allreduce"]
                    argv += ["--methods", "onebit,fp32", "--pieces", p, "--iters", "5"]
                    argv += ["--min-size", args.size, "--max-size", args.size, "--out", tmp]
                    res = c.run(argv, timeout_s=1800, log_dir=Path(tmp) / "logs")
                    if not res.ok:
                        raise RuntimeError(f"bench failed; see {res.hosts[0].log}")
                    data = json.loads((Path(tmp) / "allreduce.json").read_text())
                for r in data["rows"]:
                    rows.append(
                        {
                            "study": "pieces",
                            "delay": delay or "0",
                            "pieces": p,
                            "method": r["method"],
                            "size_bytes": r["size_bytes"],
                            "time_s": r["time_s"],
                            "rate": args.rate,
                            "hosts": args.hosts,
                            "date": time.strftime("%Y-%m-%d %H:%M"),
                        }
                    )
    print("| delay | pieces | method | MiB | median s |")
    print("|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['delay']} | {r['pieces']} | {r['method']} | "
            f"{r['size_bytes'] / 2**20:g} | {r['time_s']:.3f} |"
        )
    return rows


def steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Step times (and everything ``compare_on_testbed`` reports) per delay and algorithm."""
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    cfg = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size)
    lrs = {a: default_lr(a) for a in algos}
    rows = []
    for delay in _delays(args.delays):
        out = args.out / f"steps-{delay or '0'}"
        got = compare_on_testbed(
            algos,
            cfg,
            args.hosts,
            [args.rate],
            out,
            lrs=lrs,
            cluster_options={"delay": delay} if delay else None,
        )
        for r in got:
            r.update(study="steps", delay=delay or "0")
        print(f"\ndelay {delay or '0'}:\n{format_table(got)}")
        rows += got
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("study", choices=("pieces", "steps"))
    p.add_argument("--delays", default="0,10ms,50ms", help="one-way delays, comma-separated")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--out", type=Path, default=Path("runs/wan"))
    p.add_argument("--pieces", default="1,2,4,8,auto", help="pieces: counts to measure")
    p.add_argument("--size", default="16MiB", help="pieces: message size")
    p.add_argument("--algos", default="adamw,adamw-powersgd,onebit-lamb", help="steps")
    p.add_argument("--model", default="tiny", help="steps: model preset")
    p.add_argument("--steps", type=int, default=40, help="steps: training steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="steps: per host")
    args = p.parse_args(argv)
    rows = pieces(args) if args.study == "pieces" else steps(args)
    _append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
