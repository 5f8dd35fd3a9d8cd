"""What latency changes: the measurements of issue 17, part 3, on the delayed testbed.

``pieces`` brings up a testbed cluster per one-way delay (the round trip is twice it),
times the 1-bit allreduce at each piece count, appends its rows to
``OUT/wan_study.jsonl`` and prints a markdown table. They take minutes to hours and
need a quiet machine (root, the delay line built: ``make install``)::

    # the 1-bit allreduce's piece count and phase-2 scheme (ring all_gather or fan-out)
    # at 0, 10 and 50 ms, fp32 beside them, 16 MiB
    python tools/wan_study.py pieces --delays 0,10ms,50ms --pieces 1,2,4,8,auto --out runs/wan

The other questions are answered by thinwire's own commands on a delayed testbed::

    # step times of DDP, PowerSGD and 1-bit LAMB at 50 ms (run it without --delay too)
    thinwire compare --testbed --algos adamw adamw-powersgd onebit-lamb --hosts 4 \\
        --rates 100mbit --model tiny --steps 40 --delay 50ms --out runs/wan/steps-50ms

    # the analyzer's predicted step against the measured one, fp32 DDP, 1-bit, DiLoCo
    thinwire analyze validate --model tiny --batch-size 16 --rates 100mbit --delay 50ms

    # asynchronous Local-SGD (DN + DyLU) against synchronous DiLoCo, 5 hosts, the
    # slowest worker's host far away
    thinwire compare --async --methods sync,dn-dylu --testbed --hosts 5 \\
        --rate 100mbit --delay 10ms,10ms,10ms,10ms,150ms --out runs/wan/async

What it needs and costs (estimates on the 2-core machine): ``pieces`` ~2 min per delay
(5 piece counts x (2 warm-up + 5 timed calls) of 16 MiB at 100 Mbit/s, 4 hosts); the
comparison ~2-5 min per algorithm and delay at 40 steps of the tiny model;
``compare --async`` ~5-10 min per method.
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
from thinwire.testbed.wan import parse_duration


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
                    argv += ["--methods", args.methods, "--pieces", p, "--iters", "5"]
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
                            "chosen": r.get("pieces"),
                            "method": r["method"],
                            "size_bytes": r["size_bytes"],
                            "time_s": r["time_s"],
                            "rate": args.rate,
                            "hosts": args.hosts,
                            "date": time.strftime("%Y-%m-%d %H:%M"),
                        }
                    )
    print("| delay | pieces (chosen) | method | MiB | median s |")
    print("|---:|---:|---|---:|---:|")
    for r in rows:
        chosen = f" ({r['chosen']})" if r["pieces"] == "auto" and r["chosen"] else ""
        print(
            f"| {r['delay']} | {r['pieces']}{chosen} | {r['method']} | "
            f"{r['size_bytes'] / 2**20:g} | {r['time_s']:.3f} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("study", choices=("pieces",))
    p.add_argument("--delays", default="0,10ms,50ms", help="one-way delays, comma-separated")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--out", type=Path, default=Path("runs/wan"))
    p.add_argument("--pieces", default="1,2,4,8,auto", help="pieces: counts to measure")
    p.add_argument("--size", default="16MiB", help="pieces: message size")
    p.add_argument(
        "--methods",
        default="onebit,onebit-fanout,fp32",
        help="bench methods per count (onebit-fanout: phase 2 to every peer at once)",
    )
    args = p.parse_args(argv)
    rows = pieces(args)
    _append(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
