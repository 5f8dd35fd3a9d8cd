"""End-to-end training on the testbed: one run, or several algorithms compared per link rate.

``thinwire train`` runs unchanged on every emulated host (it joins the group from the
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` the testbed sets), and this module adds what a
benchmark needs around it: the bytes each host's NIC really carried, the wall time, and
the step times of the two stages of a 1-bit optimizer, read back from ``metrics.jsonl``.

Python::

    from thinwire.testbed.experiments import compare_on_testbed, train_on_testbed
    from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

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
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.plotting import pyplot, save_figure
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.rates import format_rate, parse_rate
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

# TrainConfig field -> ``thinwire train`` flag (None: a boolean switch handled below).
_FLAGS: dict[str, str] = {
    "algo": "--algo",
    "model": "--model",
    "seq_len": "--seq-len",
    "n_layer": "--n-layer",
    "n_head": "--n-head",
    "n_embd": "--n-embd",
    "data": "--data",
    "seed": "--seed",
    "steps": "--steps",
    "stop_after": "--stop-after",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "warmup_steps": "--warmup-steps",
    "weight_decay": "--weight-decay",
    "grad_clip": "--grad-clip",
    "freeze_step": "--freeze-step",
    "freeze_cap": "--freeze-cap",
    "freeze_tolerance": "--freeze-tolerance",
    "grad_dtype": "--grad-dtype",
    "local_steps": "--local-steps",
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "outer": "--outer",
    "compress": "--compress",
    "inner_momentum": "--inner-momentum",
    "grace_s": "--grace",
    "shards": "--shards",
    "staleness": "--staleness",
    "max_staleness": "--max-staleness",
    "calibration_steps": "--calibration-steps",
    "min_local_steps": "--min-local-steps",
    "shard_sampling": "--shard-sampling",
    "shard_layout": "--shard-layout",
    "compress_pull": "--compress-pull",
    "eval_interval": "--eval-interval",
    "eval_sequences": "--eval-sequences",
    "log_interval": "--log-interval",
    "checkpoint_interval": "--checkpoint-interval",
    "device": "--device",
}
# Fields the command line cannot carry: refused when they differ from the default,
# rather than silently training something else than the caller asked for.
# That includes the asynchronous Local-SGD settings without a flag.
_NO_FLAG = (
    "min_lr_ratio",
    "betas",
    "resume",
    "tensorboard",
    "c",
    "dylu_ema",
    "dead_after_s",
    "connect_timeout_s",
    "link_timeout_s",
)


def train_argv(
    cfg: TrainConfig, out_dir: Path, extra_args: Sequence[str] | None = None
) -> list[str]:
    """The ``python -m thinwire train ...`` command line that runs ``cfg`` into ``out_dir``."""
    default = TrainConfig()
    for name in _NO_FLAG:
        if getattr(cfg, name) != getattr(default, name):
            raise ConfigError(
                f"TrainConfig.{name} cannot be passed to 'thinwire train' on the testbed"
            )
    argv = [sys.executable, "-m", "thinwire", "train"]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        # lr always: 'thinwire train' would otherwise pick its per-algorithm default
        explicit = f.name == "lr" or value != getattr(default, f.name)
        if f.name in _FLAGS and value is not None and explicit:
            argv += [_FLAGS[f.name], str(value)]
    if cfg.extra:
        raise ConfigError(
            f"TrainConfig.extra[{sorted(cfg.extra)[0]!r}] cannot be passed to 'thinwire train' "
            "on the testbed"
        )
    if cfg.sync:
        argv.append("--sync")
    if cfg.dylu:
        argv.append("--dylu")
    if cfg.precondition is not None:
        argv.append("--precondition" if cfg.precondition else "--no-precondition")
    if cfg.slowdown is not None:
        argv += ["--slowdown", ",".join(f"{v:g}" for v in cfg.slowdown)]
    if cfg.speeds is not None:
        argv += ["--speeds", ",".join(f"{v:g}" for v in cfg.speeds)]
    return [*argv, "--out", str(out_dir), "--no-progress", *(extra_args or [])]


def _stage(steps: list[int], secs: list[float], comm: list[float], per_step: int) -> dict[str, Any]:
    if not steps:
        return {"steps": 0}
    mean = statistics.fmean(secs)
    return {
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "mean_step_s": mean,
        "median_step_s": statistics.median(secs),
        "samples_per_s": per_step / mean if mean > 0 else float("nan"),
        "wire_bytes_per_step": statistics.fmean(comm),
    }


def stage_times(
    records: Sequence[dict[str, Any]], freeze_step: int, samples_per_step: int
) -> dict[str, Any]:
    """Split per-step times of a ``metrics.jsonl`` into the warmup and compression stages.

    Per-step seconds come from differences of the cumulative ``time_s`` (exact when every
    step is logged; otherwise each step of an interval gets the interval's mean). Step
    ``s`` (1-based) is in the compression stage when ``s > freeze_step``.
    """
    train = sorted((r for r in records if "time_s" in r), key=lambda r: r["step"])
    if not train:
        raise ConfigError("metrics.jsonl holds no training records (did the run log any step?)")
    stages: dict[str, tuple[list[int], list[float], list[float]]] = {
        "warmup": ([], [], []),
        "compression": ([], [], []),
    }
    prev_step, prev_t, prev_c = 0, 0.0, 0.0
    for r in train:
        gap = r["step"] - prev_step
        if gap <= 0:
            continue
        dt = (r["time_s"] - prev_t) / gap
        dc = (r.get("comm_bytes", 0) - prev_c) / gap
        for s in range(prev_step + 1, r["step"] + 1):
            bucket = stages["compression" if s > freeze_step else "warmup"]
            bucket[0].append(s)
            bucket[1].append(dt)
            bucket[2].append(dc)
        prev_step, prev_t, prev_c = r["step"], r["time_s"], r.get("comm_bytes", 0)
    out: dict[str, Any] = {"freeze_step": freeze_step}
    for name, (steps, secs, comm) in stages.items():
        out[name] = _stage(steps, secs, comm, samples_per_step)
    # 1-bit optimizers log whether the *next* step compresses; report where that began,
    # so a reader can check the split against what the optimizer really did.
    flips = [r["step"] + 1 for r in train if r.get("compressing") == 1]
    out["first_compressing_step"] = min(flips) if flips else None
    return out


def _final_train_loss(records: Sequence[dict[str, Any]], frac: float = 0.1) -> float:
    """Mean training loss over the last ``frac`` of the logged steps (one batch is noisy)."""
    losses = [r["loss"] for r in records if "loss" in r]
    k = max(1, round(len(losses) * frac))
    return statistics.fmean(losses[-k:]) if losses else float("nan")


def _accounted_total(summary: dict[str, Any]) -> int:
    return sum(int(op["wire_bytes"]) for op in summary.get("comm_by_op", {}).values())


def expected_tx_total(comm_by_op: dict[str, dict[str, int]], world: int) -> float:
    """Bytes all hosts together should send, from rank 0's per-op accounting.

    Allreduces (plain and 1-bit) are symmetric, so every rank sends what rank 0 recorded.
    A broadcast records its payload on every rank, but on the wire only W-1 receivers
    must get it, whatever tree gloo uses: W-1 payloads in all, not W.
    """
    total = 0.0
    for op, stats in comm_by_op.items():
        wire = int(stats["wire_bytes"])
        total += wire * (world - 1 if op.endswith(".broadcast") else world)
    return total


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
    accounted = _accounted_total(summary)
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
        "final_train_loss": _final_train_loss(records),
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
) -> list[dict[str, Any]]:
    """Train each of ``algos`` with ``cfg`` at each rate; one row per run, ratios included.

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
        with Cluster(hosts, rate) as c:
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


def _curve(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    return [statistics.fmean(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def plot_comparison(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Three panels: step time per stage (per rate and algorithm), and, at the first
    rate, training loss (5-step mean, round 0) against samples and against seconds.

    Raises :class:`ConfigError` when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        raise ConfigError("plots need matplotlib: pip install 'thinwire[plot]'")

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ax = axes[0]
    width = 0.8 / len(algos)
    for k, algo in enumerate(algos):
        for stage, hatch in (("warmup_step_s", "//"), ("compression_step_s", "")):
            ys = [
                statistics.fmean(
                    [r[stage] for r in rows if r["rate"] == rate and r["algo"] == algo]
                )
                for rate in rates
            ]
            xs = [i + k * width + (0 if hatch else width / 2) for i in range(len(rates))]
            ax.bar(
                xs,
                ys,
                width / 2,
                color=f"C{k}",
                hatch=hatch,
                label=f"{algo} ({'warmup' if hatch else 'compression'})",
            )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rates))], rates)
    ax.set_ylabel("seconds per step")
    ax.set_title("step time by stage (hatched: warmup)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # room for the legend above the bars
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    first = [r for r in rows if r["rate"] == rates[0] and r["repeat"] == 0]
    for k, r in enumerate(first):
        curve = _curve(r["out_dir"])
        loss = _smooth([c["loss"] for c in curve])
        axes[1].plot([c["samples"] for c in curve], loss, color=f"C{k}", label=r["algo"])
        axes[2].plot([c["time_s"] for c in curve], loss, color=f"C{k}", label=r["algo"])
    axes[1].set_xlabel("samples")
    axes[2].set_xlabel("training seconds")
    for a in axes[1:]:
        a.set_ylabel("training loss (5-step mean)")
        a.set_title(f"loss at {rates[0]}")
        a.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=100)


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
