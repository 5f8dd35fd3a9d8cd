"""``thinwire demo``: the whole story on built-in defaults, in a few minutes on a CPU.

1. **Analyze** the job: profile the GPT's W workers together, sharing the cores as they
   will when they train, then predict with the what-if model whether the network is its
   bottleneck on W workers at the chosen link rate, and which thinwire algorithm would
   fix it.
2. **Train** it with LAMB (fp32 gradient allreduce) and with 1-bit LAMB, same settings,
   back to back. As root (and with iproute2) the W workers are W emulated hosts joined
   by links rate-limited with ``tc`` (:mod:`thinwire.testbed`), so the time saved is
   measured on a real slow network and the bytes are read off the hosts' NICs;
   otherwise the workers talk over loopback and the demo says so.
3. **Compare** side by side: validation loss, samples/s (whole run and after the
   freeze), training time, bytes per worker; and a plot (``OUT/demo.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thinwire.cli.demo_report import side_by_side
from thinwire.cli.train import freeze_step_arg
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.rundir import writable_dir
from thinwire.testbed.wan import parse_duration
from thinwire.train.algorithms import default_lr
from thinwire.train.compare_report import plot_comparison
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

if TYPE_CHECKING:
    from thinwire.analysis.profile import Profile
    from thinwire.analysis.validate_compare import Link

__all__ = ["register", "run_demo"]

ALGOS = ("lamb", "onebit-lamb")


DEMO_STEPS = TrainConfig.steps
"""Steps per demo run: ``thinwire train``'s default (300)."""

DEMO_LR = default_lr("onebit-lamb")
"""Peak lr of both demo runs: ``thinwire train``'s tuned default, which LAMB and 1-bit LAMB
share (0.02). The demo runs both on ``thinwire train``'s defaults (300 steps, 4 workers x
16 sequences, lr warmup 20 steps), the setting whose convergence docs/results/optimizers.md checks
on two corpora and three seeds ("The automatic freeze"). Shorter runs are not that
setting: at 120 steps (lr 0.015, warmup 12, the freeze capped at step 36) 1-bit LAMB
ended 3% above LAMB (2.652 against 2.573, loopback, seed 0)."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole story on built-in defaults: analyze, train LAMB vs 1-bit LAMB, compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=4, help="workers / emulated hosts (default 4)")
    p.add_argument("--rate", default="100mbit", help="emulated link rate (default 100mbit)")
    p.add_argument(
        "--delay",
        default=None,
        help="one-way delay between the emulated hosts, e.g. 50ms (needs the testbed); the "
        "analysis prices each message with the round trip, twice it",
    )
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--steps", type=int, default=DEMO_STEPS, help=f"steps per run (default {DEMO_STEPS})"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument(
        "--freeze-step",
        type=freeze_step_arg,
        default="auto",
        metavar="{auto,N}",
        help="1-bit LAMB's warmup: auto (until the second moment settles, the default) or N",
    )
    p.add_argument(
        "--lr", type=float, default=DEMO_LR, help=f"learning rate of both runs (default {DEMO_LR})"
    )
    p.add_argument("--out", default="runs/demo", help="output directory (replaced)")
    p.add_argument("--no-testbed", action="store_true", help="train over loopback, even as root")
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-layer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-embd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-head", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_main)


def _base_config(args: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig(
        model=args.model,
        seq_len=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        steps=args.steps,
        batch_size=args.batch_size,
        freeze_step=args.freeze_step,
        lr=args.lr,
        warmup_steps=max(1, min(TrainConfig.warmup_steps, args.steps // 10)),
        eval_interval=max(1, args.steps // 6),
        eval_sequences=64,
        log_interval=max(1, args.steps // 30),
        checkpoint_interval=0,
        progress=False,
    )
    cfg.validate()
    return cfg


def _prepare_out(out: Path) -> None:
    """Replace a previous demo's output, but never a directory the demo did not make."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()):
        if not (out / "demo.json").exists() and not (out / ".thinwire-demo").exists():
            raise ConfigError(
                f"{out} exists and is not a thinwire demo output; choose another --out"
            )
        shutil.rmtree(out)
    writable_dir(out)
    (out / ".thinwire-demo").touch()


# ------------------------------------------------------------------------ 1. analyze


def analyze(
    cfg: TrainConfig, workers: int, rate: str, out: Path, testbed: bool, rtt_s: float = 0.0
) -> Profile:
    """Profile the workers as they will train, then predict the job on ``workers`` hosts.

    The demo's workers share this machine's cores (``cores // workers`` threads each,
    as the testbed gives its hosts and :func:`thinwire.comm.launch.spawn` its ranks), so
    one process profiled alone computes faster than each of them will: ``workers``
    processes are profiled at once instead (:mod:`thinwire.analysis.colocated`), each in
    a session of its own when they will train as testbed hosts (which get one each), in
    the demo's session when they will train over loopback. The 1-bit compute is timed
    under the same sharing. Writes ``OUT/study.json``; returns the profile.
    """
    from thinwire.analysis import NetworkConfig, make_buckets, run_study, write_plots
    from thinwire.analysis.colocated import host_threads, profile_processes
    from thinwire.analysis.network_model import BACKEND_CONCURRENCY
    from thinwire.analysis.report import render_report
    from thinwire.testbed.rates import parse_rate

    threads = host_threads(workers)
    # 2 + 4 steps: the demo's budget is minutes; medians of 4 steps resist one slow one.
    profile = profile_processes(
        cfg.model,
        cfg.batch_size,
        workers,
        threads,
        workers,
        out / "profile",
        warmup=2,
        steps=4,
        timeout_s=600.0,
        own_session=testbed,
    )
    print(
        f"(compute profiled in {workers} processes at once, {threads} thread(s) each, "
        f"as the {workers} workers will train)\n"
    )
    bits = parse_rate(rate)
    gbps = bits / 1e9 if bits else 100.0  # "unlimited": veth runs at tens of Gbit/s
    study = run_study(
        profile,
        make_buckets(profile, "ddp"),
        NetworkConfig(
            workers=workers,
            bandwidth_gbps=gbps,
            alpha_s=rtt_s,
            concurrency=BACKEND_CONCURRENCY["gloo"],  # the demo trains with gloo
        ),
        onebit_codec_s_per_byte=float(profile.meta["onebit_codec_s_per_byte"]),
    )
    atomic_write_text(out / "study.json", json.dumps(study, indent=2) + "\n")
    with contextlib.suppress(ImportError):  # plots need matplotlib; the report does not
        write_plots(study, out / "analysis")
    print(render_report(study))
    return profile


def _link(rate: str, rtt_s: float = 0.0) -> Link:
    """The link of the predicted steps: the set rate as a TCP stream can use it (the
    analysis report uses the set rate itself, so its wire times are ~4% shorter), and
    one round trip per message (gloo waits for its receiver's go-ahead)."""
    from thinwire.analysis.validate_compare import Link
    from thinwire.testbed.rates import parse_rate

    bits = parse_rate(rate)
    # "unlimited" (or loopback): veth and loopback run at tens of Gbit/s.
    link = Link.nominal(bits) if bits else Link(100.0, 0.0, "nominal")
    return replace(link, alpha_per_message_s=rtt_s)


def predicted_steps(
    profile: Profile, workers: int, rate: str, rtt_s: float = 0.0
) -> dict[str, float]:
    """Predicted seconds per step after the freeze, per algorithm, the way each trains.

    LAMB's fp32 gradients are averaged by DDP bucket by bucket during the backward pass
    (scheme ``ddp``), 1-bit LAMB sends its momentum through one 1-bit allreduce after it
    (``onebit``, plus the 1-bit compute measured in the profile).
    """
    from thinwire.analysis.validate_compare import predict_step

    link, codec = _link(rate, rtt_s), float(profile.meta.get("onebit_codec_s_per_byte", 0.0))
    schemes = {"lamb": "ddp", "onebit-lamb": "onebit"}
    return {
        algo: predict_step(profile, schemes[algo], link, workers, codec).step_s for algo in ALGOS
    }


# ------------------------------------------------------------------------ 2. train


def _measured_step(run_dir: Path, first: int, last: int) -> float | None:
    """Mean logged seconds per step of steps ``first..last`` (None: fewer than 2 logged)."""
    from thinwire.analysis.validate_compare import measured_step_s

    try:
        return measured_step_s(read_metrics(run_dir / "metrics.jsonl"), first, last)["mean_s"]
    except ConfigError:
        return None


def train_both(
    cfg: TrainConfig,
    workers: int,
    rate: str,
    out: Path,
    testbed: bool,
    delay: str | None = None,
) -> dict[str, Any]:
    """Train LAMB and 1-bit LAMB with the comparison driver, on the testbed (one cluster at
    ``rate``, hosts ``delay`` apart) or on local workers; the comparison result."""
    from thinwire.train.compare import compare

    if not testbed:
        return compare(list(ALGOS), cfg, workers, out / "train", overwrite=True)
    from thinwire.testbed.cluster import Cluster
    from thinwire.testbed.experiments import on_cluster
    from thinwire.testbed.rates import format_rate, parse_rate

    with Cluster(workers, rate, delay=delay) as cluster:
        return compare(
            list(ALGOS),
            cfg,
            workers,
            out / "train",
            overwrite=True,
            runner=on_cluster(cluster),
            where={
                "kind": "testbed",
                "hosts": workers,
                "rate": format_rate(parse_rate(rate)),
                "delay": delay,
            },
        )


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run for the side-by-side table."""
    rows = []
    for algo, r in result["runs"].items():
        tx = r.get("testbed", {}).get("nic_tx_bytes") or []
        rows.append(
            {
                "algo": algo,
                "final_val_loss": r["final_val_loss"],
                "samples_per_s": r["samples_per_s"],
                "compression_samples_per_s": r["stages"]["compression"].get("samples_per_s"),
                "train_time_s": r["train_time_s"],
                # the testbed's hosts all count the start-up broadcasts; rank 0 sends them
                "comm_bytes": r.get("accounted_tx_bytes_per_host", r["comm_bytes"]),
                "nic_bytes": sum(tx) / len(tx) if tx else None,
                "run_dir": r["out_dir"],
                "freeze_step": r.get("freeze_step"),
            }
        )
    return rows


def freeze_step_of(runs: Any) -> int:
    """The step where the 1-bit run switched to compression (the automatic freeze decides
    it during the run): both runs are compared over the steps after it."""
    steps = [r["freeze_step"] for r in runs if r.get("freeze_step")]
    if not steps:
        raise ConfigError("the 1-bit run reported no freeze step (did it reach compression?)")
    return int(steps[0])


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    from thinwire.testbed.netns import unavailable_reason

    cfg = _base_config(args)
    if args.workers < 2:
        raise ConfigError(
            f"the demo compares distributed runs: --workers must be >= 2, got {args.workers}"
        )
    reason = "--no-testbed was given" if args.no_testbed else unavailable_reason()
    delay = getattr(args, "delay", None)
    rtt_s = 2 * parse_duration(delay) if delay else 0.0
    if rtt_s and reason is not None:
        raise ConfigError(f"--delay needs the emulated network, which cannot run: {reason}")
    out = Path(args.out)
    _prepare_out(out)
    link = f"{args.rate} links" + (f", {delay} apart" if rtt_s else "")
    where = (
        f"{args.workers} emulated hosts on {link}"
        if reason is None
        else f"{args.workers} local workers over loopback (network not slowed: {reason})"
    )

    print(
        f"== 1/3  Is the network the bottleneck? {cfg.model} GPT, {args.workers} workers, {args.rate}\n"
    )
    profile = analyze(cfg, args.workers, args.rate, out, testbed=reason is None, rtt_s=rtt_s)
    print(f"\n== 2/3  Training with LAMB and with 1-bit LAMB on {where}\n")
    result = train_both(cfg, args.workers, args.rate, out, reason is None, delay)
    rows = rows_of(result)
    # Like with like: the steps after the first compressing one (which allocates the
    # error-feedback buffers), for both runs; evaluation is not part of a logged step.
    predicted = predicted_steps(profile, args.workers, args.rate, rtt_s)
    freeze = freeze_step_of(rows)
    first = freeze + 2
    for row in rows:
        row["predicted_step_s"] = predicted[row["algo"]]
        row["measured_step_s"] = _measured_step(Path(row["run_dir"]), first, cfg.steps)
    print(
        f"\n== 3/3  Side by side ({cfg.steps} steps, 1-bit LAMB compressing after step {freeze})\n"
    )
    print(side_by_side(rows))
    title = f"LAMB and 1-bit LAMB: {cfg.model} GPT, {where}"
    plot = plot_comparison(result, out / "demo.png", title)
    if plot is not None:
        print(f"\nplot: {plot}")
    result = {"where": where, "config": cfg.to_dict(), "runs": rows, "study": "study.json"}
    atomic_write_text(out / "demo.json", json.dumps(result, indent=2, default=str) + "\n")
    return result


def _main(args: argparse.Namespace) -> int:
    run_demo(args)
    return 0
