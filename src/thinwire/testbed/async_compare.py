"""The paper's asynchronous methods end to end: real processes, or hosts on a slow network.

The simulator (``thinwire simulate``) compares methods on a virtual clock; this runs
the same comparison for real, with ``thinwire train --algo async-diloco`` (1 server + W
workers, ``--slowdown`` stretching each worker's steps to emulate uneven machines), and
reports what wall-clock time buys: each method's final validation loss, its training time
for the same inner-step budget, and the time it took to reach synchronous DiLoCo's final
loss (sync DiLoCo runs through the server's sync barrier, ``--sync``, since it needs the
same slowdowns)::

    thinwire compare --async --methods sync,naive,dn,dn-dylu \\
        --steps 200 --local-steps 10 --slowdown 1,1.29,2.6,5.74 --out runs/async-real
    thinwire compare --async ... --hosts 5 --rate 100mbit   # testbed (root)
    thinwire compare --async ... --hosts 5 --rate 100mbit \\
        --delay 10ms,10ms,10ms,10ms,150ms      # host 4 (the slowest worker) far away

Each method runs at its tuned outer lr and momentum unless ``--`` passes other
``thinwire train`` flags to all of them. Without ``--hosts`` the processes run on this
machine (the local spawner); with it, one process per emulated host. The runs go through
the one comparison driver, :func:`thinwire.train.compare.compare` (each method is a run
spec of its own), which writes ``comparison.json`` and records the machine's load average
before and after every run: wall-clock numbers from a busy host say as much about the host
as about the method. This adds ``results.json`` and ``table.md``, the asynchronous view.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.localsgd.algorithm.methods import METHODS
from thinwire.train.compare import compare
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

__all__ = ["compare_methods", "format_table", "save_results"]


def _curve(out: Path) -> list[dict[str, float]]:
    return [
        {"time_s": r["time_s"], "val_loss": r["val_loss"], "steps": r["step"]}
        for r in read_metrics(out / "metrics.jsonl")
        if "val_loss" in r
    ]


def compare_methods(
    base: TrainConfig,
    methods: list[str],
    out_dir: Path,
    hosts: int | None = None,
    rate: str | None = None,
    delay: list[str] | str | None = None,
    command: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run ``base`` as each of ``methods``; the runs and their comparison with ``sync``.

    The runs go through :func:`thinwire.train.compare.compare`, the one comparison
    driver, with each method as its run spec (``sync``, ``dn-dylu``, ...), so
    ``out_dir/comparison.json`` holds them as every comparison does; this adds the
    asynchronous view of them. ``delay`` (testbed only): one-way delay between hosts, one
    value or one per host (host 0 is the server), as
    :class:`~thinwire.testbed.cluster.Cluster` takes it.

    ``base`` is an ``async-diloco`` config (its ``out_dir`` is replaced per method). A
    method that finished in ``out_dir/METHOD`` with the same settings is read back, not
    run again, unless ``overwrite`` (one with other settings is refused in one line).
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    workers = len(base.slowdown) + 1 if base.slowdown else 5
    base = replace(base, algo="async-diloco", resume=True)
    reference = "sync" if "sync" in methods else methods[0]
    cluster = runner = None
    where: dict[str, Any] = {"kind": "local"}
    if hosts is not None:
        from thinwire.testbed.cluster import Cluster
        from thinwire.testbed.experiments import on_cluster

        cluster = Cluster(hosts, rate, delay=delay)
        cluster.up()
        runner = on_cluster(cluster)
        where = {"kind": "testbed", "hosts": hosts, "rate": rate, "delay": delay}
    try:
        result = compare(
            methods,
            base,
            workers,
            Path(out_dir),
            reference=reference,
            overwrite=overwrite,
            command=command,
            runner=runner,
            where=where,
        )
    finally:
        if cluster is not None:
            cluster.close()
    runs = {
        m: r["summary"]
        | {"curve": _curve(Path(r["out_dir"])), "load_avg_1min": r.get("load_avg_1min")}
        for m, r in result["runs"].items()
    }
    for m, r in runs.items():
        print(f"{m}: final val loss {r['final_val_loss']:.4f} in {r['train_time_s']:.1f} s")
    return {"runs": runs, "summary": _summary(result)}


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """Each method's row: loss, time, updates and bytes, and against ``sync`` (when it
    ran) its loss ratio and how soon it reached sync's final loss."""
    against_sync = result["reference"] == "sync"
    out = {}
    for m, r in result["runs"].items():
        s = r["summary"]
        row = {
            "final_val_loss": r["final_val_loss"],
            "train_time_s": r["train_time_s"],
            "updates_applied": s["updates_applied"],
            "push_bytes": s.get("push_bytes"),
            "pull_bytes": s.get("pull_bytes"),
            "load_avg_1min": r.get("load_avg_1min") or [math.nan, math.nan],
        }
        if against_sync:
            row["loss_vs_sync"] = r["loss_ratio"]
            row["time_to_sync_loss_s"] = r["time_to_ref_loss_s"]
            row["speedup_to_sync_loss"] = r["speedup_to_ref_loss"]
        out[m] = row
    return out


_BYTES = ("push_bytes", "pull_bytes")


def format_table(summary: dict[str, Any]) -> str:
    """The comparison as a markdown table."""
    lines = [
        "| method | final val loss | vs sync | training time | time to sync's final loss "
        "| speed-up | updates | pushed MB | pulled MB | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in summary.items():
        reach, up = r.get("time_to_sync_loss_s"), r.get("speedup_to_sync_loss")
        ratio = r.get("loss_vs_sync")
        push, pull = (r[k] / 1e6 if r.get(k) is not None else math.nan for k in _BYTES)
        lines.append(
            f"| {m} | {r['final_val_loss']:.4f} | {f'{ratio:.4f}' if ratio else '-'} | "
            f"{r['train_time_s']:.1f} s | {f'{reach:.1f} s' if reach else 'never'} | "
            f"{f'{up:.2f}x' if up else '-'} | {r['updates_applied']} | {push:.1f} | "
            f"{pull:.1f} | {r['load_avg_1min'][0]:.1f}-{r['load_avg_1min'][1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def save_results(result: dict[str, Any], out_dir: Path, command: str) -> str:
    """Write ``results.json`` (``command`` + ``result``) and ``table.md``; the table."""
    table = format_table(result["summary"])
    blob = {"command": command, **result}
    atomic_write_text(Path(out_dir) / "results.json", json.dumps(blob, indent=1) + "\n")
    atomic_write_text(Path(out_dir) / "table.md", f"`{command}`\n\n{table}")
    return table
