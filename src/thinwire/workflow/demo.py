"""The demo as a library pipeline: train a job with LAMB, find out from its own record
whether the network is its bottleneck, train it with 1-bit LAMB, and show both side by
side (what ``thinwire demo`` runs).

1. **Train** the job with LAMB (fp32 gradient allreduce), recording every step
   (:mod:`thinwire.comm.step_record`). On the testbed (root and iproute2) the W workers
   are W emulated hosts joined by links rate-limited with ``tc`` (:mod:`thinwire.testbed`),
   so the time is measured on a real slow network and the bytes are read off the hosts'
   NICs; otherwise the workers talk over loopback and the result says so.
2. **Analyze** LAMB's record (:mod:`thinwire.analysis.recorded`): the compute, the
   gradients' ready times and DDP's buckets as the workers really ran them, sharing the
   cores and the network; the reductions and the 1-bit codec priced at this machine's
   measured costs. Is the network the bottleneck at the chosen link rate, and which fix?
   From the same record it predicts the step of both algorithms after the freeze; 1-bit
   LAMB's own step (update, codec, exchange) is timed for that on the job's workers,
   each step after the job's own forward and backward passes
   (:mod:`thinwire.analysis.job_passes`): a step timed alone misses what the workers'
   sharing of the cores costs, and one timed after stand-in arithmetic came out too slow.
3. **Train** it with 1-bit LAMB, same settings, through the same comparison driver, and
   **compare**: validation loss, samples/s (whole run and after the freeze), the step
   after the freeze as predicted in step 2 and as measured, training time, bytes per
   worker; and a plot (``OUT/demo.png``).

Python::

    from thinwire.workflow import DemoSettings, run_demo

    result = run_demo(DemoSettings(rate="100mbit", out="runs/demo"))  # one worker per core
    result["runs"][1]["comm_bytes"] / result["runs"][0]["comm_bytes"]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.rundir import writable_dir
from thinwire.testbed.wan import parse_duration
from thinwire.train.algorithms import default_lr
from thinwire.train.compare_report import plot_comparison
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics
from thinwire.workflow.demo_report import side_by_side

if TYPE_CHECKING:
    from thinwire.analysis.validate_compare import Link

__all__ = [
    "ALGOS",
    "DEMO_LR",
    "DEMO_MAX_WORKERS",
    "DEMO_STEPS",
    "DemoSettings",
    "analyze",
    "default_workers",
    "onebit_split",
    "onebit_step_on",
    "predicted_steps",
    "run_demo",
    "training",
    "workers_line",
]

ALGOS = ("lamb", "onebit-lamb")
"""The two algorithms the demo trains, the uncompressed reference first."""

DEMO_STEPS = TrainConfig.steps
"""Steps per demo run: ``thinwire train``'s default (300)."""

DEMO_LR = default_lr("onebit-lamb")
"""Peak lr of both demo runs: ``thinwire train``'s tuned default, which LAMB and 1-bit LAMB
share (0.02). The demo runs both on ``thinwire train``'s defaults (300 steps, 4 workers x
16 sequences, lr warmup 20 steps), the setting whose convergence docs/results/optimizers.md
checks on two corpora and three seeds ("The automatic freeze"). Shorter runs are not that
setting: at 120 steps (lr 0.015, warmup 12, the freeze capped at step 36) 1-bit LAMB
ended 3% above LAMB (2.652 against 2.573, loopback, seed 0)."""


DEMO_MAX_WORKERS = 4
"""The most workers the demo picks by itself (:func:`default_workers`)."""


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers(cores: int | None = None) -> int:
    """The demo's workers when none are named: one per usable core, from 2 up to
    :data:`DEMO_MAX_WORKERS`.

    Why one per core: the demo measures time, and emulated hosts that share a core take
    turns on it, so how long a step waits for the others is the scheduler's choice. On
    the 2-core machine, with the same prediction, 1-bit LAMB's predicted step was -3% to
    +13% off the measured one over 3 demos on 4 hosts, -6% to +8% over 9 on 2; between
    runs of one command its measured step spread 0.15-0.17 s on 4 hosts, 0.065-0.079 s
    on 2 (docs/results/analysis.md has the runs)."""
    return max(2, min(DEMO_MAX_WORKERS, usable_cores() if cores is None else cores))


def workers_line(asked: int | None, workers: int, cores: int) -> str | None:
    """What the demo says about its worker count: how it was chosen when ``asked`` is
    None, a note when more workers than cores were asked for, else nothing."""
    if asked is None:
        return (
            f"({workers} workers: one per core of this machine's {cores}, at most "
            f"{DEMO_MAX_WORKERS}; --workers N to choose)"
        )
    if workers > cores:
        return (
            f"note: {workers} workers share this machine's {cores} cores: their step times "
            "follow the scheduler, and the predicted steps are looser"
        )
    return None


@dataclass
class DemoSettings:
    """What the demo runs; the defaults are ``thinwire demo``'s."""

    workers: int | None = None
    """Workers, or emulated hosts on the testbed (at least 2); None: one per core, at
    most 4 (:func:`default_workers`)."""
    rate: str = "100mbit"
    """Link rate of the emulated hosts (``100mbit``, ``1gbit``, ``unlimited``); the
    analysis predicts at it even over loopback."""
    delay: str | None = None
    """One-way delay between the emulated hosts (``50ms``; the testbed only). The analysis
    prices each message with the round trip, twice it."""
    model: str = "tiny"
    """GPT preset."""
    steps: int = DEMO_STEPS
    """Steps per run."""
    batch_size: int = 16
    """Sequences per worker per step."""
    freeze_step: int | str = "auto"
    """1-bit LAMB's warmup: ``"auto"`` (until the second moment settles) or a step."""
    lr: float = DEMO_LR
    """Peak learning rate of both runs."""
    out: str = "runs/demo"
    """Output directory; a previous demo's output there is replaced, anything else refused."""
    testbed: bool = True
    """Train on emulated hosts when the testbed can run here; False: over loopback."""
    seq_len: int | None = None
    """Override the preset's context length (tests use tiny shapes)."""
    n_layer: int | None = None
    """Override the preset's depth."""
    n_head: int | None = None
    """Override the preset's attention heads."""
    n_embd: int | None = None
    """Override the preset's width."""

    def resolved(self) -> DemoSettings:
        """These settings with the worker count chosen (:func:`default_workers`)."""
        return self if self.workers is not None else replace(self, workers=default_workers())

    def train_config(self) -> TrainConfig:
        """The runs' shared settings, checked (a one-line ConfigError when impossible)."""
        workers = self.resolved().workers
        if workers < 2:
            raise ConfigError(
                f"the demo compares distributed runs: --workers must be >= 2, got {workers}"
            )
        cfg = TrainConfig(
            model=self.model,
            seq_len=self.seq_len,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            steps=self.steps,
            batch_size=self.batch_size,
            freeze_step=self.freeze_step,
            lr=self.lr,
            warmup_steps=max(1, min(TrainConfig.warmup_steps, self.steps // 10)),
            eval_interval=max(1, self.steps // 6),
            eval_sequences=64,
            log_interval=max(1, self.steps // 30),
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


# ------------------------------------------------------------------------ 2. analyze


def analyze(
    run_dir: Path,
    workers: int,
    rate: str,
    out: Path,
    rtt_s: float = 0.0,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Analyze the recorded LAMB run in ``run_dir``: is the network its bottleneck on
    ``workers`` hosts at ``rate``, and which fix. The compute, the gradients' ready times
    and DDP's buckets come from the run's own record
    (:func:`thinwire.analysis.recorded.analyze_record`), measured while the workers
    shared the cores and the network as they do in training; the reductions and the
    1-bit codec are priced at this machine's measured costs. Writes ``OUT/study.json``
    (and the figures, with matplotlib); returns the study.
    """
    from thinwire.analysis import write_plots
    from thinwire.analysis.recorded import analyze_record, load_record
    from thinwire.analysis.report import render_report

    link = _link(rate, rtt_s)
    study = analyze_record(
        load_record(run_dir), workers=workers, bandwidth_gbps=link.bandwidth_gbps, rtt_s=rtt_s
    )
    atomic_write_text(out / "study.json", json.dumps(study, indent=2) + "\n")
    with contextlib.suppress(ImportError):  # plots need matplotlib; the report does not
        write_plots(study, out / "analysis")
    echo(render_report(study))
    return study


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
    run_dir: Path, workers: int, link: Link, onebit_step: dict[str, float]
) -> dict[str, float]:
    """Predicted seconds per step after the freeze, per algorithm, from the LAMB run's
    record (:class:`~thinwire.analysis.recorded_predict.RecordedPredictor`): LAMB's as
    DDP trains it, 1-bit LAMB's with its own step as :func:`onebit_step_on` timed it."""
    from thinwire.analysis.recorded_predict import RecordedPredictor

    predictor = RecordedPredictor.from_run(run_dir, workers, link, onebit_step)
    return {
        "lamb": predictor.step("ddp").step_s,
        "onebit-lamb": predictor.step("onebit").step_s,
    }


def onebit_step_on(cluster: Any, run_dir: Path, out: Path, workers: int) -> dict[str, float]:
    """1-bit LAMB's compressed step on the job itself, after its own forward and backward
    passes, timed on every rank at once where the job runs: on ``cluster``'s hosts, or
    on ``workers`` local ranks when there is none (:func:`thinwire.analysis.optimizer_step.time_where_the_job_runs`)."""
    from thinwire.analysis.optimizer_step import time_where_the_job_runs

    return time_where_the_job_runs("onebit-lamb", run_dir, out, cluster, workers)


def onebit_split(run_dir: Path) -> dict[str, float] | None:
    """How the 1-bit run's own compressed steps spent their optimizer time (medians of
    its record: update, codec, waiting), to set beside the timing the prediction used;
    None without a record or a compressed step."""
    from thinwire.analysis.recorded import load_record, measured

    try:
        return measured(load_record(run_dir))["onebit_exchange"]
    except ConfigError:
        return None


def _split_line(split: dict[str, float], when: str) -> str:
    return (
        f"1-bit LAMB's step {when}: update {split['update_s'] * 1e3:.1f} ms, codec "
        f"{split['codec_s'] * 1e3:.1f} ms, waiting for the exchange {split['wait_s'] * 1e3:.1f} ms"
    )


# ------------------------------------------------------------------------ 1. and 3. train


def _measured_step(run_dir: Path, first: int, last: int) -> float | None:
    """Mean logged seconds per step of steps ``first..last`` (None: fewer than 2 logged)."""
    from thinwire.analysis.validate_compare import measured_step_s

    try:
        return measured_step_s(read_metrics(run_dir / "metrics.jsonl"), first, last)["mean_s"]
    except ConfigError:
        return None


@contextlib.contextmanager
def training(
    cfg: TrainConfig,
    workers: int,
    rate: str,
    out: Path,
    testbed: bool,
    delay: str | None = None,
) -> Iterator[tuple[Callable[[list[str]], dict[str, Any]], Any]]:
    """A function that trains run specs into ``OUT/train`` with the comparison driver and
    returns the comparison of all of them (runs finished before are read back, not
    trained again), and the cluster: on the testbed, one cluster at ``rate`` (hosts
    ``delay`` apart) kept up for the whole demo; otherwise local workers (and None)."""
    from thinwire.train.compare import compare

    base = replace(cfg, resume=True)  # the demo's own runs, read back
    if not testbed:
        yield (lambda algos: compare(algos, base, workers, out / "train")), None
        return
    from thinwire.testbed.cluster import Cluster
    from thinwire.testbed.experiments import on_cluster
    from thinwire.testbed.rates import format_rate, parse_rate

    where = {"kind": "testbed", "hosts": workers, "rate": format_rate(parse_rate(rate))}
    with Cluster(workers, rate, delay=delay) as cluster:
        runner = on_cluster(cluster)
        yield (
            (
                lambda algos: compare(
                    algos,
                    base,
                    workers,
                    out / "train",
                    runner=runner,
                    where=where | {"delay": delay},
                )
            ),
            cluster,
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


def run_demo(settings: DemoSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train LAMB, analyze its record, train 1-bit LAMB, compare: the whole demo.

    ``echo`` receives the report as it goes (each stage's heading, the analysis, the
    side-by-side table); the result (also ``OUT/demo.json``) holds where it ran, the
    shared config, one row per run (loss, samples/s, bytes, predicted and measured step
    after the freeze) and the study's file.
    """
    from thinwire.testbed.netns import unavailable_reason

    s = settings.resolved()
    cfg = s.train_config()
    reason = unavailable_reason() if s.testbed else "--no-testbed was given"
    rtt_s = 2 * parse_duration(s.delay) if s.delay else 0.0
    if rtt_s and reason is not None:
        raise ConfigError(f"--delay needs the emulated network, which cannot run: {reason}")
    out = Path(s.out)
    _prepare_out(out)
    link = f"{s.rate} links" + (f", {s.delay} apart" if rtt_s else "")
    where = (
        f"{s.workers} emulated hosts on {link}"
        if reason is None
        else f"{s.workers} local workers over loopback (network not slowed: {reason})"
    )
    echo(f"== 1/3  Training with LAMB on {where}, every step recorded\n")
    line = workers_line(settings.workers, s.workers, usable_cores())
    if line is not None:
        echo(line + "\n")
    with training(cfg, s.workers, s.rate, out, reason is None, s.delay) as (train, cluster):
        train(["lamb"])
        lamb_dir = out / "train" / "lamb"
        echo(
            f"\n== 2/3  Is the network the bottleneck? LAMB's own record, analyzed "
            f"({cfg.model} GPT, {s.workers} workers, {s.rate})\n"
        )
        analyze(lamb_dir, s.workers, s.rate, out, rtt_s, echo)
        onebit_step = onebit_step_on(cluster, lamb_dir, out / "onebit-step", s.workers)
        echo(
            f"\n{_split_line(onebit_step, 'timed')} (on the {s.workers} workers at once, "
            "after the job's own passes)"
        )
        predicted = predicted_steps(lamb_dir, s.workers, _link(s.rate, rtt_s), onebit_step)
        echo(f"\n== 3/3  Training with 1-bit LAMB on {where}, and both side by side\n")
        result = train(list(ALGOS))
    rows = rows_of(result)
    # Like with like: the steps after the first compressing one (which allocates the
    # error-feedback buffers), for both runs; evaluation is not part of a logged step.
    freeze = freeze_step_of(rows)
    for row in rows:
        row["predicted_step_s"] = predicted[row["algo"]]
        row["measured_step_s"] = _measured_step(Path(row["run_dir"]), freeze + 2, cfg.steps)
    echo(f"({cfg.steps} steps, 1-bit LAMB compressing after step {freeze})\n")
    echo(side_by_side(rows))
    split = onebit_split(Path(next(r["run_dir"] for r in rows if r["algo"] == ALGOS[1])))
    if split is not None:
        echo(f"\n{_split_line(split, 'in its run')}\n{_split_line(onebit_step, 'timed before')}")
    title = f"LAMB and 1-bit LAMB: {cfg.model} GPT, {where}"
    plot = plot_comparison(result, out / "demo.png", title)
    if plot is not None:
        echo(f"\nplot: {plot}")
    demo = {
        "where": where,
        "settings": asdict(s),
        "config": cfg.to_dict(),
        "runs": rows,
        "study": "study.json",
        "onebit_step": {"timed_before": onebit_step, "in_the_run": split},
    }
    atomic_write_text(out / "demo.json", json.dumps(demo, indent=2, default=str) + "\n")
    return demo
