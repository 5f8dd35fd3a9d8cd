"""Measure the fp32 ring allreduce on testbed clusters and print a markdown table.

    thinwire testbed sweep --hosts 4 --rates 100mbit,1gbit,unlimited \\
        --mib 1,8,32 --out runs/testbed-sweep

For each rate one cluster is brought up and the probe (``thinwire testbed probe``,
:mod:`thinwire.testbed.probe`) runs on it
once, measuring every size. Per row: the bus bandwidth (slowest rank), its ratio to the
link rate, and, per run, the bytes each NIC sent against the bytes the collective
accounted for (:data:`thinwire.comm.accounting.COUNTER`). ``--plot`` draws bus
bandwidth against message size (needs matplotlib). Host logs and ``summary.json`` of
every run stay under ``--out``.

Tuning: the 100 Mbit/s row of a 32 MiB buffer takes ~4 s per call on 4 hosts; keep
``--iters`` small there. Sizes below ~1 MiB measure per-call latency, not bandwidth.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from thinwire.testbed.cluster import Cluster
from thinwire.testbed.rates import format_rate, parse_rate

__all__ = ["format_table", "plot_sweep", "sweep"]


def _probe_lines(log: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("PROBE ") :])
        for line in Path(log).read_text().splitlines()
        if line.startswith("PROBE ")
    ]


def sweep(
    hosts: int, rates: list[str], sizes_mib: list[float], iters: int, out: Path
) -> list[dict[str, Any]]:
    """Run the probe on one cluster per rate; return one row per (rate, size)."""
    rows: list[dict[str, Any]] = []
    mib_arg = ",".join(f"{m:g}" for m in sizes_mib)
    for rate in rates:
        rate_bits = parse_rate(rate)
        log_dir = out / f"{hosts}hosts-{format_rate(rate_bits)}"
        with Cluster(hosts, rate) as c:
            argv = [
                sys.executable,
                "-m",
                "thinwire",
                "testbed",
                "probe",
                "--mib",
                mib_arg,
                "--iters",
                str(iters),
            ]
            res = c.run(argv, log_dir=log_dir, timeout_s=900)
        if not res.ok:
            raise RuntimeError(f"probe failed at {rate}; logs in {log_dir}\n{res.summary()}")
        per_host = [_probe_lines(h.log) for h in res.hosts]
        # The NIC counters cover the whole run, so compare them with the final total.
        nic_ratio = sum(h.nic.tx_bytes for h in res.hosts) / sum(
            p[-1]["wire_bytes"] for p in per_host
        )
        for k, mib in enumerate(sizes_mib):
            busbw = min(p[k]["busbw_bits"] for p in per_host)
            rows.append(
                {
                    "hosts": hosts,
                    "rate": format_rate(rate_bits),
                    "rate_bits": rate_bits,
                    "mib": mib,
                    "seconds_per_call": max(p[k]["seconds_per_iter"] for p in per_host),
                    "busbw_bits": busbw,
                    "busbw_over_rate": busbw / rate_bits if rate_bits else None,
                    "nic_over_accounted": nic_ratio,
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| hosts | link rate | MiB per call | s per call | bus bandwidth | of link rate "
        "| NIC tx / accounted bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        frac = "-" if r["busbw_over_rate"] is None else f"{r['busbw_over_rate']:.1%}"
        lines.append(
            f"| {r['hosts']} | {r['rate']} | {r['mib']:g} | {r['seconds_per_call']:.3f} "
            f"| {r['busbw_bits'] / 1e6:.1f} Mbit/s | {frac} | {r['nic_over_accounted']:.3f} |"
        )
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for rate in dict.fromkeys(r["rate"] for r in rows):
        pts = [r for r in rows if r["rate"] == rate]
        ax.plot([r["mib"] for r in pts], [r["busbw_bits"] / 1e6 for r in pts], "o-", label=rate)
        if pts[0]["rate_bits"]:
            ax.axhline(pts[0]["rate_bits"] / 1e6, color="gray", lw=0.6, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("MiB per allreduce")
    ax.set_ylabel("bus bandwidth (Mbit/s)")
    ax.set_title(f"fp32 ring allreduce, {rows[0]['hosts']} testbed hosts (dashed: link rate)")
    ax.legend(title="link rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
