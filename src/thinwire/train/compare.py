"""Run several algorithms on the same settings and compare them: loss, bytes, time.

This is the one comparison driver: ``thinwire compare`` (local workers over loopback),
``thinwire compare --testbed`` (emulated hosts on slow links, one
:func:`~thinwire.testbed.experiments.on_cluster` runner per rate) and ``thinwire demo``
all call :func:`compare`; only the *runner* that trains the configs differs.

Every run uses the same :class:`~thinwire.train.config.TrainConfig` (model, data, seed,
batch, steps), so the runs see the same batches in the same order and differ only in
what a run spec changes. A run spec is an algorithm name, optionally followed by
``@key=value,...`` overrides of config fields, e.g. ``lamb@lr=0.01`` or
``onebit-lamb@lr=0.01,freeze_step=30``; the spec is also the run's label and (made
path-safe) its sub-directory of ``out_dir``. Unless the base config's lr is meant for
all (``lrs``), each algorithm trains at its own tuned peak lr: LAMB-style and Adam-style
optimizers want learning rates an order of magnitude apart, and a baseline at the other
family's lr makes every ratio against it meaningless.

The result (``out_dir/comparison.json``) holds, per run, its full config, the validation
curve (``val``: ``[samples, val_loss]``, and ``val_time``: ``[seconds, val_loss]``), the
cumulative bytes curve (``[samples, comm_bytes]``, bytes one worker put on the wire, see
:mod:`thinwire.comm.accounting`), the summary, the step times of the warmup and
compression stages (:func:`~thinwire.train.stages.stage_times`, split for every run at
the first 1-bit run's freeze step so all are timed over the same steps), whatever the
runner measured besides (``testbed``: NIC bytes, link rate), and ratios against the
reference run (the first one unless ``reference`` says otherwise): ``loss_ratio`` = final
validation loss / the reference's, ``bytes_reduction`` = the reference's bytes / this
run's, ``speedup`` and ``compression_speedup`` = samples/s over the reference's, whole run
and compression stage. The ratios are measured in the same invocation on the same
machine, which is what makes them comparable on a shared, noisy host.

Python::

    from thinwire.train.compare import compare
    from thinwire.train.compare_report import format_comparison, plot_comparison

    result = compare(["lamb", "onebit-lamb"], TrainConfig(steps=300), 4, Path("runs/cmp"))
    print(format_comparison(result))
    plot_comparison(result, "runs/cmp/comparison.png")
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from thinwire import runlock
from thinwire.comm.accounting import COUNTER
from thinwire.comm.launch import launched_by_torchrun, spawn
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.localsgd.algorithm.methods import METHODS, for_method
from thinwire.localsgd.settings import AsyncSettings
from thinwire.rundir import existing_run
from thinwire.train.algorithms import check_algorithm, check_config, default_lr
from thinwire.train.config import USED_BY, TrainConfig, drop_legacy_nulls
from thinwire.train.data import load_text
from thinwire.train.metrics import read_metrics
from thinwire.train.run import run_training
from thinwire.train.stages import final_train_loss, stage_times

__all__ = ["Runner", "compare", "local_runner", "parse_run_spec", "tuned_lrs"]

Runner = Callable[[list[TrainConfig], int, float], list[dict[str, Any]]]
"""Trains configs one after another: ``(configs, workers, timeout_s) -> summaries``.

Each summary is the run's ``summary.json`` (rank 0), optionally with more measurements
under ``testbed``; each config's ``out_dir`` is where its run goes."""

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# What a run spec may change; identity of the data (corpus, split) and the run's
# plumbing (output, resume) stay shared so the comparison remains like for like.
_FIXED = {"data", "val_fraction", "out_dir", "resume", "stop_after"}


def _convert(key: str, text: str) -> Any:
    """``text`` as the type of config field ``key``."""
    default = _FIELDS[key].default
    kind = str(_FIELDS[key].type)  # e.g. "int | None" for an optional count
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if key == "freeze_step":
            return text if text == "auto" else int(text)
        if isinstance(default, int) or kind == "int | None":
            return int(text)
        if isinstance(default, float) or kind == "float | None":
            return float(text)
        if key == "betas":
            b1, b2 = (float(v) for v in text.split("/"))
            return (b1, b2)
    except ValueError:
        raise ConfigError(f"run spec: bad value {text!r} for {key}") from None
    return text


def parse_run_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"onebit-lamb@lr=0.01,freeze_step=20"`` ->
    ``("onebit-lamb", {"lr": 0.01, "freeze_step": 20})``.

    Keys are :class:`TrainConfig` field names (dashes allowed); ``betas`` is written
    ``0.9/0.999``. The name may also be one of the asynchronous methods
    (:data:`~thinwire.localsgd.METHODS`: ``sync``, ``naive``, ``dn``, ``dn-dylu``, ...),
    which is ``async-diloco`` with that method's settings: ``dn-dylu@outer_lr=0.3`` ->
    ``("async-diloco", {"outer": "dn", ..., "dylu": True, "outer_lr": 0.3})``. Unknown
    algorithms and keys, and keys the algorithm never reads, raise :class:`ConfigError`.
    """
    algo, _, rest = spec.partition("@")
    overrides: dict[str, Any] = {}
    if algo in METHODS:
        overrides = _method_settings(algo)
        algo = "async-diloco"
    check_algorithm(algo)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _FIELDS or key in _FIXED or key == "algo":
            raise ConfigError(
                f"run spec {spec!r}: {item!r} is not KEY=VALUE for a config field "
                "(e.g. lr=0.01, freeze_step=20, warmup_steps=10)"
            )
        overrides[key] = _convert(key, value.strip())
    # Set for this run alone, so never meant to be ignored (a base flag may be shared).
    ignored = [key for key in overrides if key in USED_BY and algo not in USED_BY[key]]
    if ignored:
        raise ConfigError(f"run spec {spec!r}: {algo} does not use {', '.join(ignored)}")
    return algo, overrides


def _method_settings(method: str) -> dict[str, Any]:
    """The fields that make an ``async-diloco`` run the asynchronous ``method``."""
    chosen = for_method(AsyncSettings(), method)
    names = (
        "outer",
        "staleness",
        "max_staleness",
        "dylu",
        "sync",
        *(("c",) if chosen.sync else ()),
    )
    return {k: getattr(chosen, k) for k in names}


def _run_dir(out_dir: Path, label: str) -> Path:
    return out_dir / re.sub(r"[^A-Za-z0-9._=-]+", "_", label)


def _curves(metrics_path: Path) -> dict[str, list[list[float]]]:
    """``val`` ``[samples, val_loss]``, ``val_time`` ``[seconds, val_loss]`` and ``comm``
    (cumulative ``[samples, comm_bytes]``) from a run's ``metrics.jsonl``."""
    records = read_metrics(metrics_path)
    times = {r["step"]: r["time_s"] for r in records if "time_s" in r}
    out: dict[str, list[list[float]]] = {"val": [], "val_time": [], "comm": []}
    for r in records:
        if "val_loss" in r:
            out["val"].append([r["samples"], r["val_loss"]])
            # the untrained model's evaluation (step 0) comes before the clock starts
            out["val_time"].append([times.get(r["step"], 0.0), r["val_loss"]])
        if "comm_bytes" in r:
            out["comm"].append([r["samples"], r["comm_bytes"]])
    return out


def tuned_lrs(specs: list[str], trained: bool = False) -> dict[str, float]:
    """Each algorithm of ``specs`` with its tuned default peak lr (for ``lrs``); ``trained``:
    the runs start from a trained model (:data:`~thinwire.train.algorithms.TRAINED_LR`)."""
    return {algo: default_lr(algo, trained) for algo in (parse_run_spec(s)[0] for s in specs)}


def local_runner(cfgs: list[TrainConfig], workers: int, timeout_s: float) -> list[dict[str, Any]]:
    """All runs on one set of local workers: under torchrun, in this process, or spawned
    once (the default :data:`Runner`).

    Spawning once for the whole comparison (instead of once per run) saves the start-up
    of W Python processes per run, which on a busy machine costs more than a short run.
    :func:`compare` has checked every config (and read its data) before it calls this.
    """
    if launched_by_torchrun() or workers == 1 or any(c.algo == "async-diloco" for c in cfgs):
        # An asynchronous run is launched on its own: its workers may die without taking
        # the launcher down.
        out = []
        for cfg in cfgs:
            COUNTER.reset()
            out.append(run_training(cfg, workers, timeout_s))
        return out
    backend = "nccl" if cfgs[0].device == "cuda" else "gloo"
    return spawn(_rank_main, workers, (cfgs,), backend=backend, timeout_s=timeout_s * len(cfgs))[0]


def compare(
    algos: list[str],
    base: TrainConfig,
    workers: int,
    out_dir: Path,
    overrides: dict[str, dict[str, Any]] | None = None,
    reference: str | None = None,
    overwrite: bool = False,
    timeout_s: float = 1800.0,
    command: str | None = None,
    *,
    lrs: Mapping[str, float] | None = None,
    runner: Runner | None = None,
    where: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train every run spec in ``algos`` on ``base``'s settings; write and return the result.

    Args:
        algos: run specs (``ALGO`` or ``ALGO@key=value,...``); each is also a label.
        base: the shared settings; its ``algo`` and ``out_dir`` are ignored.
        workers: worker processes (or hosts) per run (ignored under ``torchrun``).
        out_dir: each run goes to a sub-directory; ``comparison.json`` to ``out_dir``.
        overrides: extra config overrides per label, applied after the spec's own.
        reference: the label the ratios are taken against (default: the first).
        overwrite: replace the runs already in ``out_dir`` instead of refusing.
            ``base.resume`` (``thinwire compare --resume``) keeps them instead: a run
            that finished with the same settings is read back, one that stopped
            continues from its last checkpoint, and only the rest train.
        timeout_s: seconds before a stuck run is stopped (the runs share one set of
            workers, so the comparison as a whole gets ``timeout_s`` per run).
        command: the command line to store with the result, for the record.
        lrs: peak lr per algorithm (e.g. :func:`tuned_lrs`), applied before a spec's own
            ``lr=``; None: every run at ``base.lr`` unless its spec says otherwise.
        runner: what trains the runs (default :func:`local_runner`; the testbed's is
            :func:`thinwire.testbed.experiments.on_cluster`).
        where: a description of where the runs trained, stored with the result.
    """
    reference = _check_specs(algos, workers, reference, overrides or {})
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else workers
    out_dir = Path(out_dir)
    keep = overwrite or base.resume
    configs = {
        label: _run_config(label, base, lrs, (overrides or {}).get(label, {}), out_dir, keep, world)
        for label in algos
    }
    for data in {cfg.data for cfg in configs.values()}:
        load_text(data)  # so does a bad data file (each corpus read once)
    done = _finished_runs(configs) if base.resume and not overwrite else {}
    for label, cfg in configs.items():
        if overwrite:
            _clear_run(Path(cfg.out_dir))
        elif base.resume and label not in done:
            _continue_or_clear(cfg)
    todo = [cfg for label, cfg in configs.items() if label not in done]
    runner = runner or local_runner
    if any(cfg.algo == "async-diloco" for cfg in todo):
        runner = _one_at_a_time_with_load(runner)
    summaries = iter(runner(todo, workers, timeout_s) if todo else [])
    runs = {
        label: _run_record(cfg, done[label] if label in done else next(summaries))
        for label, cfg in configs.items()
    }
    _keep_measured(runs, done, out_dir)
    _stages(runs)
    _ratios(runs, runs[reference])
    result = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "workers": workers,
        "where": dict(where) if where else {"kind": "local"},
        "reference": reference,
        "base": base.to_dict(),
        "runs": runs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "comparison.json", json.dumps(result, indent=2) + "\n")
    return result


def _check_specs(
    algos: list[str], workers: int, reference: str | None, overrides: dict[str, dict[str, Any]]
) -> str:
    """The comparison's arguments make sense together; returns the reference label."""
    if not algos:
        raise ConfigError("compare: give at least one algorithm")
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if len(set(algos)) != len(algos):
        raise ConfigError(f"compare: duplicate run specs in {algos}")
    reference = reference or algos[0]
    if reference not in algos:
        raise ConfigError(f"compare: reference {reference!r} is not one of the runs {algos}")
    unknown = set(overrides) - set(algos)
    if unknown:
        raise ConfigError(f"compare: overrides for runs that are not compared: {sorted(unknown)}")
    return reference


def _run_config(
    label: str,
    base: TrainConfig,
    lrs: Mapping[str, float] | None,
    overrides: dict[str, Any],
    out_dir: Path,
    overwrite: bool,
    world: int,
) -> TrainConfig:
    """The settings of run spec ``label``: ``base``, its tuned lr, the spec's own
    settings and ``overrides``, in ``out_dir``'s sub-directory for it (checked free),
    checked for ``world`` processes."""
    algo, spec = parse_run_spec(label)
    cfg = dataclasses.replace(base, algo=algo, resume=False, stop_after=None, progress=False)
    if lrs is not None and algo in lrs:
        cfg.lr = lrs[algo]
    for key, value in {**spec, **overrides}.items():
        if key not in _FIELDS or key in _FIXED:
            raise ConfigError(f"compare: {key!r} cannot be overridden per run")
        setattr(cfg, key, value)
    cfg.out_dir = str(_run_dir(out_dir, label))
    check_config(cfg, world)  # a bad setting fails before a run is cleared or started
    if not overwrite and existing_run(cfg.out_dir):
        raise ConfigError(
            f"compare: {cfg.out_dir} already holds a run; pass --resume to keep it (and "
            "continue it if it stopped), --overwrite to replace it, or another --out"
        )
    busy = runlock.holder(cfg.out_dir)
    if busy is not None:  # never clear a directory a live run is writing
        raise ConfigError(
            f"compare: {cfg.out_dir} is in use by a run in progress (pid {busy.get('pid')})"
        )
    return cfg


_PLUMBING = ("out_dir", "resume", "stop_after", "progress", "log_interval", "tensorboard", "record")
"""Config fields that do not change what a finished run trained (the testbed's runner,
for one, logs every step of the runs it trains)."""


def _finished_runs(configs: Mapping[str, TrainConfig]) -> dict[str, dict[str, Any]]:
    """The runs of ``configs`` that finished already (their ``summary.json``), checked to
    have trained with the same settings; a run with other settings is refused in one
    line, so a resumed comparison never mixes them."""
    done = {}
    for label, cfg in configs.items():
        run_dir = Path(cfg.out_dir)
        if not (run_dir / "summary.json").is_file():
            continue
        try:
            saved = drop_legacy_nulls(json.loads((run_dir / "config.json").read_text()))
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"compare --resume: cannot read the run in {run_dir}: {err}") from err
        wanted = json.loads(json.dumps(cfg.to_dict()))
        # A setting added since the run was written counts at its default.
        default = json.loads(json.dumps(TrainConfig().to_dict()))
        diffs = [
            f"{k} {saved.get(k, default[k])!r} (asked {wanted[k]!r})"
            for k in sorted(wanted)
            if k not in _PLUMBING and saved.get(k, default[k]) != wanted[k]
        ]
        if diffs:
            raise ConfigError(
                f"compare --resume: {run_dir} finished with other settings: "
                + ", ".join(diffs)
                + "; pass --overwrite to train it again"
            )
        done[label] = summary
    return done


def _keep_measured(runs: dict[str, dict[str, Any]], done: Mapping[str, Any], out_dir: Path) -> None:
    """A run read back keeps what the comparison measured around it the first time (the
    load average, a testbed's NIC counters), which its own files do not hold: from
    ``comparison.json``."""
    if not done:
        return
    try:
        before = json.loads((out_dir / "comparison.json").read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if not isinstance(before, dict):
        return
    for label in done:
        old = before.get(label)
        for key in _MEASURED_AROUND:
            if isinstance(old, dict) and key in old and key not in runs[label]:
                runs[label][key] = old[key]


_MEASURED_AROUND = (
    "load_avg_1min",
    "testbed",
    "nic_over_accounted",
    "accounted_tx_bytes_per_host",
)
"""What a runner measured around a run besides its own files (see :func:`_keep_measured`)."""


def _continue_or_clear(cfg: TrainConfig) -> None:
    """A run that stopped continues from its last checkpoint (the asynchronous server's
    included), or from its pretraining's last save; one that left neither starts over
    (its partial files cleared)."""
    from thinwire.train import pretrain_checkpoint
    from thinwire.train.checkpoint import latest_step

    out = Path(cfg.out_dir)
    saved = [latest_step(out), pretrain_checkpoint.latest(out)]
    if cfg.algo == "async-diloco":
        saved += [(out / name).is_file() or None for name in _ASYNC_SAVES]
    if any(s is not None for s in saved):
        cfg.resume = True
    else:
        _clear_run(Path(cfg.out_dir))


def _ratios(runs: dict[str, dict[str, Any]], ref: dict[str, Any]) -> None:
    """Each run's loss, bytes and speed as ratios to the reference run ``ref``, and how
    soon it reached the reference's final loss (the asynchronous methods' measure: the
    same loss in less time), by its own evaluations' clock."""
    target = ref["final_val_loss"]
    ref_reach = _time_to(ref["val_time"], target)
    for r in runs.values():
        reach = _time_to(r["val_time"], target)
        r["time_to_ref_loss_s"] = reach
        r["speedup_to_ref_loss"] = ref_reach / reach if reach and ref_reach else None
        r["loss_ratio"] = r["final_val_loss"] / ref["final_val_loss"]
        # None when this run sent nothing (one worker): no ratio to speak of
        r["bytes_reduction"] = ref["comm_bytes"] / r["comm_bytes"] if r["comm_bytes"] else None
        r["speedup"] = r["samples_per_s"] / ref["samples_per_s"]
        a, b = (x["stages"]["compression"].get("samples_per_s") for x in (r, ref))
        r["compression_speedup"] = a / b if a and b else None


def _one_at_a_time_with_load(runner: Runner) -> Runner:
    """``runner``, one config at a time, each summary with the machine's load average
    before and after its run (``load_avg_1min``): asynchronous methods are compared by
    wall-clock time, which on a busy host says as much about the host as the method."""

    def run(cfgs: list[TrainConfig], workers: int, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        for cfg in cfgs:
            load = os.getloadavg()[0]
            (summary,) = runner([cfg], workers, timeout_s)
            out.append(summary | {"load_avg_1min": [load, os.getloadavg()[0]]})
        return out

    return run


def _time_to(curve: list[list[float]], target: float) -> float | None:
    """Seconds of the first evaluation of ``curve`` (``[seconds, val_loss]``) at or below
    ``target``; None if it never got there."""
    return next((t for t, loss in curve if loss <= target), None)


def _run_record(cfg: TrainConfig, summary: dict[str, Any]) -> dict[str, Any]:
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    record = {
        "algo": cfg.algo,
        "config": cfg.to_dict(),
        "out_dir": cfg.out_dir,
        "freeze_step": summary.get("freeze_step"),
        "bounded_steps": summary.get("bounded_steps"),
        "final_val_loss": summary["final_val_loss"],
        "final_train_loss": final_train_loss(read_metrics(metrics)),
        "comm_bytes": summary["comm_bytes"],
        "samples": summary["samples"],
        "train_time_s": summary["train_time_s"],
        "samples_per_s": summary["samples_per_s"],
        "samples_per_step": summary["samples"] / max(1, summary["steps"]),
        **_curves(metrics),
    }
    for key in _MEASURED_AROUND:
        if key in summary:  # what a testbed runner measured besides, the load around it
            record[key] = summary[key]
    record["summary"] = summary  # everything the run reported (updates, pushes, ...)
    return record


def _stages(runs: dict[str, dict[str, Any]]) -> None:
    """Step times of the warmup and compression stages, for every run split at the first
    1-bit run's freeze step: LAMB and PowerSGD are timed over the same steps as the
    1-bit run's compression (with no 1-bit run, everything is one stage)."""
    split = next((r["freeze_step"] for r in runs.values() if r.get("freeze_step")), 0)
    for r in runs.values():
        records = read_metrics(Path(r["out_dir"]) / "metrics.jsonl")
        try:
            r["stages"] = stage_times(records, int(split), round(r["samples_per_step"]))
        except ConfigError:  # no step logged (e.g. --log-interval past --steps)
            r["stages"] = {"freeze_step": split, "warmup": {"steps": 0}, "compression": {}}


def _train_each(cfgs: list[TrainConfig]) -> list[dict[str, Any]]:
    """Train the runs one after another in this process (every rank of a group)."""
    from thinwire.train.trainer import train

    out = []
    for cfg in cfgs:
        # The byte counter is per process; each run's summary must count only its own.
        COUNTER.reset()
        out.append(train(cfg))
    return out


def _rank_main(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict[str, Any]]:
    return _train_each(cfgs)


def _clear_run(run_dir: Path) -> None:
    """Remove what a previous run left in ``run_dir``: only the trainer's own files
    (checkpoints, ``run.json``, ``config.json``, metrics, summary, an asynchronous
    server's state, a testbed run's record and host logs); anything else there stays."""
    if not run_dir.is_dir():
        return
    for name in _RUN_OUTPUTS:
        (run_dir / name).unlink(missing_ok=True)
    for name in ("checkpoints", "hosts"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


_ASYNC_SAVES = ("localsgd_server.pt", "localsgd_pretrain.pt")
"""The asynchronous server's checkpoint and its pretraining's save."""

_RUN_OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "run.json",
    "config.json",
    *_ASYNC_SAVES,
    "testbed_run.json",
    "record.jsonl",
)
