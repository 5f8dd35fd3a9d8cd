"""``thinwire simulate async``: heterogeneous Local-SGD workers on a virtual clock.

Runs sync DiLoCo, naive async, Delayed Nesterov and DN+DyLU on the same inner-step
budget with per-worker seconds-per-step, writes ``results.json`` and two plots (loss
vs inner steps, loss vs simulated time) to ``--out``, and prints a comparison table:
final validation loss (ratio to sync) and simulated time to reach sync's final loss.

Each worker's inner AdamW first moment restarts every round under dn-dylu (its slow
workers' rounds are a few steps long) and persists under the other methods;
``--inner-momentum keep|round`` sets it for every method.

The simulator takes the same pieces as a real run: thinwire's GPT and text shards as a
:class:`thinwire.localsgd.Task` (built by the example trainer's
:func:`~thinwire.train.async_task.gpt_task`), one :class:`thinwire.localsgd.AsyncConfig`
per method, and a :class:`thinwire.localsgd.SimClock`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd import METHODS, AsyncConfig, SimClock, for_method, simulate
from thinwire.localsgd.simulator import time_to_reach
from thinwire.rundir import writable_dir
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import atomic_write_text

__all__ = ["register", "run_async", "summarize"]


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{name} needs at least one value")
    return values


def _check_numbers(args: argparse.Namespace) -> None:
    """Numbers the simulator would accept but that make no run: NaN, no learning, ..."""
    checks = [
        ("--jitter", args.jitter, args.jitter >= 0, ">= 0"),
        ("--lr", args.lr, args.lr > 0, "> 0"),
        ("--outer-lr", args.outer_lr, args.outer_lr > 0, "> 0"),
        ("--outer-momentum", args.outer_momentum, 0 <= args.outer_momentum < 1, "in [0, 1)"),
        ("--grace", args.grace, args.grace >= 0, ">= 0"),
        ("--warmup-steps", args.warmup_steps, args.warmup_steps >= 0, ">= 0"),
    ]
    for name, value, ok, rule in checks:
        if not (ok and math.isfinite(value)):
            raise ConfigError(f"{name} must be a number {rule}, got {value}")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("simulate", help="simulate Local-SGD on a virtual clock")
    sub = parser.add_subparsers(dest="simulate_command", required=True, metavar="WHAT")
    p = sub.add_parser(
        "async",
        help="sync DiLoCo vs naive async vs Delayed Nesterov vs DN+DyLU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument(
        "--seconds-per-step",
        default="0.58,0.75,1.51,3.33",
        help="virtual seconds per inner step, one per worker (default: the paper's toy speeds)",
    )
    p.add_argument("--jitter", type=float, default=0.0, help="relative per-round time noise")
    p.add_argument("--local-steps", type=int, default=50, help="H (default 50)")
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker (budget)")
    d = AsyncConfig()
    p.add_argument("--outer-lr", type=float, default=d.outer_lr, help="outer lr of every method")
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    p.add_argument("--c", type=float, default=d.c, help="Delayed Nesterov's c in [0, 1/W]")
    p.add_argument("--grace", type=float, default=d.grace_s, help="grace period, virtual seconds")
    p.add_argument(
        "--inner-momentum",
        default=None,
        metavar="{keep,round}",
        help="inner AdamW first moment: keep it across rounds, or restart it every round "
        "(default: round for dn-dylu, keep for the other methods)",
    )
    p.add_argument("--shards", type=int, default=None, help="data shards (default: one per worker)")
    t = TrainConfig()
    p.add_argument("--model", default=t.model, help="model preset (default tiny)")
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--lr", type=float, default=t.lr, help="peak inner AdamW lr")
    p.add_argument(
        "--warmup-steps", type=int, default=d.warmup_steps, help="inner warmup per shard"
    )
    p.add_argument("--data", default=None, help="text file (default: bundled corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-points", type=int, default=20, help="validation passes per run")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier timing)"
    )
    p.add_argument("--out", default="runs/simulate", help="output directory")
    p.set_defaults(func=run_async)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios to sync DiLoCo: final loss, and simulated time to reach sync's final loss."""
    by = {r["method"]: r for r in results}
    out: dict[str, Any] = {}
    ref = by.get("sync")
    for m, r in by.items():
        row: dict[str, Any] = {
            "final_val_loss": r["final_val_loss"],
            "sim_time_s": r["sim_time_s"],
            "updates": r["updates"],
        }
        if ref is not None:
            target = ref["final_val_loss"]
            reach = time_to_reach(r["curve"], target)
            row["loss_vs_sync"] = r["final_val_loss"] / target
            row["time_to_sync_loss_s"] = reach
            row["speedup_to_sync_loss"] = ref["sim_time_s"] / reach if reach else None
        out[m] = row
    return out


def _plot(results: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for key, label, name in (
        ("steps", "inner steps applied (all workers)", "loss_vs_steps.png"),
        ("time_s", "simulated wall-clock (s)", "loss_vs_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            xs = [p[key] for p in r["curve"]]
            ys = [p["val_loss"] for p in r["curve"]]
            ax.plot(xs, ys, marker=".", label=r["method"])
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        losses = [p["val_loss"] for r in results for p in r["curve"]]
        # A diverged method (naive async at a large outer lr) must not squash the others.
        ax.set_ylim(bottom=min(losses) - 0.1, top=min(max(losses), 4.0))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(str(out / name))
    return paths


def run_async(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError(
            f"--methods needs at least one of {', '.join(METHODS)}, got {args.methods!r}"
        )
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    speeds = _floats(args.seconds_per_step, "--seconds-per-step")
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    _check_numbers(args)
    writable_dir(args.out)  # before minutes of simulation, not after
    if not 0.0 <= args.c <= 1.0 / len(speeds):
        raise ConfigError(f"--c must be in [0, 1/W] = [0, {1 / len(speeds):.4g}], got {args.c}")
    torch.set_num_threads(args.threads)
    # The GPT and its data, as the example trainer builds them.
    model = TrainConfig(
        model=args.model,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        data=args.data,
        seed=args.seed,
    )
    model.validate()
    base = AsyncConfig(
        steps=args.steps,
        local_steps=args.local_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        c=args.c,
        grace_s=args.grace,
        inner_momentum=args.inner_momentum,
        shards=args.shards,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=model.min_lr_ratio,
    )
    clock = SimClock(
        seconds_per_step=speeds, jitter=args.jitter, seed=args.seed, eval_points=args.eval_points
    )
    clock.validate()
    configs = [(m, for_method(base, m)) for m in methods]
    for _, c in configs:
        c.validate(len(speeds))  # every bad option before the first (long) run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = TextData(args.data, model.gpt_config().seq_len, model.val_fraction, args.seed)
    task = gpt_task(model, data)
    settings = {k: getattr(model, k) for k in ("model", "batch_size", "lr", "data", "seed")}
    results = []
    for method, c in configs:
        t0 = time.perf_counter()
        r = {"method": method} | simulate(task, c, clock) | {"task": settings}
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        print(
            f"{method:8s} final val loss {r['final_val_loss']:.4f}  updates {r['updates']:5d}  "
            f"simulated {r['sim_time_s']:9.1f} s  inner momentum "
            f"{r['config']['inner_momentum']:5s}  (computed in {r['wall_s']:.0f} s)",
            flush=True,
        )
    summary = summarize(results)
    command = "thinwire " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    blob = {"command": command, "summary": summary, "runs": results}
    atomic_write_text(out / "results.json", json.dumps(blob, indent=2) + "\n")
    print(
        f"\n{'method':8s} {'val loss':>9s} {'vs sync':>8s} {'t to sync loss':>15s} {'speedup':>8s}"
    )
    for m, row in summary.items():
        reach = row.get("time_to_sync_loss_s")
        speed = row.get("speedup_to_sync_loss")
        print(
            f"{m:8s} {row['final_val_loss']:9.4f} {row.get('loss_vs_sync', math.nan):8.4f} "
            f"{(f'{reach:.0f} s' if reach else 'never'):>15s} "
            f"{(f'{speed:.2f}x' if speed else '-'):>8s}"
        )
    plots = _plot(results, out)
    print(f"wrote {out / 'results.json'}" + "".join(f", {p}" for p in plots))
    return 0
