"""Check ``thinwire analyze``'s predicted step time against training on the emulated network.

The what-if model (:mod:`thinwire.analysis.network_model`) predicts a step from a profile of
one worker and a link. This module puts that prediction next to reality: per link rate
it brings up a testbed cluster (:mod:`thinwire.testbed`, needs root) and

1. profiles the GPT the trainer will train, with the batch and the threads a testbed
   host gets (``cores // hosts``), two ways: *alone* (one process, the paper's method)
   and *co-located* (``hosts`` processes at once, each in a session of its own like a
   testbed host, no communication, so each sees the CPU share a host sees); before the
   first run and after each one, every run predicted from the profiles around it;
2. fits latency and bandwidth to a quick ``thinwire bench allreduce`` of fp32 and of the
   1-bit collective on the cluster (:func:`thinwire.analysis.fit.fit_link`; the 1-bit
   call's own latency too), or takes the nominal rate;
3. predicts the step of three schemes: fp32 DDP (``adamw``: observed DDP buckets,
   overlapped with backward), the fp32 warmup of a 1-bit optimizer (one fused allreduce
   after backward) and its compression stage (one 1-bit allreduce after backward, plus
   the measured compute of :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce`);
4. trains ``adamw`` and the 1-bit optimizer on the cluster
   (:func:`thinwire.testbed.experiments.train_on_testbed`) and reads each step's time;
5. writes ``validation.json``, a markdown table (predicted vs measured, error %) and a
   plot (:mod:`thinwire.analysis.validate_report`).

The pieces live beside this module: the co-located profiles in
:mod:`thinwire.analysis.colocated`, the schemes, the link and the error arithmetic in
:mod:`thinwire.analysis.validate_compare`, the outputs in
:mod:`thinwire.analysis.validate_report`. This module runs the experiment; its command
line is ``thinwire analyze validate`` (:mod:`thinwire.cli.analyze_validate`).

Run (as root)::

    thinwire analyze validate --model small --batch-size 8 --hosts 4 \\
        --rates 50mbit,100mbit,1gbit --steps 30 --freeze-step 10 \\
        --out runs/validate --plot runs/validate/validate.png

    # the same runs predicted again with the link fitted over 1-16 MiB (nothing re-measured)
    thinwire analyze validate --from-json runs/validate/validation.json \\
        --refit-min-bytes 1048576 --out runs/validate-refit

Tuning and reading the numbers:

* Compare like with like. The trainer's step time excludes evaluation and the loss
  allreduce; DDP's first ``skip_steps`` steps (bucket rebuild, allocator growth), the
  first compressing step (error-feedback buffers allocated) and the steps in which the
  1-bit collective still tunes its pieces and phase-2 scheme (``onebit_tuned`` in the
  trainer's log; up to ~20 calls) are left out: the model predicts the steady state.
* The testbed's hosts share this machine's cores, which real hosts do not; the
  co-located profile measures the compute under that sharing, the alone profile does
  not. Their gap is the CPU-contention error of the paper's method on this testbed.
* Sessions matter: each co-located profile process runs in a session of its own, as a
  testbed host does (why, and the numbers: :mod:`thinwire.analysis.colocated`).
* ``steps`` 30-40 with ``freeze_step`` ~10 gives ~20 samples per stage: enough for a
  mean within a few % on a quiet machine. On a loaded machine record ``load`` and
  repeat rather than lengthen.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from thinwire.analysis.colocated import host_threads, merge_profiles, profile_processes
from thinwire.analysis.fit import fit_link
from thinwire.analysis.optimizer_step import time_where_the_job_runs
from thinwire.analysis.profile import Profile, load_profile
from thinwire.analysis.recorded_predict import RecordedPredictor
from thinwire.analysis.validate_compare import (
    GLOO_CONCURRENCY,
    SCHEMES,
    TCP_PAYLOAD_SHARE,
    Link,
    compare_rows,
    error_pct,
    measured_step_s,
    predict_step,
    step_prediction,
    summarize,
)
from thinwire.analysis.validate_config import ValidationConfig
from thinwire.analysis.validate_report import (
    format_table,
    plot_validation,
    read_result,
    write_result,
)
from thinwire.comm.step_record import RECORD_NAME
from thinwire.errors import ConfigError

if TYPE_CHECKING:
    from thinwire.train.config import TrainConfig

# The names below stay importable from here, where earlier releases defined them.
__all__ = [
    "GLOO_CONCURRENCY",
    "SCHEMES",
    "TCP_PAYLOAD_SHARE",
    "Link",
    "ValidationConfig",
    "error_pct",
    "format_table",
    "host_threads",
    "measured_step_s",
    "merge_profiles",
    "plot_validation",
    "predict_step",
    "profile_processes",
    "repredict",
    "run_validation",
    "summarize",
]


# --- one rate on the testbed -------------------------------------------------------------


def _fit_on_cluster(
    cluster: Any, cfg: ValidationConfig, out_dir: Path
) -> tuple[Link, dict[str, Any]]:
    # The project's benchmark on the cluster (fp32 and the 1-bit call), then the fit.
    bench_dir = out_dir / "bench"
    argv = [
        sys.executable,
        "-m",
        "thinwire",
        "bench",
        "allreduce",
        "--methods",
        "fp32,onebit",
        "--min-size",
        str(cfg.fit_min_bytes),
        "--max-size",
        str(cfg.fit_max_bytes),
        "--warmup",
        "1",
        "--iters",
        "3",
        "--out",
        str(bench_dir),
    ]
    res = cluster.run(argv, timeout_s=cfg.timeout_s, log_dir=out_dir / "bench-hosts")
    if not res.ok:
        raise RuntimeError(f"the allreduce benchmark failed on the testbed:\n{res.summary()}")
    rows = json.loads((bench_dir / "allreduce.json").read_text())["rows"]
    fit = fit_link(rows)
    return _fitted(fit), {
        "fit": fit.to_json(),
        "rows": rows,
        "command": argv,
    }


def _fitted(fit: Any) -> Link:
    return Link(fit.bandwidth_gbps, fit.alpha_per_message_s, "fitted", fit.onebit_latency)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "step_s" in r]


def _validate_rate(cfg: ValidationConfig, rate: str, out_dir: Path) -> dict[str, Any]:
    from thinwire.testbed.cluster import Cluster
    from thinwire.testbed.rates import format_rate, parse_rate

    rate_bits = parse_rate(rate)
    load: dict[str, float] = {}
    with Cluster(cfg.hosts, rate, delay=cfg.delay) as cluster:
        link = Link.nominal(float(rate_bits), cfg.rtt_s)  # type: ignore[arg-type]
        fit_info: dict[str, Any] | None = None
        if cfg.fit:
            load["fit"] = os.getloadavg()[0]
            link, fit_info = _fit_on_cluster(cluster, cfg, out_dir)
        runs, points = _train_between_profiles(cfg, rate, out_dir, cluster, load)
        record_link = _record_link(cfg, float(rate_bits), link)  # type: ignore[arg-type]
        recorded = _recorded_predictor(cfg, out_dir, cluster, record_link)
    load["end"] = os.getloadavg()[0]
    records = {algo: r["records"] for algo, r in runs.items()}
    rows = _predict_rows(cfg, float(rate_bits), points, records, link)  # type: ignore[arg-type]
    if recorded is not None:
        add_recorded_predictions(rows, recorded, cfg.local_steps)
    return {
        "rate": format_rate(rate_bits),
        "rate_bits": rate_bits,
        "rows": rows,
        "load_avg_1min": load,
        "link": asdict(link),
        "link_fit": fit_info,
        "profiles": [
            {
                kind: p.summary() | {"codec_s_per_byte": p.meta.get("onebit_codec_s_per_byte")}
                for kind, p in point.items()
            }
            for point in points
        ],
        "runs": {a: {k: v for k, v in r.items() if k != "records"} for a, r in runs.items()},
        "recorded": recorded.meta() if recorded is not None else None,
    }


def _record_link(cfg: ValidationConfig, rate_bits: float, fitted: Link) -> Link:
    """The link the recorded predictions use. Without a set delay, the nominal one: on
    the record's own link the predictor takes the rate its collectives achieved, a
    measurement of the job itself (a fit of a separate benchmark on 2 hosts missed by
    54%). With a set delay, the validation's (fitted) link: latency then dominates the
    ring, and its rounds must be priced apart from the rate."""
    return fitted if cfg.rtt_s > 0 else Link.nominal(rate_bits)


def _recorded_predictor(
    cfg: ValidationConfig, out_dir: Path, cluster: Any, link: Link
) -> RecordedPredictor | None:
    """Predictions from the fp32 DDP run's own record (None when it has none), on
    ``link`` (:func:`_record_link`), with the 1-bit optimizer's step timed on the
    cluster while it is up."""
    ddp_dir = out_dir / "adamw"
    if not (ddp_dir / RECORD_NAME).is_file():
        return None
    onebit = None
    if cfg.onebit_algo in cfg.algos:
        onebit = time_where_the_job_runs(cfg.onebit_algo, ddp_dir, out_dir / "onebit-step", cluster)
    return RecordedPredictor.from_run(ddp_dir, cfg.hosts, link, onebit)


def add_recorded_predictions(
    rows: list[dict[str, Any]], predictor: RecordedPredictor, local_steps: int = 1
) -> None:
    """Each row's step predicted from the recorded DDP run (``predicted_recorded``) and
    its error (``err_recorded_pct``), in place."""
    for row in rows:
        sim = predictor.step(row["scheme"].split("@")[0], local_steps)
        row["predicted_recorded"] = step_prediction(sim)
        row["err_recorded_pct"] = error_pct(sim.step_s, row["measured"]["mean_s"])


def _train_between_profiles(
    cfg: ValidationConfig, rate: str, out_dir: Path, cluster: Any, load: dict[str, float]
) -> tuple[dict[str, Any], list[dict[str, Profile]]]:
    """Train each of ``cfg.algos`` on the cluster, with profiles before the first run and
    after each one; the runs and the profiles, and the machine's load in ``load``."""
    from thinwire.testbed.experiments import train_on_testbed

    train_cfg = _train_config(cfg)
    runs: dict[str, Any] = {}
    # Other work on a shared machine changes the compute time within minutes, so
    # every run is sandwiched between profiles and predicted from their mean.
    points = [_profile_point(cfg, out_dir, 0, load)]
    for algo in cfg.algos:
        load[algo] = os.getloadavg()[0]
        res = train_on_testbed(
            replace(train_cfg, algo=algo),
            cfg.hosts,
            rate,
            out_dir / algo,
            cluster=cluster,
            timeout_s=cfg.timeout_s,
        )
        runs[algo] = {
            "records": _records(out_dir / algo),
            "testbed": res["testbed"],
            "first_compressing_step": res["stages"]["first_compressing_step"],
        }
        points.append(_profile_point(cfg, out_dir, len(points), load))
    return runs, points


def _profile_point(
    cfg: ValidationConfig, out_dir: Path, point: int, load: dict[str, float]
) -> dict[str, Profile]:
    """The profiles of one point in time (the first one also observes DDP's buckets)."""
    threads = host_threads(cfg.hosts)
    prof_args = dict(warmup=cfg.profile_warmup, steps=cfg.profile_steps, timeout_s=cfg.timeout_s)
    # Both profiles at one moment: the paper's one worker, and the testbed's sharing.
    got = {}
    for kind, procs in (("alone", 1), ("colocated", cfg.hosts)):
        load[f"profile-{point}-{kind}"] = os.getloadavg()[0]
        got[kind] = profile_processes(
            cfg.model,
            cfg.batch_size,
            procs,
            threads,
            cfg.hosts,
            out_dir / f"profile-{point}-{kind}",
            observe_ddp=point == 0 and procs == 1,
            onebit_algo=cfg.onebit_algo,
            **prof_args,  # type: ignore[arg-type]
        )
    return got


def _train_config(cfg: ValidationConfig) -> TrainConfig:
    """The trainer's settings of every run (its ``algo`` set per run)."""
    from thinwire.train.config import TrainConfig

    return TrainConfig(
        model=cfg.model,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        freeze_step=cfg.freeze_step,
        warmup_steps=min(10, cfg.steps),
        eval_interval=cfg.steps,
        eval_sequences=8,
        checkpoint_interval=0,
        grad_dtype="fp32",
        local_steps=cfg.local_steps or 10,
    )


def _settled_step(records: list[dict[str, Any]], first: int) -> int:
    """The first step at or after ``first`` run by a 1-bit collective done tuning itself.

    Its piece tuner tries settings over its first ~20 calls (slower ones among them);
    the model predicts the steady state. Runs logged before ``onebit_tuned`` existed
    keep ``first``."""
    tuned = [r["step"] for r in records if r.get("onebit_tuned") == 1]
    return max(first, tuned[0] + 1) if tuned else first


def _predict_rows(
    cfg: ValidationConfig,
    rate_bits: float,
    points: list[dict[str, Profile]],
    records: dict[str, list[dict[str, Any]]],
    link: Link,
) -> list[dict[str, Any]]:
    """Predicted vs measured rows of one rate, each run predicted from the mean of the
    profiles taken just before and just after it."""
    observed = points[0]["alone"].observed_buckets
    around: dict[str, dict[str, Profile]] = {}
    algos = [a for a in cfg.algos if a in records]  # a result from before DiLoCo has none
    for k, algo in enumerate(algos):
        around[algo] = {
            kind: merge_profiles([points[k][kind], points[k + 1][kind]])
            for kind in ("alone", "colocated")
        }
        for p in around[algo].values():
            p.observed_buckets = observed

    n, f = cfg.steps, cfg.freeze_step
    # (run, first step, last step) compared with each scheme; see the module docstring.
    spans = {
        "ddp": ("adamw", cfg.skip_steps + 1, n),
        # the 1-bit optimizers' warmup trains under DDP too: the same buckets, fp32 here
        "ddp@warmup": (cfg.onebit_algo, 2, f),
        "onebit": (cfg.onebit_algo, _settled_step(records.get(cfg.onebit_algo, []), f + 2), n),
    }
    if "diloco" in algos:
        spans["diloco"] = ("diloco", *cfg.diloco_span())
    h, rtt = cfg.local_steps, cfg.rtt_s
    return compare_rows(around, records, spans, link, cfg.hosts, rate_bits, h, rtt)


def run_validation(
    cfg: ValidationConfig, out_dir: Path, plot: Path | None = None
) -> dict[str, Any]:
    """Profile, predict and measure at every rate of ``cfg``; write ``validation.json``.

    Raises:
        ConfigError: bad settings, an existing non-empty ``out_dir``, or no testbed here
            (not root, no ``tc``), before anything runs.
    """
    from thinwire.testbed import unavailable_reason

    cfg.check()
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(reason)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"out dir {out_dir} is not empty; each validation needs a fresh one")
    result: dict[str, Any] = {
        "format": "thinwire.validation/1",
        "config": asdict(cfg),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cores": os.cpu_count(),
        "threads_per_host": host_threads(cfg.hosts),
        "rates": [],
    }
    for rate in cfg.rates:
        result["rates"].append(_validate_rate(cfg, rate, out_dir / rate))
        write_result(result, out_dir, plot)  # keep what is done if a later rate fails
    return result


def repredict(
    src_dir: Path, fit_min_bytes: int | None = None, fit_max_bytes: int | None = None
) -> dict[str, Any]:
    """Predict an earlier validation again, with the link fitted over other message sizes.

    Reads the profiles, training records and link benchmark saved under ``src_dir``
    (a :func:`run_validation` output); nothing is measured again. Use it to see how much
    of a miss the link fit explains: fit over the sizes of the job's buckets.
    """
    old = read_result(Path(src_dir) / "validation.json")
    cfg = ValidationConfig(**{**old["config"], "rates": tuple(old["config"]["rates"])})
    lo = cfg.fit_min_bytes if fit_min_bytes is None else fit_min_bytes
    hi = cfg.fit_max_bytes if fit_max_bytes is None else fit_max_bytes
    new = {**old, "rates": [], "refit": {"min_bytes": lo, "max_bytes": hi, "from": str(src_dir)}}
    for rate, entry in zip(cfg.rates, old["rates"], strict=True):
        rdir = Path(src_dir) / rate
        points = [
            {
                kind: merge_profiles(
                    [load_profile(f) for f in sorted((rdir / f"profile-{k}-{kind}").glob("*.json"))]
                )
                for kind in ("alone", "colocated")
            }
            for k in range(len(entry["profiles"]))
        ]
        points[0]["alone"].observed_buckets = load_profile(
            rdir / "profile-0-alone" / "profile-0.json"
        ).observed_buckets
        link = Link.nominal(float(entry["rate_bits"]), cfg.rtt_s)
        fit_info = None
        if cfg.fit:
            rows = json.loads((rdir / "bench" / "allreduce.json").read_text())["rows"]
            fit = fit_link([r for r in rows if lo <= r["size_bytes"] <= hi])
            link = _fitted(fit)
            fit_info = {"fit": fit.to_json()}
        records = {algo: _records(rdir / algo) for algo in entry["runs"]}
        rows_out = _predict_rows(cfg, float(entry["rate_bits"]), points, records, link)
        record_link = _record_link(cfg, float(entry["rate_bits"]), link)
        recorded = _saved_recorded_predictor(cfg, rdir, record_link)
        if recorded is not None:
            add_recorded_predictions(rows_out, recorded, cfg.local_steps)
        new["rates"].append(
            {**entry, "rows": rows_out, "link": asdict(link), "link_fit": fit_info}
            | {"recorded": recorded.meta() if recorded is not None else None}
        )
    return new


def _saved_recorded_predictor(
    cfg: ValidationConfig, rdir: Path, link: Link
) -> RecordedPredictor | None:
    """The recorded predictions of a saved rate: the DDP run's record and the 1-bit step
    timed then (``onebit-step/optimizer.json``); None for a validation without them."""
    ddp_dir = rdir / "adamw"
    if not (ddp_dir / RECORD_NAME).is_file():
        return None
    timed = rdir / "onebit-step" / "optimizer.json"
    onebit = json.loads(timed.read_text())["summary"] if timed.is_file() else None
    return RecordedPredictor.from_run(ddp_dir, cfg.hosts, link, onebit)
