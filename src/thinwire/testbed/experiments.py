"""End-to-end training on the testbed: one run, or several algorithms compared per link rate.

``thinwire train`` runs unchanged on every emulated host (it joins the group from the
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` the testbed sets), and this module adds what a
benchmark needs around it: the bytes each host's NIC really carried, the wall time, and
the step times of the two stages of a 1-bit optimizer, read back from ``metrics.jsonl``.

Python::

    from thinwire.testbed.experiments import compare_on_testbed, train_on_testbed
    from thinwire.train.config import TrainConfig

    cfg = TrainConfig(algo="onebit-lamb", model="small", steps=80, freeze_step=16,
                      batch_size=8)
    res = train_on_testbed(cfg, hosts=4, rate="100mbit", out_dir=Path("runs/e2e-1bit"))
    res["samples_per_s"], res["stages"]["compression"]["samples_per_s"], res["nic"]

    rows = compare_on_testbed(["lamb", "onebit-lamb", "adamw-powersgd"], cfg, hosts=4,
                              rates=["100mbit", "1gbit", "unlimited"], out_dir=Path("runs/cmp"))

Shell (the evidence in ``docs/benchmarks.md`` was made this way)::

    python -m thinwire.testbed.experiments --algos lamb,onebit-lamb,adamw-powersgd \\
        --hosts 4 --rates 100mbit,1gbit,unlimited --model small --batch-size 8 \\
        --steps 80 --freeze-step 16 --out runs/e2e --plot docs/testbed-e2e.png

Tuning and reading the numbers:

* Stages. Steps ``1..freeze_step`` are the *warmup* stage, the rest the *compression*
  stage, for every algorithm, so LAMB and PowerSGD are measured over the same step range
  as 1-bit LAMB. (PowerSGD has a warmup of its own, ``powersgd_start`` = 10 DDP
  iterations of plain allreduce.) ``--log-interval 1`` is forced so each step's time is
  known; the per-step loss allreduce it adds (4 bytes) runs outside the timed region.
* Speedups are ratios to the first algorithm of the list, within the same rate and the
  same round: the methods of a rate run back to back on one cluster, round after round
  (``repeats``), so a neighbour's load on a shared machine hits them alike.
* ``nic_over_accounted`` compares what all interfaces sent (whole run, start-up
  broadcasts and rendezvous included) with what the collectives recorded
  (:mod:`thinwire.comm.accounting`, every op including the trainer's own; rank 0's
  record, see :func:`expected_tx_total`). Expect 1.00-1.05 (Ethernet/IP/TCP headers);
  much more means unaccounted traffic, less means bytes claimed but never sent.
* Hosts share the machine's cores (``OMP_NUM_THREADS`` = cores / hosts), so with more
  hosts than cores the "unlimited" rate measures this machine's CPU, not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.compare_plot import plot_comparison
from thinwire.testbed.rates import format_rate, parse_rate
from thinwire.testbed.stages import (
    accounted_total,
    expected_tx_total,
    final_train_loss,
    stage_times,
)
from thinwire.testbed.train_flags import train_argv
from thinwire.train.algorithms import check_algorithm, default_lr
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

__all__ = [
    "compare_on_testbed",
    "expected_tx_total",
    "format_table",
    "main",
    "plot_comparison",
    "stage_times",
    "train_argv",
    "train_on_testbed",
]


def train_on_testbed(
    cfg: TrainConfig,
    hosts: int,
    rate: str | None,
    out_dir: Path,
    extra_args: list[str] | None = None,
    *,
    cluster: Cluster | None = None,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Train ``cfg`` on ``hosts`` emulated hosts at link ``rate``; return the measured run.

    Args:
        cfg: the run; ``cfg.out_dir`` is ignored in favour of ``out_dir``, and every step
            is logged (``log_interval=1``) so the stage split is exact.
        hosts: emulated hosts, one training process each.
        rate: link rate (``"100mbit"``, ``"1gbit"``, ``"unlimited"``); ignored when
            ``cluster`` is given.
        out_dir: a new or empty directory: metrics, summary, checkpoints, ``hosts/``
            (each host's log) and ``testbed_run.json`` (the returned dict).
        extra_args: more ``thinwire train`` flags, appended as they are.
        cluster: an up cluster to reuse (e.g. to run several algorithms back to back);
            by default one is brought up for this run and removed afterwards.
        timeout_s: every host is stopped after this long.

    Returns:
        rank 0's ``summary.json`` plus ``testbed`` (hosts, rate, wall seconds, per-host NIC
        tx/rx bytes and link utilization), ``accounted_wire_bytes`` (rank 0, all ops),
        ``accounted_tx_bytes_per_host`` (:func:`expected_tx_total` over the hosts: the
        figure to set beside a host's mean NIC tx),
        ``nic_over_accounted`` (all hosts' NIC tx over :func:`expected_tx_total`),
        ``stages`` (see :func:`stage_times`) and ``final_train_loss``. A failed host
        raises ``RuntimeError`` naming its log.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"out_dir {out_dir} is not empty; each run needs a fresh directory")
    cfg = replace(cfg, log_interval=1, progress=False, out_dir=str(out_dir))
    cfg.validate()
    argv = train_argv(cfg, out_dir, extra_args)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cluster is not None and cluster.hosts != hosts:
        raise ConfigError(f"hosts={hosts} but the given cluster has {cluster.hosts} hosts")
    own = cluster is None
    c = Cluster(hosts, rate) if cluster is None else cluster
    if own:
        c.up()
    # The machine's load before and after: on a shared machine, the first thing to check
    # when one run of a series looks out of line.
    load_before = os.getloadavg()[0]
    try:
        res = c.run(argv, timeout_s=timeout_s, log_dir=out_dir / "hosts")
    finally:
        if own:
            c.close()
    if not res.ok:
        raise RuntimeError(f"training failed on the testbed ({cfg.algo}); logs:\n{res.summary()}")
    summary = json.loads((out_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x]
    world = int(summary["world_size"])
    accounted = accounted_total(summary)
    expected = expected_tx_total(summary.get("comm_by_op", {}), world)
    tx = [h.nic.tx_bytes for h in res.hosts]
    result = {
        **summary,
        "testbed": {
            "hosts": len(res.hosts),
            "rate": format_rate(res.rate_bits),
            "rate_bits": res.rate_bits,
            "wall_s": res.seconds,
            "nic_tx_bytes": tx,
            "nic_rx_bytes": [h.nic.rx_bytes for h in res.hosts],
            "utilization": [res.utilization(i) for i in range(len(res.hosts))],
            "log_dir": res.log_dir,
            "command": argv,
            "load_avg_1min": [load_before, os.getloadavg()[0]],
        },
        "accounted_wire_bytes": accounted,
        # What the accounting says an average host sent: comparable with the mean NIC tx
        # (rank 0's own record counts each start-up broadcast as sent by every rank).
        "accounted_tx_bytes_per_host": expected / world,
        "nic_over_accounted": sum(tx) / expected if expected else None,
        "stages": stage_times(records, _split_step(cfg, summary), cfg.batch_size * world),
        "final_train_loss": final_train_loss(records),
    }
    (out_dir / "testbed_run.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _split_step(cfg: TrainConfig, summary: dict[str, Any]) -> int:
    """Where this run's stages split: its own freeze step (1-bit optimizers), the fixed
    ``--freeze-step`` otherwise, else 0 (all compression; :func:`compare_on_testbed` then
    splits it at the 1-bit run's freeze step, so both are measured over the same steps)."""
    if summary.get("freeze_step") is not None:
        return int(summary["freeze_step"])
    return cfg.freeze_step if isinstance(cfg.freeze_step, int) else 0


def _row(res: dict[str, Any], repeat: int) -> dict[str, Any]:
    st = res["stages"]
    return {
        "rate": res["testbed"]["rate"],
        "algo": res["algo"],
        "repeat": repeat,
        "steps": res["steps"],
        "samples_per_s": res["samples_per_s"],
        "warmup_step_s": st["warmup"].get("mean_step_s"),
        "compression_step_s": st["compression"].get("mean_step_s"),
        "compression_samples_per_s": st["compression"].get("samples_per_s"),
        "nic_tx_mb_per_host": statistics.fmean(res["testbed"]["nic_tx_bytes"]) / 1e6,
        "accounted_mb": res["accounted_wire_bytes"] / 1e6,
        "accounted_mb_per_host": res["accounted_tx_bytes_per_host"] / 1e6,
        "nic_over_accounted": res["nic_over_accounted"],
        "final_val_loss": res["final_val_loss"],
        "final_train_loss": res["final_train_loss"],
        "freeze_step": res.get("freeze_step"),
        "wall_s": res["testbed"]["wall_s"],
        "load_avg_1min": res["testbed"]["load_avg_1min"],
        "out_dir": res["out_dir"],
    }


def compare_on_testbed(
    algos: Sequence[str],
    cfg: TrainConfig,
    hosts: int,
    rates: Sequence[str],
    out_dir: Path,
    *,
    repeats: int = 1,
    extra_args: list[str] | None = None,
    plot: Path | None = None,
    timeout_s: float = 1800.0,
    lrs: Mapping[str, float] | None = None,
    delay: str | None = None,
) -> list[dict[str, Any]]:
    """Train each of ``algos`` with ``cfg`` at each rate; one row per run, ratios included.

    ``delay`` (``"50ms"``) puts that one-way delay between the hosts
    (:mod:`thinwire.testbed.wan`).

    ``lrs`` overrides ``cfg.lr`` per algorithm (e.g. each one's tuned default from
    :func:`thinwire.train.algorithms.default_lr`, which is what the command line uses
    unless ``--lr`` is given): LAMB-style and Adam-style optimizers want peak learning
    rates an order of magnitude apart, so one shared lr handicaps one side.

    Per rate one cluster is brought up and the algorithms run back to back on it,
    ``repeats`` rounds in turn. Each row carries ``speedup`` (whole-run samples/s) and
    ``compression_speedup`` (compression-stage samples/s) over ``algos[0]`` of the same
    rate and round. Writes ``out_dir/compare.json`` (rows and the command lines) and,
    with ``plot``, a figure (see :func:`plot_comparison`).
    """
    if not algos:
        raise ConfigError("no algorithms to compare")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    for algo in algos:
        check_algorithm(algo)
    for rate in rates:
        parse_rate(rate)  # a typo fails before the first cluster comes up
    out_dir = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for rate in rates:
        label = format_rate(parse_rate(rate))
        with Cluster(hosts, rate, delay=delay) as c:
            for rep in range(repeats):
                round_rows = []
                for algo in algos:
                    run_dir = out_dir / f"{label}-r{rep}-{algo}"
                    t0 = time.strftime("%H:%M:%S")
                    res = train_on_testbed(
                        replace(cfg, algo=algo, lr=(lrs or {}).get(algo, cfg.lr)),
                        hosts,
                        rate,
                        run_dir,
                        extra_args,
                        cluster=c,
                        timeout_s=timeout_s,
                    )
                    row = _row(res, rep)
                    print(
                        f"[{t0}] {label} round {rep} {algo}: {row['samples_per_s']:.2f} "
                        f"samples/s, {row['wall_s']:.0f} s wall, load "
                        f"{row['load_avg_1min'][0]:.1f}->{row['load_avg_1min'][1]:.1f}",
                        flush=True,
                    )
                    round_rows.append(row)
                _common_split(round_rows, cfg.batch_size * hosts)
                base = round_rows[0]
                for row in round_rows:
                    row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
                    a, b = row["compression_samples_per_s"], base["compression_samples_per_s"]
                    row["compression_speedup"] = a / b if a and b else None
                rows.extend(round_rows)
                (out_dir / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    if plot is not None:
        plot_comparison(rows, plot)
    return rows


def _common_split(rows: list[dict[str, Any]], samples_per_step: int) -> None:
    """Runs without a freeze of their own (LAMB, PowerSGD) get their stage times over the
    steps of the round's first 1-bit run, like for like."""
    split = next((r["freeze_step"] for r in rows if r.get("freeze_step")), None)
    if split is None:
        return
    for r in rows:
        if r.get("freeze_step") == split:
            continue
        records = read_metrics(Path(r["out_dir"]) / "metrics.jsonl")
        st = stage_times(records, split, samples_per_step)
        r["warmup_step_s"] = st["warmup"].get("mean_step_s")
        r["compression_step_s"] = st["compression"].get("mean_step_s")
        r["compression_samples_per_s"] = st["compression"].get("samples_per_s")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`compare_on_testbed` rows."""

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| rate | round | algorithm | samples/s (run) | x first | step s warmup "
        "| step s compression | samples/s compression | x first | NIC tx MB/host "
        "| NIC / accounted | final val loss | final train loss | load |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['repeat']} | {r['algo']} | {r['samples_per_s']:.2f} "
            f"| {f(r.get('speedup'), '.2f')} | {f(r['warmup_step_s'], '.3f')} "
            f"| {f(r['compression_step_s'], '.3f')} | {f(r['compression_samples_per_s'], '.2f')} "
            f"| {f(r.get('compression_speedup'), '.2f')} | {r['nic_tx_mb_per_host']:.1f} "
            f"| {f(r['nic_over_accounted'], '.3f')} | {r['final_val_loss']:.4f} "
            f"| {r['final_train_loss']:.4f} | {_load(r)} |"
        )
    return "\n".join(lines)


def _load(row: dict[str, Any]) -> str:
    load = row.get("load_avg_1min")
    return "-" if not load else f"{load[0]:.1f}->{load[1]:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m thinwire.testbed.experiments",
        description="Compare training algorithms end to end on testbed clusters.",
        epilog="Flags after '--' go to 'thinwire train' unchanged.",
    )
    p.add_argument(
        "--algos",
        default="lamb,onebit-lamb,adamw-powersgd",
        help="comma list; speedups are over the first",
    )
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rates", default="100mbit,1gbit,unlimited", help="comma list of rates")
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--freeze-step", type=int, default=None)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak lr for every algorithm (default: each one's tuned default)",
    )
    p.add_argument("--repeats", type=int, default=1, help="rounds of all algorithms per rate")
    p.add_argument("--out", default="runs/testbed-e2e")
    p.add_argument("--plot", default=None, help="PNG to draw (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args, extra = p.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)} (train flags go after '--')")
    cfg = TrainConfig(
        model=args.model, batch_size=args.batch_size, steps=args.steps, freeze_step=args.freeze_step
    )
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if args.lr is not None:
        cfg = replace(cfg, lr=args.lr)
    try:
        lrs = None if args.lr is not None else {a: default_lr(a) for a in algos}
        rows = compare_on_testbed(
            algos,
            cfg,
            args.hosts,
            [r.strip() for r in args.rates.split(",") if r.strip()],
            Path(args.out),
            repeats=args.repeats,
            extra_args=extra,
            timeout_s=args.timeout,
            plot=Path(args.plot) if args.plot else None,
            lrs=lrs,
        )
    except ConfigError as exc:
        print(f"thinwire: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
