"""``thinwire simulate``: heterogeneous asynchronous Local-SGD workers on a virtual clock.

Runs the paper's methods (sync DiLoCo, naive async, Poly, PolyThres, the async buffer,
Delayed Nesterov, DN+DyLU) on the same inner-step budget and seeds, each at its tuned
outer lr and momentum unless told otherwise, and prints each method's final validation
loss (mean and sd over the seeds, ratio to sync) and the simulated time to reach sync's
final loss. ``--sweep`` tunes: every method runs every setting of its grid on every seed,
and the best setting per method is reported with the whole grid::

    thinwire simulate --methods sync,naive,dn,dn-dylu --seeds 0,1,2 \\
        --sweep outer-lr=0.1,0.2,0.3,0.5 --sweep naive:outer-lr=0.01,0.02,0.05,0.1

Every method uses the same inner-state rule (``--inner-state``; unset, Streaming DiLoCo
takes ``keep``), shards and H. ``sync`` runs as Streaming DiLoCo with ``--fragments``,
``--fragment-overlap``, ``--fragment-alpha`` or a quantizer (``--compress int8|fp8|int4``;
``--compress onebit`` too, with fragments, an overlap or alpha); ``--no-error-feedback``
drops what those codes round away, and what sync's whole 1-bit pushes do (not the
pulls': ``--compress-pull onebit`` always carries its rounding)::

    thinwire simulate --methods sync --sweep sync:fragments=1,2,4 --compress int4

(the asynchronous methods have no fragments: give them with ``--sweep sync:...`` when
they run beside sync). Writes ``results.json`` (the grid, the best per method, every
run's curve), ``table.md`` and two
plots of the best settings to ``--out``; each run is also kept in ``--out/runs/``, and a
rerun reads those back instead of computing them again (an interrupted sweep resumes),
and a run stopped half way goes on from its last save (``--checkpoint-every``, every 10
minutes by default; the result is the same as unstopped).

The simulator takes the same pieces as a real run: thinwire's GPT and text shards as a
:class:`thinwire.localsgd.Task` (built by :func:`thinwire.train.async_task.gpt_task`),
one :class:`thinwire.localsgd.AsyncConfig` per method and a
:class:`thinwire.localsgd.SimClock`. ``thinwire compare --async`` runs the same methods
for real. ``thinwire simulate async ...``, the old spelling, still works.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from thinwire.cli.parser import add_moved
from thinwire.cli.train import add_streaming_arguments
from thinwire.compress.quantize import QUANT_KINDS
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.localsgd import METHODS, AsyncConfig, SimClock, for_method
from thinwire.localsgd.algorithm.compression import CODECS
from thinwire.localsgd.algorithm.inner_state import INNER_MOMENTUM
from thinwire.localsgd.algorithm.shards import SAMPLING_CHOICES
from thinwire.localsgd.algorithm.sim_checkpoint import SimCheckpoint
from thinwire.localsgd.algorithm.sweep import parse_grid, run_sweep, settings_of, summarize_sweep
from thinwire.localsgd.algorithm.virtual_clock import HETEROGENEITY
from thinwire.rundir import writable_dir
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import SHARD_LAYOUTS, TextData
from thinwire.train.metrics import Progress

__all__ = ["add_simulate_arguments", "format_tables", "register", "run_async"]

DEFAULT_METHODS = ("sync", "naive", "dn", "dn-dylu")


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
        ("--grace", args.grace, args.grace >= 0, ">= 0"),
        ("--warmup-steps", args.warmup_steps, args.warmup_steps >= 0, ">= 0"),
    ]
    # None: each method's tuned value (thinwire.localsgd.TUNED).
    if args.outer_lr is not None:
        checks.append(("--outer-lr", args.outer_lr, args.outer_lr > 0, "> 0"))
    if args.outer_momentum is not None:
        mom = args.outer_momentum
        checks.append(("--outer-momentum", mom, 0 <= mom < 1, "in [0, 1)"))
    for name, value, ok, rule in checks:
        if not (ok and math.isfinite(value)):
            raise ConfigError(f"{name} must be a number {rule}, got {value}")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``thinwire simulate``, and under it ``async``, its hidden old spelling."""
    doc = dict(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser = subparsers.add_parser(
        "simulate",
        help="asynchronous Local-SGD methods on a virtual clock",
        **doc,
    )
    add_simulate_arguments(parser)
    # Hidden: help=SUPPRESS keeps the old verb out of the usage line as well. The options
    # come again under it, because argparse hands everything after "async" to its parser.
    old = parser.add_subparsers(dest="simulate_command", required=False, help=argparse.SUPPRESS)
    add_simulate_arguments(add_moved(old, "async", "thinwire simulate", **doc))


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``thinwire simulate``; ``func`` is :func:`run_async`."""
    d, t = AsyncConfig(), TrainConfig()
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"of {METHODS}")
    p.add_argument(
        "--heterogeneity",
        default="very",
        choices=tuple(HETEROGENEITY),
        help="worker speed preset (default very: the paper's notebook's 0.58/0.75/1.51/3.33)",
    )
    p.add_argument("--seconds-per-step", default=None, help="explicit speeds, one per worker")
    p.add_argument("--jitter", type=float, default=0.0, help="relative per-round time noise")
    p.add_argument("--calibrate", action="store_true", help="DyLU measures speeds (no declare)")
    p.add_argument(
        "--local-steps", type=int, default=d.local_steps, help=f"H (default {d.local_steps})"
    )
    p.add_argument("--steps", type=int, default=500, help="inner steps per worker (budget)")
    p.add_argument("--outer-lr", type=float, default=None, help="default: each method's tuned")
    p.add_argument("--outer-momentum", type=float, default=None, help="default: tuned")
    p.add_argument(
        "--outer-momentum-warmup",
        type=int,
        default=0,
        metavar="ARRIVALS",
        help="ramp the outer momentum up from 0 over this many arrivals (default 0)",
    )
    p.add_argument("--c", type=float, default=d.c, help="Delayed Nesterov's c in [0, 1/W]")
    p.add_argument("--grace", type=float, default=d.grace_s, help="grace period, virtual s")
    p.add_argument(
        "--inner-state",
        "--inner-momentum",
        dest="inner_state",
        default=None,
        metavar="{" + ",".join(INNER_MOMENTUM) + "}",
        help="inner-state rule of every method (default: keep with --pretrain-steps or "
        "--init-from, restart from scratch)",
    )
    p.add_argument("--min-local-steps", type=int, default=d.min_local_steps)
    p.add_argument("--calibration-steps", type=int, default=d.calibration_steps)
    p.add_argument("--shards", type=int, default=None, help="data shards (default: W)")
    p.add_argument("--shard-sampling", default=d.shard_sampling, choices=SAMPLING_CHOICES)
    p.add_argument("--shard-layout", default=t.shard_layout, choices=SHARD_LAYOUTS)
    p.add_argument(
        "--compress",
        default="none",
        choices=(*CODECS, *QUANT_KINDS),
        help="push codec; the quantizers (sync as Streaming DiLoCo) are sync's alone; "
        "onebit with --fragments is Streaming DiLoCo's 1-bit exchange",
    )
    add_streaming_arguments(p, d, "sync")
    p.add_argument("--compress-pull", default="none", choices=tuple(CODECS), help="pull codec")
    p.add_argument("--model", default=t.model, help="model preset (default tiny)")
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--lr", type=float, default=t.lr, help="peak inner AdamW lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="per shard")
    p.add_argument("--data", default=None, help="text file or bundled corpus name")
    p.add_argument(
        "--pretrain-steps",
        type=int,
        default=d.pretrain_steps,
        help="ordinary data-parallel steps before Local-SGD (once per seed, kept in --out)",
    )
    p.add_argument("--init-from", default=None, help="start from this model state file")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="append", default=[], metavar="[METHOD:]KEY=V1,V2")
    p.add_argument("--target", type=float, default=None, help="also report time to this loss")
    p.add_argument("--eval-points", type=int, default=20, help="validation passes per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", default="runs/simulate", help="output directory")
    p.add_argument(
        "--checkpoint-every",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="save a run in progress this often (wall seconds) to --out/runs, so a "
        "stopped run goes on from there when started again (default 600; 0: write no "
        "saves, though one left earlier is still resumed from)",
    )
    p.set_defaults(func=run_async)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ConfigError(f"{name} needs at least one value")
    return values


def _setting(s: dict[str, Any]) -> str:
    return " ".join(f"{k.replace('_', '-')}={v}" for k, v in sorted(s.items())) or "defaults"


def _defaults(base: AsyncConfig, methods: list[str]) -> str:
    """What "defaults" means for each method's outer lr and momentum in this run (they
    follow the start: see ``thinwire.localsgd.TUNED_TRAINED``)."""
    each = []
    for m in methods:
        cfg = for_method(base, m)
        each.append(f"{m} {cfg.resolved_outer_lr():g}/{cfg.resolved_outer_momentum():g}")
    return "outer lr/momentum where not swept: " + ", ".join(each)


def _times(xs: list[float | None]) -> str:
    got = [x for x in xs if x]
    if not got:
        return "never"
    mean = sum(got) / len(got)
    return f"{mean:.0f} s" + (f" ({len(got)}/{len(xs)} seeds)" if len(got) < len(xs) else "")


def format_tables(summary: dict[str, Any]) -> str:
    """The best setting per method, then the whole grid, as markdown tables."""
    lines = [
        "| method | best setting | final val loss (mean ± sd) | vs sync | time to sync's "
        "final loss | speed-up | runner-up (gap) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, b in summary["best"].items():
        ratio = b.get("loss_vs_sync")
        ups = [x for x in b.get("speedup_to_sync_loss", []) if x]
        ru = b["runner_up"]
        runner = (
            f"{_setting(ru['setting'])} (+{ru['final_mean'] - b['final_mean']:.4f})" if ru else "-"
        )
        lines.append(
            f"| {m} | {_setting(b['setting'])} | {b['final_mean']:.4f} ± {b['final_sd']:.4f} | "
            f"{f'{ratio:.4f}' if ratio else '-'} | {_times(b.get('time_to_sync_loss_s', []))} | "
            f"{f'{sum(ups) / len(ups):.2f}x' if ups else '-'} | {runner} |"
        )
    lines += ["", "| method | setting | final val loss (mean ± sd) | seeds |", "|---|---|---|---|"]
    for g in summary["grid"]:
        seeds = ",".join(str(s) for s in g["seeds"])
        lines.append(
            f"| {g['method']} | {_setting(g['setting'])} | "
            f"{g['final_mean']:.4f} ± {g['final_sd']:.4f} | {seeds} |"
        )
    return "\n".join(lines) + "\n"


def _plot(runs: list[dict[str, Any]], out: Path) -> list[str]:
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
        for r in runs:
            xs = [p[key] for p in r["curve"]]
            ys = [p["val_loss"] for p in r["curve"]]
            ax.plot(xs, ys, marker=".", label=f"{r['method']} (seed {r['seed']})")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        losses = [p["val_loss"] for r in runs for p in r["curve"]]
        # A diverged method must not squash the others.
        ax.set_ylim(bottom=min(losses) - 0.1, top=min(max(losses), 4.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(str(out / name))
    return paths


def run_async(args: argparse.Namespace) -> int:
    methods = _methods(args)
    speeds = (
        _floats(args.seconds_per_step, "--seconds-per-step")
        if args.seconds_per_step
        else HETEROGENEITY[args.heterogeneity]
    )
    seeds = _ints(args.seeds, "--seeds") if args.seeds else (args.seed,)
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if not (args.checkpoint_every >= 0 and math.isfinite(args.checkpoint_every)):
        raise ConfigError(f"--checkpoint-every must be >= 0 seconds, got {args.checkpoint_every}")
    _check_numbers(args)
    writable_dir(args.out)  # before minutes of simulation, not after
    if not 0.0 <= args.c <= 1.0 / len(speeds):
        raise ConfigError(f"--c must be in [0, 1/W] = [0, {1 / len(speeds):.4g}], got {args.c}")
    torch.set_num_threads(args.threads)
    model, base, clock = _configs(args, speeds)
    grid = _one_rule_for_sync(base, parse_grid(args.sweep, methods))

    def task_for_seed(seed: int) -> Any:
        cfg = TrainConfig(**{**model.to_dict(), "seed": seed})
        return gpt_task(cfg, TextData(args.data, cfg.gpt_config().seq_len, cfg.val_fraction, seed))

    out = Path(args.out)
    current: list[_InProgress] = [_InProgress("run")]
    args.on_interrupt = functools.partial(_what_is_kept, out, current)
    context = model.to_dict()  # the task: model, data, batch size, inner lr, ...
    pretraining = functools.partial(_pretraining, out, current)
    runs = run_sweep(
        task_for_seed,
        base,
        clock,
        grid,
        seeds,
        out,
        _report,
        context,
        on_pretrain=pretraining,
        checkpoint_every=args.checkpoint_every or math.inf,
        on_start=functools.partial(_starting, current),
    )
    _write_results(args, runs, speeds, seeds, model, base)
    return 0


def _one_rule_for_sync(
    base: AsyncConfig, grid: dict[str, dict[str, tuple]]
) -> dict[str, dict[str, tuple]]:
    """Sync runs with and without Streaming DiLoCo in one sweep (``--sweep
    sync:fragments=1,2``) would differ in their inner-state rule too where it is left
    unset (Streaming DiLoCo's is ``keep``, from scratch the others' is ``restart``): they
    all take ``keep`` then, and the user is told."""
    own = grid.get("sync")
    if own is None or base.inner_momentum is not None or "inner_momentum" in own:
        return grid
    sync = for_method(base, "sync")
    rules = {replace(sync, **setting).resolved_inner_momentum() for setting in settings_of(own)}
    if len(rules) == 1:
        return grid
    print(
        "thinwire: sync runs with and without Streaming DiLoCo all take the inner-state "
        "rule keep (Streaming DiLoCo's), so that only the swept settings differ; "
        "--inner-state chooses another",
        flush=True,
    )
    return grid | {"sync": own | {"inner_momentum": ("keep",)}}


def _methods(args: argparse.Namespace) -> list[str]:
    """``--methods`` as a list of known method names."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError(
            f"--methods needs at least one of {', '.join(METHODS)}, got {args.methods!r}"
        )
    for m in methods:
        if m not in METHODS:
            raise ConfigError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    return methods


def _configs(
    args: argparse.Namespace, speeds: tuple[float, ...]
) -> tuple[TrainConfig, AsyncConfig, SimClock]:
    """The task's settings, the methods' shared async settings and the virtual clock."""
    model = TrainConfig(
        model=args.model,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        data=args.data,
        shard_layout=args.shard_layout,
    )
    model.validate()
    base = AsyncConfig(
        steps=args.steps,
        local_steps=args.local_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_momentum_warmup=args.outer_momentum_warmup,
        c=args.c,
        grace_s=args.grace,
        inner_momentum=args.inner_state,
        min_local_steps=args.min_local_steps,
        calibration_steps=args.calibration_steps,
        shards=args.shards,
        shard_sampling=args.shard_sampling,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=model.min_lr_ratio,
        compress=args.compress,
        compress_pull=args.compress_pull,
        fragments=args.fragments,
        fragment_overlap=args.fragment_overlap,
        fragment_alpha=args.fragment_alpha,
        error_feedback=args.error_feedback,
        pretrain_steps=args.pretrain_steps,
        init_from=args.init_from,
    )
    clock = SimClock(
        seconds_per_step=speeds,
        jitter=args.jitter,
        eval_points=args.eval_points,
        declare_speeds=not args.calibrate,
    )
    clock.validate()
    return model, base, clock


def _report(run: dict[str, Any], cached: bool) -> None:
    """One line per finished (or read back) run, and one more for a run that ended above
    where it started (it trained nothing: a table of final losses alone would not say)."""
    name = f"{run['method']} {_setting(run['setting'])} seed {run['seed']}"
    print(
        f"{run['method']:9s} {_setting(run['setting']):32s} seed {run['seed']}  final val "
        f"loss {run['final_val_loss']:.4f}  updates {run['updates']:5d}  simulated "
        f"{run['sim_time_s']:8.1f} s" + ("  (read back)" if cached else ""),
        flush=True,
    )
    start, final = run["curve"][0]["val_loss"], run["final_val_loss"]
    if final > start:
        print(
            f"thinwire: warning: {name} ended above its start ({final:.4f} > {start:.4f}): "
            "its outer steps are too large for this run; lower its outer lr or momentum",
            file=sys.stderr,
            flush=True,
        )


@dataclass
class _InProgress:
    """What the sweep is computing now, and the file it saves to (None: it saves none)."""

    what: str
    path: Path | None = None

    def saved(self) -> Path | None:
        """The save a rerun goes on from, if one was written yet."""
        return self.path if self.path is not None and self.path.exists() else None


def _what_is_kept(out: Path, current: list[_InProgress]) -> str:
    """What a Ctrl-C leaves: finished runs, and the last save of what was in progress."""
    now, saved = current[0], current[0].saved()
    if saved is not None:
        then = f"the {now.what} in progress goes on from its save in {saved}"
    else:
        then = f"the {now.what} in progress had no save yet and starts again"
    return f"finished runs are kept in {out / 'runs'}; {then}: run the same command again"


def _starting(
    current: list[_InProgress],
    method: str,
    setting: dict[str, Any],
    seed: int,
    checkpoint: SimCheckpoint | None,
) -> Callable[[int, int], None]:
    """The progress of one run (``current[0]`` is it from now on)."""
    path = checkpoint.path if checkpoint is not None else None
    current[0] = _InProgress("run", path)
    return _RunProgress(f"{method} {_setting(setting)} seed {seed}", str(path))


class _RunProgress:
    """Says where a run resumes, then shows its steps: a bar on a terminal, and a line
    at every tenth of the run in a log (a run of hours would say nothing else)."""

    def __init__(self, name: str, where: str, unit: str = "inner steps") -> None:
        self.name, self.where, self.unit = name, where, unit
        self.bar: Progress | None = None
        self.shown = 0  # steps shown so far
        self.logged = sys.stdout.isatty() or sys.stderr.isatty()  # a bar instead
        self.started = time.monotonic()

    def __call__(self, done: int, total: int, loss: float | None = None) -> None:
        if self.bar is None:  # the start: steps done before it come from a save
            if done > 0:
                print(
                    f"{self.name}: resumed from {self.where} at {done:,} of {total:,} {self.unit}",
                    flush=True,
                )
            self.bar = Progress(total, done, True, self.name)
        else:
            shown = {"loss": f"{loss:.3f}"} if loss is not None else {}
            self.bar.update(done - self.shown, **shown)
            if not self.logged and done * 10 // total > self.shown * 10 // total:
                minutes = (time.monotonic() - self.started) / 60
                print(
                    f"{self.name}: {done:,} of {total:,} {self.unit} ({100 * done // total}%) "
                    f"in {minutes:.0f} min",
                    flush=True,
                )
        self.shown = done
        if done >= total:
            self.bar.close()


def _pretraining(
    out: Path, current: list[_InProgress], seed: int, start: Any, ckpt: SimCheckpoint | None
) -> Callable[[int, float], None]:
    """Say where seed ``seed`` starts; the returned callback shows its pretraining."""
    runs = out / "runs"
    print(f"seed {seed}: starts {start.describe()} (computed once, kept in {runs})", flush=True)
    path = ckpt.path if ckpt is not None else None
    current[0] = _InProgress(f"pretraining of seed {seed}", path)
    shown = _RunProgress(f"pretraining seed {seed}", str(path), "steps")

    def step(done: int, loss: float) -> None:
        if shown.bar is None:  # called after the first step: the one before is the start
            shown(done - 1, start.pretrain_steps)
        shown(done, start.pretrain_steps, loss)

    return step


def _write_results(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    speeds: tuple[float, ...],
    seeds: tuple[int, ...],
    model: TrainConfig,
    base: AsyncConfig,
) -> None:
    """``results.json``, ``table.md`` and the plots in ``--out``; the tables on stdout."""
    out = Path(args.out)
    summary = summarize_sweep(runs, args.target)
    unigram = TextData(args.data, model.gpt_config().seq_len, model.val_fraction).unigram_loss()
    command = "thinwire " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    blob = {
        "command": command,
        "seconds_per_step": list(speeds),
        "seeds": list(seeds),
        "byte_frequency_loss": unigram,
        "summary": summary,
        "runs": runs,
    }
    atomic_write_text(out / "results.json", json.dumps(blob, indent=1) + "\n")
    tables = format_tables(summary)
    rule = base.resolved_inner_momentum()
    others = sorted(
        {f"{r['method']}: {r['config']['inner_momentum']}" for r in runs}
        - {f"{r['method']}: {rule}" for r in runs}
    )
    if others:  # Streaming DiLoCo's keep, where the rule was left unset
        rule += f" ({', '.join(others)}: Streaming DiLoCo's rule acts per fragment)"
    start = (
        f"every method starts {base.start().describe()}, "
        f"inner-state rule {rule}; {_defaults(base, list(summary['best']))}"
    )
    atomic_write_text(
        out / "table.md", f"`{command}`\n\n{start[0].upper()}{start[1:]}.\n\n" + tables
    )
    print(f"\n{start}; byte-frequency loss of the data: {unigram:.4f}\n")
    print(tables)
    best = {b for m in summary["best"].values() for b in m["runs"]}
    plots = _plot([r for r in runs if r["key"] in best], out)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}" + "".join(f", {p}" for p in plots))
