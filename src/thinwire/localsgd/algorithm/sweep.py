"""Tune every method on one budget and the same seeds: a grid of simulated runs.

:func:`run_sweep` runs, for each method of the comparison, every setting of its grid on
every seed through the simulator (:func:`~thinwire.localsgd.algorithm.virtual_clock.simulate`), and
:func:`summarize_sweep` picks each method's best setting by mean final loss over the
seeds. Grids are per method, because methods live at different scales of outer lr
(per-arrival Nesterov needs about 1/W of what a once-per-W-arrivals step takes)::

    grid = parse_grid(["outer-lr=0.1,0.3,0.5", "naive:outer-lr=0.01,0.03,0.1"], methods)

A key is any :class:`~thinwire.localsgd.config.AsyncConfig` field, dashes for
underscores (``outer-lr``, ``outer-momentum``, ``inner-momentum`` or its alias
``inner-state``, ``c``, ``min-local-steps``, ``local-steps``, ...). A key given without a
method applies to every method that has no grid of its own for that key.

Each run is written to ``<out>/runs/<method>__<setting>__seed<S>.json`` as it ends, with a
fingerprint of everything that decides its result (the whole config, the clock, the seed,
and what the caller says about the task: model, data, ...). A run whose file exists with
the same fingerprint is read back instead of computed, so an interrupted sweep resumes
where it stopped; a file from other settings (other data, speeds, H, defaults) is
recomputed and replaced, never passed off as this sweep's. A run stopped half way goes
on from its last checkpoint (``<key>.partial.pt``, saved every 10 minutes by default;
:mod:`~thinwire.localsgd.algorithm.sim_checkpoint`) with the same result, so even a
sweep of hours-long runs loses at most minutes to a stop. The file goes once the run's
JSON is written; one of a setting taken out of the grid stays (delete
``runs/*.partial.pt`` by hand). A seed's pretraining is kept the same way while it runs
(``pretrained-seed<S>-<digest>.partial.pt``), and whole once done. Each run and each
pretraining starts with torch's, Python's and NumPy's generators seeded from its seed,
so a run read back, resumed or computed in one go holds the same numbers, whatever ran
before it in the process.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.io import atomic_save, atomic_write_text
from thinwire.localsgd.algorithm.methods import METHODS, TUNED_TRAINED, for_method
from thinwire.localsgd.algorithm.pretrain import ProgressFn, Start, load_start_state
from thinwire.localsgd.algorithm.sim_checkpoint import SimCheckpoint, seed_generators
from thinwire.localsgd.algorithm.virtual_clock import SimClock, simulate, time_to_reach
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.settings import STREAMING
from thinwire.localsgd.task import Task

__all__ = [
    "fingerprint",
    "parse_grid",
    "run_key",
    "run_sweep",
    "settings_of",
    "summarize_sweep",
]

RunProgress = Callable[[int, int], None]
"""Called with ``(done, total)`` inner steps of one simulated run."""

_ALIASES = {"inner_state": "inner_momentum", "grace": "grace_s"}


def _field_types() -> dict[str, str]:
    return {f.name: str(f.type) for f in fields(AsyncConfig)}


def _convert(name: str, typ: str, text: str) -> Any:
    text = text.strip()
    if text.lower() == "none" and "None" in typ:
        return None
    try:
        if typ.startswith("float"):
            return float(text)
        if typ.startswith("int"):
            return int(text)
        if typ.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if typ.startswith("str"):
            return text
    except ValueError:
        raise ConfigError(f"--sweep {name}: {text!r} is not a valid {typ}") from None
    raise ConfigError(f"--sweep cannot vary {name} (of type {typ})")


def parse_grid(specs: Sequence[str], methods: Sequence[str]) -> dict[str, dict[str, tuple]]:
    """``[METHOD:]KEY=V1,V2,...`` strings as each method's ``{field: values}`` grid."""
    types = _field_types()
    shared: dict[str, tuple] = {}
    own: dict[str, dict[str, tuple]] = {m: {} for m in methods}
    for spec in specs:
        head, eq, values = spec.partition("=")
        if not eq or not values.strip():
            raise ConfigError(f"--sweep wants [METHOD:]KEY=V1,V2,..., got {spec!r}")
        method, colon, key = head.rpartition(":")
        name = key.strip().replace("-", "_")
        name = _ALIASES.get(name, name)
        if name not in types:
            raise ConfigError(f"--sweep: {key!r} is not a setting of AsyncConfig")
        if name in ("sync", "dylu", "outer", "staleness", "max_staleness", "slowdown"):
            raise ConfigError(f"--sweep: {key!r} is set by the method; sweep methods instead")
        parsed = tuple(_convert(key, types[name], v) for v in values.split(",") if v.strip())
        if colon:
            if method not in methods:
                raise ConfigError(f"--sweep {spec!r}: {method!r} is not one of the methods run")
            own[method][name] = parsed
        else:
            shared[name] = parsed
    return {m: shared | own[m] for m in methods}


def settings_of(grid: dict[str, tuple]) -> list[dict[str, Any]]:
    """Every combination of a method's grid (one empty setting for an empty grid)."""
    names = sorted(grid)
    combos = itertools.product(*(grid[n] for n in names))
    return [dict(zip(names, combo, strict=True)) for combo in combos]


def run_key(method: str, setting: dict[str, Any], seed: int) -> str:
    """The file name stem of one run (stable across invocations)."""
    parts = [f"{k.replace('_', '-')}={setting[k]}" for k in sorted(setting)]
    return f"{method}__{'_'.join(parts) or 'default'}__seed{seed}"


RUNTIME_ONLY = ("shard_within",)
"""Fields of :class:`AsyncConfig` that only the multi-process runtime reads (the simulator
has no ranks to shard over), left out of :func:`fingerprint`."""

ADDED_LATER = (*STREAMING, "norm_batches")
"""Fields added after runs were cached: at their defaults :func:`fingerprint` leaves them
out, so the runs cached before them stay valid."""


def fingerprint(
    cfg: AsyncConfig, clock: SimClock, seed: int, context: Mapping[str, Any] | None = None
) -> str:
    """A digest of everything that decides a simulated run's result: ``cfg`` and ``clock``
    (with their seeds) and ``context``, the caller's description of the task."""
    rule = cfg.inner_momentum
    outer = {}
    if cfg.starts_trained():
        # From a trained model the defaults that changed are named: runs cached while the
        # default there was ``restart``, or a method's short-run outer settings, are not
        # read back as runs of the new defaults. From scratch nothing changed, and
        # neither do the fingerprints of cached runs.
        if rule is None:
            rule = cfg.resolved_inner_momentum()
        if cfg.method in TUNED_TRAINED:
            outer = {
                "outer_lr": cfg.resolved_outer_lr(),
                "outer_momentum": cfg.resolved_outer_momentum(),
            }
    config = asdict(replace(cfg, seed=seed, inner_momentum=rule, **outer))
    for name in RUNTIME_ONLY:  # no simulated result depends on them: cached runs stay valid
        config.pop(name, None)
    defaults = AsyncConfig()
    for name in ADDED_LATER:  # at their defaults, runs cached before them stay valid
        if config[name] == getattr(defaults, name):
            del config[name]
    blob = {
        "config": config,
        "clock": asdict(replace(clock, seed=seed)),
        "context": dict(context or {}),
    }
    text = json.dumps(blob, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_json(path: Path, blob: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(blob) + "\n")


def run_sweep(
    task_for_seed: Callable[[int], Task],
    base: AsyncConfig,
    clock: SimClock,
    grid: dict[str, dict[str, tuple]],
    seeds: Sequence[int],
    out_dir: Path | None = None,
    on_run: Callable[[dict[str, Any], bool], None] | None = None,
    context: Mapping[str, Any] | None = None,
    on_pretrain: Callable[[int, Start, SimCheckpoint | None], ProgressFn | None] | None = None,
    checkpoint_every: float | None = 600.0,
    on_start: Callable[[str, dict[str, Any], int, SimCheckpoint | None], RunProgress | None]
    | None = None,
) -> list[dict[str, Any]]:
    """Every method x setting x seed, simulated; returns the runs (curves included).

    ``task_for_seed(seed)`` builds the task of one seed (its data order and initial
    parameters); the seed also seeds the clock's jitter, the shard sampler, and torch's,
    Python's and NumPy's generators before each task, pretraining and run (the caller's
    are left so).
    ``on_run(run, cached)`` is called after each run, ``cached`` when read from
    ``out_dir``; ``on_pretrain(seed, start, checkpoint)`` before a seed's pretraining
    (once per seed, kept in ``out_dir``; ``checkpoint``: where it is kept as it goes)
    may return a callback called after every pretraining step with ``(step, loss)`` (a
    resumed one: first with the step after its save; none when the weights are read).
    ``context``: what ``task_for_seed`` builds, as plain values (model, data, batch size,
    ...), so that a run cached from another task is not read back.

    With ``out_dir`` a run in progress is saved every ``checkpoint_every`` wall seconds
    (``math.inf``: a save left earlier is read, none written; None: no file; see the
    module docstring). ``on_start(method, setting, seed, checkpoint)`` is called before
    each run that is computed and may return a callback called with ``(done, total)``
    inner steps, first at the start (``checkpoint.resumed_at`` says whether it resumed).
    Every configuration is validated before the first run.
    """
    plan = _plan(base, clock, grid, seeds)
    runs_dir = None
    if out_dir is not None:
        runs_dir = Path(out_dir) / "runs"
        runs_dir.mkdir(parents=True, exist_ok=True)
    tasks: dict[int, Task] = {}
    starts: dict[tuple[int, Start], dict[str, torch.Tensor]] = {}
    runs = []
    for method, setting, cfg, seed in plan:
        key, digest = run_key(method, setting, seed), fingerprint(cfg, clock, seed, context)
        path = runs_dir / f"{key}.json" if runs_dir is not None else None
        run = json.loads(path.read_text()) if path is not None and path.exists() else {}
        cached = run.get("fingerprint") == digest
        if not cached:
            if seed not in tasks:  # built from seeded generators: the same every time
                seed_generators(seed)
                tasks[seed] = task_for_seed(seed)
            where = (runs_dir, seed, context, checkpoint_every)
            state = _start_state(starts, tasks[seed], cfg, clock, where, on_pretrain)
            ckpt = None
            if runs_dir is not None and checkpoint_every is not None:
                ckpt = SimCheckpoint(runs_dir / f"{key}.partial.pt", checkpoint_every, digest)
            progress = on_start(method, setting, seed, ckpt) if on_start is not None else None
            seed_generators(seed)
            run = simulate(
                tasks[seed],
                replace(cfg, seed=seed),
                replace(clock, seed=seed),
                pretrained=state,
                checkpoint=ckpt,
                progress=progress,
            )
            run |= {"method": method, "setting": setting, "seed": seed, "key": key}
            run["fingerprint"] = digest
            if path is not None:
                _write_json(path, run)
        if runs_dir is not None:  # the result is kept: its run's checkpoint is done with
            (runs_dir / f"{key}.partial.pt").unlink(missing_ok=True)
        runs.append(run)
        if on_run is not None:
            on_run(run, cached)
    return runs


def _plan(
    base: AsyncConfig, clock: SimClock, grid: dict[str, dict[str, tuple]], seeds: Sequence[int]
) -> list[tuple[str, dict[str, Any], AsyncConfig, int]]:
    """Every (method, setting, config, seed) of the sweep, each config validated."""
    for method in grid:
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    plan = []
    for method, mgrid in grid.items():
        for setting in settings_of(mgrid):
            cfg = replace(for_method(base, method), **setting)
            cfg.validate(len(clock.seconds_per_step), simulated=True)
            plan += [(method, setting, cfg, seed) for seed in seeds]
    return plan


def _start_state(
    starts: dict[tuple[int, Start], dict[str, torch.Tensor]],
    task: Task,
    cfg: AsyncConfig,
    clock: SimClock,
    where: tuple[Path | None, int, Mapping[str, Any] | None, float | None],
    on_pretrain: Callable[[int, Start, SimCheckpoint | None], ProgressFn | None] | None,
) -> dict[str, torch.Tensor] | None:
    """The weights a run of ``cfg`` starts from (None: its task's own), its seed's
    pretraining computed once into ``starts``."""
    start, seed = cfg.start(), where[1]
    if not start.pretrain_steps:
        return None
    if (seed, start) not in starts:
        shards = cfg.resolved_shards(len(clock.seconds_per_step))
        starts[seed, start] = _pretrained(task, start, shards, where, on_pretrain)
    return starts[seed, start]


def _pretrained(
    task: Task,
    start: Start,
    shards: int,
    where: tuple[Path | None, int, Mapping[str, Any] | None, float | None],
    on_pretrain: Callable[[int, Start, SimCheckpoint | None], ProgressFn | None] | None,
) -> dict[str, torch.Tensor]:
    """The pretrained weights of one seed's ``task``, computed once and kept beside the
    runs (``runs/pretrained-seed<S>-<digest>.pt``), so a sweep resumed or widened later
    does not pretrain again; while it is computed, its progress is kept every
    ``checkpoint_every`` seconds in ``...-<digest>.partial.pt``, as a run's is."""
    runs_dir, seed, context, checkpoint_every = where
    path = ckpt = None
    if runs_dir is not None:
        blob = {"start": asdict(start), "shards": shards, "seed": seed, "context": context}
        text = json.dumps(blob, sort_keys=True, default=repr)
        name = f"pretrained-seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        path = runs_dir / f"{name}.pt"
        if checkpoint_every is not None:
            ckpt = SimCheckpoint(runs_dir / f"{name}.partial.pt", checkpoint_every, name)
    progress = on_pretrain(seed, start, ckpt) if on_pretrain is not None else None
    if path is not None and path.exists():
        if ckpt is not None:  # a stop between keeping the weights and removing the save
            ckpt.discard()
        return load_start_state(path, task.model())
    seed_generators(seed)
    state = start.pretrained(task, shards, progress, ckpt)
    if path is not None:
        atomic_save(state, path)
    if ckpt is not None:
        ckpt.discard()
    return state


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, sd


def summarize_sweep(runs: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    """The grid (mean and sd of the final loss per method and setting), each method's best
    setting, and how the bests compare with sync DiLoCo's best.

    For each best: final loss against sync's (same seeds), and the simulated time to
    reach sync's final loss of the same seed (plus ``target``, a fixed loss, if given)
    with its speed-up over sync's time for the whole budget. Settings whose mean is
    within one sd of the best are listed as ties.
    """
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["method"], json.dumps(r["setting"], sort_keys=True)), []).append(r)
    grid = []
    order = {m: i for i, m in enumerate(METHODS)}
    for (method, setting), rs in sorted(cells.items(), key=lambda c: (order[c[0][0]], c[0][1])):
        mean, sd = _mean_sd([r["final_val_loss"] for r in rs])
        row = {"method": method, "setting": json.loads(setting), "final_mean": mean}
        grid.append(row | {"final_sd": sd, "seeds": sorted(r["seed"] for r in rs)})
    best: dict[str, Any] = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rows = sorted((g for g in grid if g["method"] == method), key=lambda g: g["final_mean"])
        top = rows[0]
        ties = [
            g["setting"] for g in rows[1:] if g["final_mean"] - top["final_mean"] <= top["final_sd"]
        ]
        key = json.dumps(top["setting"], sort_keys=True)
        runner_up = rows[1] if len(rows) > 1 else None
        best[method] = top | {"runner_up": runner_up, "ties": ties, "runs": cells[(method, key)]}
    if "sync" in best:
        _compare_to_sync(best, target)
    for b in best.values():
        b["runs"] = [r["key"] for r in b["runs"]]
    return {"grid": grid, "best": best}


def _compare_to_sync(best: dict[str, Any], target: float | None) -> None:
    sync = {r["seed"]: r for r in best["sync"]["runs"]}
    for b in best.values():
        ratios, reach, speedups, fixed = [], [], [], []
        for r in b["runs"]:
            ref = sync.get(r["seed"])
            if ref is None:
                continue
            ratios.append(r["final_val_loss"] / ref["final_val_loss"])
            t = time_to_reach(r["curve"], ref["final_val_loss"])
            reach.append(t)
            speedups.append(ref["sim_time_s"] / t if t else None)
            if target is not None:
                fixed.append(time_to_reach(r["curve"], target))
        b["loss_vs_sync"] = _mean_sd(ratios)[0] if ratios else None
        b["time_to_sync_loss_s"] = reach
        b["speedup_to_sync_loss"] = speedups
        b["sim_time_s"] = _mean_sd([r["sim_time_s"] for r in b["runs"]])[0]
        if target is not None:
            b["time_to_target_s"] = fixed
