"""Run several algorithms on the same settings and compare them: loss vs samples, bytes.

Every run uses the same :class:`~thinwire.train.config.TrainConfig` (model, data, seed,
batch, steps), so the runs see the same batches in the same order and differ only in
what a run spec changes. A run spec is an algorithm name, optionally followed by
``@key=value,...`` overrides of config fields, e.g. ``lamb@lr=0.01`` or
``onebit-lamb@lr=0.01,freeze_step=30``; the spec is also the run's label and (made
path-safe) its sub-directory of ``out_dir``.

The result (``out_dir/comparison.json``) holds, per run, its full config, the validation
curve (``[samples, val_loss]``), the cumulative bytes curve (``[samples, comm_bytes]``,
bytes one worker put on the wire, see :mod:`thinwire.comm.accounting`), the summary, and
ratios against the reference run (the first one unless ``reference`` says otherwise):
``loss_ratio`` = final validation loss / the reference's, ``bytes_reduction`` = the
reference's bytes / this run's. The ratios are measured in the same invocation on the
same machine, which is what makes them comparable on a shared, noisy host.

As a script::

    python -m thinwire.train.compare --algos lamb onebit-lamb@freeze_step=20 \\
        --workers 4 --steps 100 --batch-size 32 --out runs/compare

takes every ``thinwire train`` option (``--lr``, ``--model``, ``--freeze-step``, ...) as
the shared base, prints a table and writes ``comparison.json`` and ``comparison.png``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

from thinwire import runlock
from thinwire.comm.accounting import COUNTER
from thinwire.comm.launch import launched_by_torchrun, spawn
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.plotting import pyplot, save_figure
from thinwire.rundir import existing_run
from thinwire.train.algorithms import check_algorithm
from thinwire.train.config import TrainConfig
from thinwire.train.data import load_text
from thinwire.train.metrics import read_metrics
from thinwire.train.run import run_training

__all__ = ["compare", "format_comparison", "parse_run_spec", "plot_comparison"]

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# What a run spec may change; identity of the data (corpus, split) and the run's
# plumbing (output, resume) stay shared so the comparison remains like for like.
_FIXED = {"data", "val_fraction", "out_dir", "resume", "extra", "stop_after"}


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
    """``"lamb@lr=0.01,freeze_step=20"`` -> ``("lamb", {"lr": 0.01, "freeze_step": 20})``.

    Keys are :class:`TrainConfig` field names (dashes allowed); ``betas`` is written
    ``0.9/0.999``. Unknown algorithms and keys raise :class:`ConfigError`.
    """
    algo, _, rest = spec.partition("@")
    check_algorithm(algo)
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _FIELDS or key in _FIXED or key == "algo":
            raise ConfigError(
                f"run spec {spec!r}: {item!r} is not KEY=VALUE for a config field "
                "(e.g. lr=0.01, freeze_step=20, warmup_steps=10)"
            )
        overrides[key] = _convert(key, value.strip())
    return algo, overrides


def _run_dir(out_dir: Path, label: str) -> Path:
    return out_dir / re.sub(r"[^A-Za-z0-9._=-]+", "_", label)


def _curves(metrics_path: Path) -> tuple[list[list[float]], list[list[float]]]:
    """(validation ``[samples, val_loss]``, cumulative ``[samples, comm_bytes]``)."""
    val, comm = [], []
    for r in read_metrics(metrics_path):
        if "val_loss" in r:
            val.append([r["samples"], r["val_loss"]])
        if "comm_bytes" in r:
            comm.append([r["samples"], r["comm_bytes"]])
    return val, comm


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
) -> dict[str, Any]:
    """Train every run spec in ``algos`` on ``base``'s settings; write and return the result.

    Args:
        algos: run specs (``ALGO`` or ``ALGO@key=value,...``); each is also a label.
        base: the shared settings; its ``algo`` and ``out_dir`` are ignored.
        workers: worker processes per run (ignored under ``torchrun``, as in training).
        out_dir: each run goes to a sub-directory; ``comparison.json`` to ``out_dir``.
        overrides: extra config overrides per label, applied after the spec's own.
        reference: the label the ratios are taken against (default: the first).
        overwrite: replace the runs already in ``out_dir`` instead of refusing.
        timeout_s: seconds before a stuck run is stopped (the runs share one set of
            workers, so the comparison as a whole gets ``timeout_s`` per run).
        command: the command line to store with the result, for the record.
    """
    if not algos:
        raise ConfigError("compare: give at least one algorithm")
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if len(set(algos)) != len(algos):
        raise ConfigError(f"compare: duplicate run specs in {algos}")
    reference = reference or algos[0]
    if reference not in algos:
        raise ConfigError(f"compare: reference {reference!r} is not one of the runs {algos}")
    overrides = overrides or {}
    unknown = set(overrides) - set(algos)
    if unknown:
        raise ConfigError(f"compare: overrides for runs that are not compared: {sorted(unknown)}")
    out_dir = Path(out_dir)
    configs: dict[str, TrainConfig] = {}
    for label in algos:
        algo, spec = parse_run_spec(label)
        cfg = dataclasses.replace(base, algo=algo, resume=False, stop_after=None, progress=False)
        for key, value in {**spec, **overrides.get(label, {})}.items():
            if key not in _FIELDS or key in _FIXED:
                raise ConfigError(f"compare: {key!r} cannot be overridden per run")
            setattr(cfg, key, value)
        cfg.out_dir = str(_run_dir(out_dir, label))
        cfg.validate()
        if not overwrite and existing_run(cfg.out_dir):
            raise ConfigError(
                f"compare: {cfg.out_dir} already holds a run; pass --overwrite or another --out"
            )
        busy = runlock.holder(cfg.out_dir)
        if busy is not None:  # never clear a directory a live run is writing
            raise ConfigError(
                f"compare: {cfg.out_dir} is in use by a run in progress (pid {busy.get('pid')})"
            )
        configs[label] = cfg

    for cfg in configs.values():
        if overwrite:
            _clear_run(Path(cfg.out_dir))
    summaries = _train_all(list(configs.values()), workers, timeout_s)
    runs: dict[str, dict[str, Any]] = {}
    for (label, cfg), summary in zip(configs.items(), summaries, strict=True):
        val, comm = _curves(Path(cfg.out_dir) / "metrics.jsonl")
        runs[label] = {
            "algo": cfg.algo,
            "config": cfg.to_dict(),
            "freeze_step": summary.get("freeze_step"),
            "final_val_loss": summary["final_val_loss"],
            "comm_bytes": summary["comm_bytes"],
            "samples": summary["samples"],
            "train_time_s": summary["train_time_s"],
            "samples_per_s": summary["samples_per_s"],
            "val": val,
            "comm": comm,
        }
    ref = runs[reference]
    for r in runs.values():
        r["loss_ratio"] = r["final_val_loss"] / ref["final_val_loss"]
        # None when this run sent nothing (one worker): no ratio to speak of
        r["bytes_reduction"] = ref["comm_bytes"] / r["comm_bytes"] if r["comm_bytes"] else None
    result = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "workers": workers,
        "reference": reference,
        "base": base.to_dict(),
        "runs": runs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "comparison.json", json.dumps(result, indent=2) + "\n")
    return result


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


def _train_all(cfgs: list[TrainConfig], workers: int, timeout_s: float) -> list[dict[str, Any]]:
    """All runs on one set of workers: under torchrun, in this process, or spawned once.

    Spawning once for the whole comparison (instead of once per run) saves the start-up
    of W Python processes per run, which on a busy machine costs more than a short run.
    """
    if launched_by_torchrun() or workers == 1:
        out = []
        for cfg in cfgs:
            COUNTER.reset()
            out.append(run_training(cfg, workers, timeout_s))
        return out
    for cfg in cfgs:
        load_text(cfg.data)  # a bad data file fails here, before any process starts
    backend = "nccl" if cfgs[0].device == "cuda" else "gloo"
    return spawn(_rank_main, workers, (cfgs,), backend=backend, timeout_s=timeout_s * len(cfgs))[0]


def _clear_run(run_dir: Path) -> None:
    """Remove what a previous run left in ``run_dir``: only the trainer's own files
    (checkpoints, ``run.json``, metrics, summary, an asynchronous server's state);
    anything else there stays."""
    import shutil

    if not run_dir.is_dir():
        return
    for name in ("metrics.jsonl", "summary.json", "run.json", "localsgd_server.pt"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def format_comparison(result: dict[str, Any]) -> str:
    """One line per run: final validation loss, bytes per worker, ratios to the reference."""
    rows = [("run", "final val loss", "loss / ref", "MiB per worker", "bytes reduction")]
    for label, r in result["runs"].items():
        rows.append(
            (
                label + (" (ref)" if label == result["reference"] else ""),
                f"{r['final_val_loss']:.4f}",
                f"{r['loss_ratio']:.4f}",
                f"{r['comm_bytes'] / 2**20:,.2f}",
                "-" if r["bytes_reduction"] is None else f"{r['bytes_reduction']:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        cells[0] = row[0].ljust(widths[0])  # labels left, numbers right
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot_comparison(result: dict[str, Any], path: str | Path) -> Path | None:
    """Validation loss vs samples (left) and cumulative MiB per worker vs samples (right).

    Returns the path, or None when matplotlib is not installed (``pip install
    'thinwire[plot]'``).
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in result["runs"].items():
        style = "--" if "onebit" in r["algo"] else "-"
        if r["val"]:
            xs, ys = zip(*r["val"], strict=True)
            (line,) = ax_loss.plot(xs, ys, style, marker=".", label=label)
        else:
            (line,) = ax_loss.plot([], [], style, label=label)
        if r["comm"]:
            xs, bs = zip(*r["comm"], strict=True)
            ax_bytes.plot(xs, [b / 2**20 for b in bs], style, color=line.get_color(), label=label)
        if r.get("freeze_step"):
            samples = r["freeze_step"] * r["config"]["batch_size"] * result["workers"]
            ax_bytes.axvline(samples, color=line.get_color(), lw=0.6, ls=":")
    ax_loss.set_xlabel("training samples (sequences)")
    ax_loss.set_ylabel("validation loss (nats/byte)")
    ax_loss.set_title("validation loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    # Zoom on the part of the curves where the methods differ: the first evaluation
    # (untrained model) would flatten everything else.
    finals = [y for r in result["runs"].values() for _, y in r["val"][1:]]
    if finals:
        lo, hi = min(finals), max(finals)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax_bytes.set_xlabel("training samples (sequences)")
    ax_bytes.set_ylabel("MiB sent per worker (cumulative)")
    ax_bytes.set_title("communication volume (dotted: freeze step)")
    ax_bytes.grid(alpha=0.3)
    w = result["workers"]
    fig.suptitle(f"{w} workers, {result['base']['model']} model, {result['date']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


if __name__ == "__main__":
    # ``python -m thinwire.train.compare`` keeps working; the flags live in the CLI.
    from thinwire.cli.compare import main

    sys.exit(main())
