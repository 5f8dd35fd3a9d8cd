"""A deterministic virtual-clock simulation of heterogeneous Local-SGD workers.

Each simulated worker has a fixed number of seconds per inner step (optionally with
seeded jitter per round). The workers' inner steps are really computed (a real model,
real data, real AdamW), but time is virtual: a round of ``H_w`` steps "takes"
``H_w * seconds_per_step_w`` seconds, and arrivals are handed to the server in
virtual-time order. The server is the very :class:`ServerCore` the multi-process runtime
uses, so sweeps over speeds, H, outer optimizers or DyLU are cheap, reproducible (same
seed, same numbers), and test the production code path.

Methods (the paper's comparison, arXiv 2401.09135):

* ``sync``: synchronous DiLoCo. Every round waits for all workers (the server's sync
  barrier) and Delayed Nesterov with ``N = W, c = 0`` makes the W arrivals one
  ``SGD(nesterov=True)`` step on their mean, which is DiLoCo's outer step exactly.
* ``naive``: asynchronous, outer Nesterov applied to every arrival.
* ``dn``: asynchronous with Delayed Nesterov.
* ``dn-dylu``: Delayed Nesterov plus Dynamic Local Updates.

All methods spend the same budget of inner steps (``steps_per_worker * W``), so final
losses compare equal compute; the virtual clock shows what each costs in time.
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from thinwire.errors import ConfigError
from thinwire.localsgd.async_runtime import evaluate_theta
from thinwire.localsgd.inner_state import resolve_inner_momentum
from thinwire.localsgd.server import ServerCore
from thinwire.localsgd.worker import LocalWorker
from thinwire.train.data import TextData
from thinwire.train.model import GPT, PRESETS, GPTConfig

__all__ = ["METHODS", "SimConfig", "gpt_config", "simulate", "time_to_reach"]

METHODS = ("sync", "naive", "dn", "dn-dylu")


@dataclass
class SimConfig:
    """One simulated run. Defaults follow the paper's toy example (4 workers)."""

    method: str = "dn-dylu"
    """``sync``, ``naive``, ``dn`` or ``dn-dylu``."""
    seconds_per_step: tuple[float, ...] = (0.58, 0.75, 1.51, 3.33)
    """Virtual seconds per inner step of each worker; its length is the worker count W."""
    jitter: float = 0.0
    """Relative spread of each round's duration (log-normal, seeded); 0 = exact speeds."""
    local_steps: int = 50
    """H: inner steps per round (of the fastest worker under DyLU)."""
    steps_per_worker: int = 500
    """Inner-step budget per worker; the run spends ``steps_per_worker * W`` in total."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    c: float = 0.0
    """Delayed Nesterov's c in ``[0, 1/W]``."""
    grace_s: float = 0.0
    """Grace period in virtual seconds."""
    inner_momentum: str | None = None
    """``keep``: each worker's AdamW first moment persists across rounds (DiLoCo).
    ``round``: it restarts at every round, which keeps DN+DyLU from degrading when DyLU
    gives slow workers rounds of a few steps (see :mod:`thinwire.localsgd.inner_state`).
    ``None`` (default): ``round`` for ``dn-dylu``, ``keep`` for the other methods, the
    same rule as ``thinwire train``."""
    shards: int | None = None
    """Data shards (``None``: one per worker, as ``thinwire train``). With one shard per
    worker each worker keeps its own; more shards let the least-progress rule balance
    them (see :mod:`thinwire.localsgd.shards`)."""
    model: str = "tiny"
    model_overrides: dict[str, int] = field(default_factory=dict)
    """e.g. ``{"n_layer": 1}``: fields of :class:`GPTConfig` replacing the preset's."""
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    data: str | None = None
    seed: int = 0
    eval_points: int = 20
    """Validation passes spread evenly over the inner-step budget (plus one at the start)."""
    eval_sequences: int = 64

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if not self.seconds_per_step:
            raise ConfigError("seconds-per-step needs one value per worker, got none")
        if any(not (s > 0 and math.isfinite(s)) for s in self.seconds_per_step):
            raise ConfigError(f"seconds per step must be > 0, got {list(self.seconds_per_step)}")
        for name in ("local_steps", "steps_per_worker", "batch_size", "eval_points"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.jitter < 0:
            raise ConfigError(f"jitter must be >= 0, got {self.jitter}")
        if self.shards is not None and self.shards < 1:
            raise ConfigError(f"shards must be >= 1, got {self.shards}")
        self.resolved_inner_momentum()
        if self.model not in PRESETS:
            raise ConfigError(f"unknown model preset {self.model!r}; valid: {', '.join(PRESETS)}")

    def resolved_inner_momentum(self) -> str:
        """``inner_momentum``, or its default for this method when unset."""
        return resolve_inner_momentum(self.inner_momentum, dylu=self.method == "dn-dylu")


def gpt_config(cfg: SimConfig) -> GPTConfig:
    """The simulated model's shape: the preset with ``model_overrides`` applied."""
    base = asdict(PRESETS[cfg.model]) | dict(cfg.model_overrides)
    try:
        return GPTConfig(**base)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad model settings: {exc}") from None


def simulate(cfg: SimConfig, data: TextData | None = None) -> dict[str, Any]:
    """Run one simulated training; returns its loss curve and summary (JSON-ready)."""
    cfg.validate()
    w_count = len(cfg.seconds_per_step)
    gcfg = gpt_config(cfg)
    if data is None:
        data = TextData(cfg.data, gcfg.seq_len, 0.05, cfg.seed)
    shards = data.shards(cfg.shards or w_count)
    inner_momentum = cfg.resolved_inner_momentum()
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    total = cfg.steps_per_worker * w_count
    core = ServerCore(
        parameters_to_vector(model.parameters()), workers=w_count, local_steps=cfg.local_steps,
        total_steps=total, shard_sizes=[len(s) for s in shards],
        outer="nesterov" if cfg.method == "naive" else "dn", outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum, c=cfg.c, dylu=cfg.method == "dn-dylu",
        grace_s=cfg.grace_s, sync=cfg.method == "sync",
    )  # fmt: skip
    workers = {
        w: LocalWorker(
            copy.deepcopy(model),
            shards,
            seq_len=gcfg.seq_len,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            min_lr_ratio=cfg.min_lr_ratio,
            weight_decay=cfg.weight_decay,
            seed=cfg.seed,
            inner_momentum=inner_momentum,
        )
        for w in range(1, w_count + 1)
    }
    spw = dict(zip(workers, cfg.seconds_per_step, strict=True))
    jitter_rng = torch.Generator().manual_seed(cfg.seed + 7919)
    val = data.val_batches(cfg.eval_sequences, cfg.batch_size)
    curve: list[dict[str, float]] = []

    def record(now: float) -> None:
        loss = evaluate_theta(model, core.theta.detach(), val)
        curve.append(
            {"steps": core.steps_applied, "updates": core.updates_applied, "time_s": now,
             "val_loss": loss}
        )  # fmt: skip

    events: list[tuple[float, int, int, Any, Any, float]] = []
    seq = 0

    def dispatch(now: float) -> None:
        nonlocal seq
        for w in core.due(now):
            work = core.work_for(w, now)
            if work is None or work.stop:
                continue
            result = workers[w].run_round(core.theta.detach().clone(), work)
            factor = 1.0
            if cfg.jitter > 0:
                factor = math.exp(cfg.jitter * float(torch.randn((), generator=jitter_rng)))
            seconds = spw[w] * factor  # this round's virtual seconds per step
            heapq.heappush(events, (now + work.steps * seconds, seq, w, work, result, seconds))
            seq += 1

    record(0.0)
    every = total / cfg.eval_points
    next_eval = every
    for w in workers:
        core.join(w, 0.0)
    now = 0.0
    dispatch(now)
    while events or core.wake_at() is not None:
        deadline = core.wake_at()
        if deadline is not None and (not events or deadline < events[0][0]):
            now = deadline
        else:
            now, _, w, work, result, seconds = heapq.heappop(events)
            core.submit(w, work.epoch, result.pseudo_grad, work.steps, seconds, now)
            if core.steps_applied >= next_eval - 1e-9:
                while next_eval <= core.steps_applied + 1e-9:
                    next_eval += every
                record(now)
        dispatch(now)
    if curve[-1]["steps"] != core.steps_applied:
        record(now)
    return {
        "method": cfg.method,
        "config": asdict(cfg) | {"inner_momentum": inner_momentum},
        "parameters": model.num_parameters(),
        "final_val_loss": curve[-1]["val_loss"],
        "inner_steps": core.steps_applied,
        "updates": core.updates_applied,
        "sim_time_s": now,
        "shard_steps": list(core.shards.clock),
        "shard_planned": list(core.shards.planned),
        "curve": curve,
    }


def time_to_reach(curve: list[dict[str, float]], target: float) -> float | None:
    """Virtual time of the first evaluation with ``val_loss <= target``, None if never."""
    for point in curve:
        if point["val_loss"] <= target:
            return point["time_s"]
    return None
