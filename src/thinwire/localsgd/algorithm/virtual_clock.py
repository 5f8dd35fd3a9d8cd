"""A deterministic virtual-clock simulation of heterogeneous Local-SGD workers.

Each simulated worker has a fixed number of seconds per inner step (optionally with
seeded jitter per round). The workers' inner steps are really computed (a real model,
real data, real AdamW), but time is virtual: a round of ``H_w`` steps "takes"
``H_w * seconds_per_step_w`` seconds, and arrivals are handed to the server in
virtual-time order. The server is the very :class:`ServerCore` the multi-process runtime
uses, so sweeps over speeds, H, outer optimizers or DyLU are cheap, reproducible (same
seed, same numbers), and test the production code path.

Methods: the paper's comparison (arXiv 2401.09135), see :mod:`thinwire.localsgd.algorithm.methods`:
``sync`` (synchronous DiLoCo), ``naive``, ``poly``, ``polythres``, ``buffer``, ``dn``
and ``dn-dylu``.

Heterogeneity: :data:`HETEROGENEITY` holds four speed presets named after the paper's
levels (none / slight / moderate / very). ``very`` is the paper's notebook's speeds;
the paper's own distributions were not available to us, so the other three are
thinwire's: ``s_i = 0.58 * (s_i_very / 0.58) ** a`` with ``a`` = 0, 1/4, 1/2, i.e.
spreads of 1x, 1.55x and 2.4x against very's 5.7x.

DyLU's speeds: by default the simulator *declares* the clock's speeds to the server, so
DyLU sizes even the first round (as in the paper's simulation); with
``SimClock.declare_speeds=False`` the server measures them in a short calibration round
(``AsyncConfig.calibration_steps``), as a real run without ``speeds`` does.

All methods spend the same budget of inner steps (``steps * W``), so final losses
compare equal compute; the virtual clock shows what each costs in time.

The simulator takes the very pieces a real run takes: the user's
:class:`~thinwire.localsgd.task.Task` (its ``evaluate`` is required: it draws the curve)
and one :class:`~thinwire.localsgd.config.AsyncConfig`, plus a :class:`SimClock` with the
virtual-clock knobs; :func:`for_method` sets a config up as one of the methods above.
The config's wall-clock settings (timeouts, heartbeats, the runtime's checkpoints,
``eval_interval``) do not apply to a virtual clock; ``slowdown`` is refused (speeds come
from the clock). A simulated run keeps checkpoints of its own, so that a run of hours can
be stopped and go on (:mod:`thinwire.localsgd.algorithm.sim_checkpoint`).
``compress`` and ``compress_pull`` go through the runtime's very codecs
(:mod:`thinwire.localsgd.algorithm.compression`), error feedback included, and the payload bytes
of every push and pull are counted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import PullDecoder, PullEncoder, PushEncoder, decode
from thinwire.localsgd.algorithm.methods import METHODS, for_method
from thinwire.localsgd.algorithm.norm_stats import NormStats
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.algorithm.sim_checkpoint import (
    SimCheckpoint,
    check_same_run,
    generator_states,
    restore_generators,
)
from thinwire.localsgd.algorithm.worker_core import LocalWorker, RoundResult
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.messages import Work
from thinwire.localsgd.task import (
    Task,
    flat_parameters,
    make_sources,
    metrics_at,
    shard_sizes,
)

__all__ = [
    "HETEROGENEITY",
    "METHODS",
    "SimCheckpoint",
    "SimClock",
    "for_method",
    "simulate",
    "time_to_reach",
]

HETEROGENEITY: dict[str, tuple[float, ...]] = {
    level: tuple(round(0.58 * (s / 0.58) ** a, 3) for s in (0.58, 0.75, 1.51, 3.33))
    for level, a in (("none", 0.0), ("slight", 0.25), ("moderate", 0.5), ("very", 1.0))
}
"""Seconds per inner step of 4 workers at the paper's four heterogeneity levels (see the
module docstring: ``very`` is the paper's notebook's, the others thinwire's stand-ins)."""


@dataclass
class SimClock:
    """The virtual clock of a simulated run. Defaults: the paper's toy example."""

    seconds_per_step: tuple[float, ...] = (0.58, 0.75, 1.51, 3.33)
    """Virtual seconds per inner step of each worker; its length is the worker count W."""
    jitter: float = 0.0
    """Relative spread of each round's duration (log-normal, seeded); 0 = exact speeds."""
    seed: int = 0
    """Seeds the jitter."""
    eval_points: int = 20
    """Evaluations spread evenly over the inner-step budget (plus one at the start)."""
    declare_speeds: bool = True
    """Tell the server the speeds above before the first round (DyLU sizes every round
    from the start); False: the server calibrates them as a real run does."""

    def validate(self) -> None:
        if not self.seconds_per_step:
            raise ConfigError("seconds-per-step needs one value per worker, got none")
        if any(not (s > 0 and math.isfinite(s)) for s in self.seconds_per_step):
            raise ConfigError(f"seconds per step must be > 0, got {list(self.seconds_per_step)}")
        if not (self.jitter >= 0 and math.isfinite(self.jitter)):
            raise ConfigError(f"jitter must be >= 0, got {self.jitter}")
        if self.eval_points < 1:
            raise ConfigError(f"eval-points must be >= 1, got {self.eval_points}")


_POINT = ("steps", "updates", "time_s")  # a curve point's own keys, besides its metrics


def simulate(
    task: Task,
    cfg: AsyncConfig,
    clock: SimClock | None = None,
    pretrained: dict[str, torch.Tensor] | None = None,
    *,
    checkpoint: SimCheckpoint | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run one simulated training of ``task``; returns its curve and summary (JSON-ready).

    The run starts where ``cfg.start()`` says (:mod:`thinwire.localsgd.algorithm.pretrain`);
    ``pretrained`` is that start's weights if already computed (a sweep's other runs).
    ``checkpoint``: save the run as it goes and go on from an earlier save of it
    (:mod:`thinwire.localsgd.algorithm.sim_checkpoint`; the result is the same either
    way; ``checkpoint.resumed_at`` says whether it resumed). ``progress(done, total)``
    is called with the inner steps applied, of ``total``: once at the start and then
    after every arrival (Streaming DiLoCo: every stretch of inner steps).

    Each curve point holds ``steps``, ``updates``, ``time_s`` and ``task.evaluate``'s
    metrics (``val_loss`` and, from a dict, the others by name); ``final_val_loss`` and
    ``final_metrics`` are the last point's.
    """
    clock = clock or SimClock()
    clock.validate()
    cfg.validate(len(clock.seconds_per_step), simulated=True)
    if cfg.slowdown is not None:
        raise ConfigError(
            "the simulator's speeds come from SimClock.seconds_per_step, not slowdown"
        )
    if task.evaluate is None:
        raise ConfigError("simulate needs task.evaluate: the curve it returns is of that metric")
    if cfg.streaming():  # sync DiLoCo with fragments or a quantizer (checked above)
        from thinwire.localsgd.algorithm.streaming_sim import simulate_streaming

        own, curve, now = simulate_streaming(task, cfg, clock, pretrained, checkpoint, progress)
        return _summary(cfg, clock, own, curve, now)
    sim = _Simulation(task, cfg, clock, pretrained)
    return sim.summary(sim.run(checkpoint, progress))


def started(
    task: Task, cfg: AsyncConfig, workers: int, pretrained: dict[str, torch.Tensor] | None
) -> tuple[Task, torch.nn.Module, list[Any]]:
    """``task`` from where ``cfg`` starts (``pretrained``: that start's weights, if
    computed), the model that holds theta, and the shards' batch sources."""
    shards = cfg.resolved_shards(workers)
    task = cfg.start().apply(task, shards, state=pretrained)
    return task, task.model(), make_sources(task, shards)


def sim_worker(task: Task, cfg: AsyncConfig, sources: list[Any], rule: str) -> LocalWorker:
    """One simulated worker: the task's model and inner optimizer on the shared sources
    (by contract a batch depends only on (shard, step)), under the inner-state ``rule``."""
    return LocalWorker(
        task.model(),
        task.optimizer,
        sources,
        task.loss,
        warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        grad_clip=cfg.grad_clip,
        inner_momentum=rule,
    )


class _Simulation:
    """One simulated run: the server, the workers with their codecs, the rounds in flight
    (a heap by virtual finish time) and the curve of evaluations."""

    def __init__(
        self,
        task: Task,
        cfg: AsyncConfig,
        clock: SimClock,
        pretrained: dict[str, torch.Tensor] | None,
    ) -> None:
        w_count = len(clock.seconds_per_step)
        self.cfg, self.clock, self.metric = cfg, clock, task.evaluate
        task, self.model, sources = started(task, cfg, w_count, pretrained)
        self.norms = NormStats(self.model, sources, task.loss, cfg.norm_batches)
        self.norms.warn()
        self.total = cfg.steps * w_count
        declared = None
        if clock.declare_speeds and cfg.speeds is None:
            declared = dict(enumerate(clock.seconds_per_step, start=1))
        self.core = ServerCore.from_config(
            flat_parameters(self.model), cfg, w_count, shard_sizes(sources), speeds=declared
        )
        # The batch sources are shared: by contract a batch depends only on (shard, step).
        rule = cfg.resolved_inner_momentum()
        self.workers = {w: sim_worker(task, cfg, sources, rule) for w in range(1, w_count + 1)}
        self.push = {w: PushEncoder(cfg.compress, cfg.error_feedback) for w in self.workers}
        self.pull = PullEncoder(cfg.compress_pull)
        self.views = {w: PullDecoder() for w in self.workers}
        self.wire = {"push_bytes": 0, "pull_bytes": 0}
        self.spw = dict(zip(self.workers, clock.seconds_per_step, strict=True))
        self.jitter_rng = torch.Generator().manual_seed(clock.seed + 7919)
        self.curve: list[dict[str, float]] = []
        self.events: list[tuple[float, int, int, Work, RoundResult, float]] = []
        self.seq = 0
        self.now = 0.0
        self.next_eval = self.total / clock.eval_points

    def record(self, now: float) -> None:
        core = self.core
        # val_loss, ..., with theta's own normalization statistics
        refresh = self.norms.refresh
        metrics = metrics_at(self.model, core.theta.detach(), self.metric, lambda _: refresh())
        point = {"steps": core.steps_applied, "updates": core.updates_applied, "time_s": now}
        self.curve.append(point | metrics)

    def dispatch(self, now: float) -> None:
        """Hand a round to every worker the server says is due, and run it at once; its
        result waits in the heap until its virtual finish time."""
        core, wire = self.core, self.wire
        for w in core.due(now):
            work = core.work_for(w, now)
            if work is None or work.stop:
                continue
            is_delta, payload = self.pull.encode(w, core.theta.detach())
            wire["pull_bytes"] += payload.numel() * payload.element_size()
            theta = self.views[w].delta(payload) if is_delta else self.views[w].whole(payload)
            result = self.workers[w].run_round(theta, work)
            sent = self.push[w].encode(result.pseudo_grad)  # as on the wire, error feedback too
            wire["push_bytes"] += sent.numel() * sent.element_size()
            result.pseudo_grad = decode(sent, result.pseudo_grad.numel())
            factor = 1.0
            if self.clock.jitter > 0:
                noise = float(torch.randn((), generator=self.jitter_rng))
                factor = math.exp(self.clock.jitter * noise)
            seconds = self.spw[w] * factor  # this round's virtual seconds per step
            finish = now + work.steps * seconds
            heapq.heappush(self.events, (finish, self.seq, w, work, result, seconds))
            self.seq += 1

    def run(
        self,
        checkpoint: SimCheckpoint | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> float:
        """Play the run out in virtual time (from ``checkpoint``'s save, if it holds one
        of this run); returns the time it ended."""
        core = self.core
        settings = (self.cfg, self.clock)
        if checkpoint is not None and checkpoint.resume(settings, self.load_state_dict):
            checkpoint.resumed_at = core.steps_applied
        else:
            self.record(0.0)
            for w in self.workers:
                core.join(w, 0.0)
            self.dispatch(0.0)
        if progress is not None:
            progress(core.steps_applied, self.total)
        every = self.total / self.clock.eval_points
        while self.events or core.wake_at() is not None:
            deadline = core.wake_at()
            if deadline is not None and (not self.events or deadline < self.events[0][0]):
                self.now = deadline
            else:
                self.now, _, w, work, result, seconds = heapq.heappop(self.events)
                core.submit(
                    w, work.epoch, result.pseudo_grad, work.steps, seconds, self.now, work.version
                )
                if core.steps_applied >= self.next_eval - 1e-9:
                    while self.next_eval <= core.steps_applied + 1e-9:
                        self.next_eval += every
                    self.record(self.now)
                if progress is not None:
                    progress(core.steps_applied, self.total)
            self.dispatch(self.now)
            if checkpoint is not None and checkpoint.due():
                checkpoint.save(self.state_dict())
        if self.curve[-1]["steps"] != core.steps_applied:
            self.record(self.now)
        return self.now

    # --- checkpoints (between two events: nothing half done) ---------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the rest of the run reads, as plain values and tensors."""
        return {
            "core": self.core.snapshot(),
            "inner": {w: worker.opt.state_dict() for w, worker in self.workers.items()},
            "push": {w: enc.feedback.state_dict() for w, enc in self.push.items() if enc.feedback},
            "pull": {w: view.clone() for w, view in self.pull.views.items()},
            # A worker's view of theta is read only by compressed pulls' deltas.
            "views": {w: d.view for w, d in self.views.items()} if self.pull.compressed else {},
            "events": [
                (finish, seq, w, _fields(work), _fields(result), seconds)
                for finish, seq, w, work, result, seconds in self.events
            ],
            "seq": self.seq,
            "now": self.now,
            "next_eval": self.next_eval,
            "curve": self.curve,
            "wire": dict(self.wire),
            "jitter_rng": self.jitter_rng.get_state(),
            "generators": generator_states(),  # a task's dropout, data order, ...
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` of this very run (same task, config and clock)."""
        saved = (state["core"]["model"]["theta"].numel(), len(state["inner"]))
        check_same_run(saved, (self.core.theta.numel(), len(self.workers)))
        self.core.restore(state["core"])
        for w, worker in self.workers.items():
            worker.opt.load_state_dict(state["inner"][w])
        for w, residual in state["push"].items():
            feedback = self.push[w].feedback
            assert feedback is not None  # the same codec saved it
            feedback.load_state_dict(residual)
        self.pull.views = {int(w): view.clone() for w, view in state["pull"].items()}
        for w, view in state["views"].items():
            self.views[w].view = None if view is None else view.clone()
        self.events = [
            (finish, seq, w, Work(**work), RoundResult(**result), seconds)
            for finish, seq, w, work, result, seconds in state["events"]
        ]
        self.seq, self.now = int(state["seq"]), float(state["now"])
        self.next_eval = float(state["next_eval"])
        self.curve = [dict(point) for point in state["curve"]]
        self.wire = dict(state["wire"])
        self.jitter_rng.set_state(state["jitter_rng"])
        if "generators" in state:
            restore_generators(state["generators"])
        else:  # saved by a version that kept torch's generator alone
            torch.set_rng_state(state["torch_rng"])

    def summary(self, now: float) -> dict[str, Any]:
        core = self.core
        own = {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "inner_steps": core.steps_applied,
            "updates": core.updates_applied,
            "updates_dropped": core.updates_dropped,
            "staleness": {str(k): v for k, v in sorted(core.staleness_seen.items())},
            "shard_steps": list(core.shards.clock),
            "shard_planned": list(core.shards.planned),
            **self.wire,
        }
        return _summary(self.cfg, self.clock, own, self.curve, now)


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, not copied (``asdict`` would copy the tensors)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _summary(
    cfg: AsyncConfig,
    clock: SimClock,
    own: dict[str, Any],
    curve: list[dict[str, float]],
    now: float,
) -> dict[str, Any]:
    """A simulated run's summary: its settings, start, final loss and curve, and
    ``own``, the counts its kind of run keeps (updates, staleness, bytes, ...)."""
    return {
        "config": asdict(cfg)
        | {
            "inner_momentum": cfg.resolved_inner_momentum(),
            "outer_lr": cfg.resolved_outer_lr(),
            "outer_momentum": cfg.resolved_outer_momentum(),
            "method": cfg.method,
        },
        "clock": asdict(clock),
        "start": cfg.start().describe(),
        "final_val_loss": curve[-1]["val_loss"],
        "final_metrics": {k: v for k, v in curve[-1].items() if k not in _POINT},
        "sim_time_s": now,
        **own,
        "curve": curve,
    }


def time_to_reach(curve: list[dict[str, float]], target: float) -> float | None:
    """Virtual time of the first evaluation with ``val_loss <= target``, None if never."""
    for point in curve:
        if point["val_loss"] <= target:
            return point["time_s"]
    return None
