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

Shell::

    thinwire compare --testbed --algos lamb onebit-lamb adamw-powersgd --hosts 4 \\
        --rates 100mbit,1gbit,unlimited --model small --batch-size 8 --steps 80 \\
        --freeze-step 16 --out runs/e2e

Each run reaches its hosts as a settings file (``thinwire train --config``), so every
field of the config travels, with nothing lost on the way. A comparison is
:func:`thinwire.train.compare.compare` with :func:`on_cluster` as its runner, once per
rate and round.

Tuning and reading the numbers:

* Stages. Steps ``1..freeze_step`` of the round's first 1-bit run are the *warmup*
  stage, the rest the *compression* stage, for every algorithm, so LAMB and PowerSGD are
  measured over the same step range as 1-bit LAMB. (PowerSGD has a warmup of its own, ``powersgd_start`` = 10 DDP
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

import json
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.rates import format_rate, parse_rate
from thinwire.testbed.results import RunResult
from thinwire.train.compare import Runner, compare, parse_run_spec
from thinwire.train.compare_report import plot_comparison
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import write_config_file
from thinwire.train.stages import (
    accounted_total,
    expected_tx_total,
    final_train_loss,
    stage_times,
)

__all__ = [
    "compare_on_testbed",
    "expected_tx_total",
    "format_table",
    "on_cluster",
    "stage_times",
    "train_command",
    "train_on_testbed",
]


def train_command(cfg: TrainConfig, config_path: Path, extra_args: Sequence[str] = ()) -> list[str]:
    """Write ``cfg`` to ``config_path``; the ``thinwire train`` command line that runs it
    on a host (``extra_args``: more flags, which win over the file)."""
    write_config_file(cfg, config_path)
    return [sys.executable, "-m", "thinwire", "train", "--config", str(config_path), *extra_args]


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
    # The settings file sits with the hosts' logs: the run directory itself must hold
    # no run files when the trainer claims it.
    argv = train_command(cfg, out_dir / "hosts" / "train_config.json", extra_args or [])
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
    result = _measured(cfg, out_dir, res, argv, load_before)
    atomic_write_text(out_dir / "testbed_run.json", json.dumps(result, indent=2) + "\n")
    return result


def _measured(
    cfg: TrainConfig, out_dir: Path, res: RunResult, argv: list[str], load_before: float
) -> dict[str, Any]:
    """What :func:`train_on_testbed` returns: rank 0's summary, the hosts' NIC counters
    (``res``) beside the accounted bytes, and the stages read from ``metrics.jsonl``."""
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
    return result


def _split_step(cfg: TrainConfig, summary: dict[str, Any]) -> int:
    """Where this run's stages split: its own freeze step (1-bit optimizers), the fixed
    ``--freeze-step`` otherwise, else 0 (all compression; :func:`compare_on_testbed` then
    splits it at the 1-bit run's freeze step, so both are measured over the same steps)."""
    if summary.get("freeze_step") is not None:
        return int(summary["freeze_step"])
    return cfg.freeze_step if isinstance(cfg.freeze_step, int) else 0


def on_cluster(cluster: Cluster, extra_args: Sequence[str] = ()) -> Runner:
    """A :data:`~thinwire.train.compare.Runner` that trains each config on ``cluster``
    (one process per host; ``workers`` must equal the cluster's hosts)."""

    def run(cfgs: list[TrainConfig], workers: int, timeout_s: float) -> list[dict[str, Any]]:
        return [
            train_on_testbed(
                cfg,
                workers,
                None,
                Path(cfg.out_dir),
                list(extra_args),
                cluster=cluster,
                timeout_s=timeout_s,
            )
            for cfg in cfgs
        ]

    return run


def _row(label: str, run: dict[str, Any], repeat: int) -> dict[str, Any]:
    """One table row of a testbed comparison run (see :func:`format_table`)."""
    st, tb = run["stages"], run["testbed"]
    return {
        "rate": tb["rate"],
        "algo": label,
        "repeat": repeat,
        "steps": run["config"]["steps"],
        "samples_per_s": run["samples_per_s"],
        "speedup": run["speedup"],
        "warmup_step_s": st["warmup"].get("mean_step_s"),
        "compression_step_s": st["compression"].get("mean_step_s"),
        "compression_samples_per_s": st["compression"].get("samples_per_s"),
        "compression_speedup": run["compression_speedup"],
        "nic_tx_mb_per_host": statistics.fmean(tb["nic_tx_bytes"]) / 1e6,
        "accounted_mb_per_host": run["accounted_tx_bytes_per_host"] / 1e6,
        "nic_over_accounted": run["nic_over_accounted"],
        "final_val_loss": run["final_val_loss"],
        "final_train_loss": run["final_train_loss"],
        "freeze_step": run.get("freeze_step"),
        "wall_s": tb["wall_s"],
        "load_avg_1min": tb["load_avg_1min"],
        "out_dir": run["out_dir"],
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
    overwrite: bool = False,
    command: str | None = None,
    cluster_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Compare ``algos`` (run specs) with ``cfg`` at each rate; one row per run.

    ``cluster_options`` go to every :class:`~thinwire.testbed.cluster.Cluster`, e.g.
    ``{"delay": "50ms"}`` puts that one-way delay between the hosts
    (:mod:`thinwire.testbed.wan`).

    ``lrs`` sets the peak lr per algorithm (e.g. each one's tuned default,
    :func:`thinwire.train.compare.tuned_lrs`, which is what the command line uses unless
    ``--lr`` is given); a spec's own ``lr=`` wins over it.

    Per rate one cluster is brought up and the algorithms run back to back on it,
    ``repeats`` rounds in turn; each round is one :func:`~thinwire.train.compare.compare`
    into ``out_dir/RATE-rROUND`` (its ``comparison.json`` and, with ``plot``, its
    ``comparison.png``). Each row carries ``speedup`` (whole-run samples/s) and
    ``compression_speedup`` (compression-stage samples/s) over ``algos[0]`` of the same
    rate and round. Writes ``out_dir/compare.json`` (the rows) and returns the rows;
    ``plot`` also gets the first round's figure.
    """
    _check_comparison(algos, rates, repeats)
    out_dir = Path(out_dir)
    rows: list[dict[str, Any]] = []
    for rate in rates:
        label = format_rate(parse_rate(rate))
        with Cluster(hosts, rate, **(cluster_options or {})) as c:
            for rep in range(repeats):
                round_dir = out_dir / f"{label}-r{rep}"
                result = compare(
                    list(algos),
                    cfg,
                    hosts,
                    round_dir,
                    overwrite=overwrite,
                    timeout_s=timeout_s,
                    command=command,
                    lrs=lrs,
                    runner=on_cluster(c, extra_args or []),
                    where={
                        "kind": "testbed",
                        "hosts": hosts,
                        "rate": label,
                        "round": rep,
                        **(cluster_options or {}),
                    },
                )
                rows += _round_rows(result, label, rep)
                if plot is not None:
                    plot_comparison(result, round_dir / "comparison.png")
                    if (rate, rep) == (rates[0], 0):
                        plot_comparison(result, plot)
                atomic_write_text(out_dir / "compare.json", json.dumps(rows, indent=2) + "\n")
    return rows


def _check_comparison(algos: Sequence[str], rates: Sequence[str], repeats: int) -> None:
    """Every algorithm and rate is known, before the first cluster comes up."""
    if not algos:
        raise ConfigError("no algorithms to compare")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    for spec in algos:
        parse_run_spec(spec)  # the algorithm, its keys and that it reads them
    for rate in rates:
        parse_rate(rate)  # a typo fails before the first cluster comes up


def _round_rows(result: dict[str, Any], label: str, rep: int) -> list[dict[str, Any]]:
    """The rows of one round at rate ``label``, each also printed in one line."""
    rows = []
    for name, run in result["runs"].items():
        row = _row(name, run, rep)
        print(
            f"{label} round {rep} {name}: {row['samples_per_s']:.2f} samples/s, "
            f"{row['wall_s']:.0f} s wall, load "
            f"{row['load_avg_1min'][0]:.1f}->{row['load_avg_1min'][1]:.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


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
