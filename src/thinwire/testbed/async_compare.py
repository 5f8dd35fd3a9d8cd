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
machine (the local spawner); with it, one process per emulated host. Writes
``results.json`` and ``table.md`` to ``--out``, and records the machine's load average
before and after every run: wall-clock numbers from a busy host say as much about the host
as about the method.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.localsgd.algorithm.virtual_clock import time_to_reach
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics
from thinwire.train.run import run_training

__all__ = ["METHOD_SETTINGS", "compare_methods", "format_table", "save_results"]

METHOD_SETTINGS: dict[str, dict[str, Any]] = {
    "sync": {"sync": True},
    "naive": {"outer": "nesterov"},
    "poly": {"outer": "nesterov", "staleness": "poly"},
    "polythres": {"outer": "nesterov", "staleness": "poly", "max_staleness": 10},
    "buffer": {"outer": "buffer"},
    "dn": {},
    "dn-dylu": {"dylu": True},
}
"""Each method as ``TrainConfig`` settings of ``--algo async-diloco``."""


def _curve(out: Path) -> list[dict[str, float]]:
    return [
        {"time_s": r["time_s"], "val_loss": r["val_loss"], "steps": r["step"]}
        for r in read_metrics(out / "metrics.jsonl")
        if "val_loss" in r
    ]


def _run_one(
    cfg: TrainConfig, out: Path, hosts: int | None, rate: str | None, cluster: Any
) -> dict[str, Any]:
    load = os.getloadavg()[0]
    workers = len(cfg.slowdown) + 1 if cfg.slowdown else 5
    if hosts is None:
        summary = run_training(replace(cfg, out_dir=str(out)), workers)
    else:
        from thinwire.testbed.experiments import train_on_testbed

        summary = train_on_testbed(cfg, hosts, rate, out, cluster=cluster)
    return summary | {"curve": _curve(out), "load_avg_1min": [load, os.getloadavg()[0]]}


def compare_methods(
    base: TrainConfig,
    methods: list[str],
    out_dir: Path,
    hosts: int | None = None,
    rate: str | None = None,
    delay: list[str] | str | None = None,
) -> dict[str, Any]:
    """Run ``base`` as each of ``methods``; the runs and their comparison with ``sync``.

    ``delay`` (testbed only): one-way delay between hosts, one value or one per host
    (host 0 is the server), as :class:`~thinwire.testbed.cluster.Cluster` takes it.

    ``base`` is an ``async-diloco`` config (its ``out_dir`` is replaced per method). A
    method whose ``out_dir/METHOD/summary.json`` exists is read back, not run again.
    """
    unknown = [m for m in methods if m not in METHOD_SETTINGS]
    if unknown:
        raise ConfigError(
            f"unknown method {unknown[0]!r}; choose from {', '.join(METHOD_SETTINGS)}"
        )
    cluster = None
    if hosts is not None:
        from thinwire.testbed.cluster import Cluster

        cluster = Cluster(hosts, rate, delay=delay)
        cluster.up()
    runs: dict[str, Any] = {}
    try:
        for m in methods:
            out = Path(out_dir) / m
            done = out / "result.json"
            if done.exists():
                runs[m] = json.loads(done.read_text())
                continue
            cfg = replace(base, algo="async-diloco", **METHOD_SETTINGS[m])
            runs[m] = _run_one(cfg, out, hosts, rate, cluster)
            atomic_write_text(done, json.dumps(runs[m], indent=1) + "\n")
            r = runs[m]
            print(f"{m}: final val loss {r['final_val_loss']:.4f} in {r['train_time_s']:.1f} s")
    finally:
        if cluster is not None:
            cluster.close()
    return {"runs": runs, "summary": _summary(runs)}


def _summary(runs: dict[str, Any]) -> dict[str, Any]:
    ref = runs.get("sync")
    out = {}
    for m, r in runs.items():
        row = {
            "final_val_loss": r["final_val_loss"],
            "train_time_s": r["train_time_s"],
            "updates_applied": r["updates_applied"],
            "push_bytes": r.get("push_bytes"),
            "pull_bytes": r.get("pull_bytes"),
            "load_avg_1min": r["load_avg_1min"],
        }
        if ref is not None:
            # Both times from the evaluation records, on the server's one clock.
            target = ref["final_val_loss"]
            reach, ref_reach = (
                time_to_reach(r["curve"], target),
                time_to_reach(ref["curve"], target),
            )
            row["loss_vs_sync"] = r["final_val_loss"] / target
            row["time_to_sync_loss_s"] = reach
            row["speedup_to_sync_loss"] = ref_reach / reach if reach and ref_reach else None
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
