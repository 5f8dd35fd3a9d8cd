"""The parameter server of asynchronous Local-SGD, free of any transport or clock.

:class:`ServerCore` holds the global parameters theta (one flat fp32 vector), the outer
optimizer, the DyLU speed table and the shard book, and decides *what* happens; the
multi-process runtime (:mod:`thinwire.localsgd.server_loop`) and the virtual-clock
simulator (:mod:`thinwire.localsgd.virtual_clock`) only decide *when*: they call
:meth:`~ServerCore.join`, :meth:`~ServerCore.submit`, :meth:`~ServerCore.due` and
:meth:`~ServerCore.work_for` with the current time (wall or virtual), so a simulation
runs exactly the code a real run does.

Mechanics (Liu et al., 2024, https://arxiv.org/abs/2401.09135):

* Each pseudo-gradient is applied on arrival, one at a time, by the outer optimizer
  (Delayed Nesterov with ``N`` = live workers, naive Nesterov, or the asynchronous
  buffer), optionally discounted by its staleness.
* **Staleness** ``tau``: outer updates applied between the version a worker pulled and
  its arrival. ``staleness="poly"`` scales a pseudo-gradient by ``(1 + tau)^-1/2`` (the
  paper's "Poly" baseline); ``max_staleness`` drops anything staler ("PolyThres").
* **Grace period** ``grace_s``: a worker that arrives waits up to ``grace_s`` after the
  first waiting arrival; everyone who arrived by then is applied in turn and restarts
  from the same theta. 0 answers at once. ``sync=True`` waits for *all* live workers
  instead, which with Delayed Nesterov (N = W, c = 0) is exactly synchronous DiLoCo. In
  sync mode the arrivals of a round are held and applied in worker order once the last
  one is in, and the workers are answered in worker order, so a run does not depend on
  which worker happened to arrive first (the simulator and real processes agree).
* **Budget**: the run ends after ``total_steps`` inner steps have been handed out and
  returned; rounds are capped so the total is met exactly.
* **Versions and epochs**: every theta sent out is tagged ``(epoch, version)``. A server
  restored from a checkpoint starts a new epoch, and rejects updates tagged with an
  older epoch: they were computed from parameters the restored server never had.
* **Dead workers** (:meth:`drop`) leave DN's buffer size and DyLU's reference speed;
  their shard is rewound and freed. A worker that shows up again is simply re-admitted.
* **Checked pushes**: :meth:`submit` applies a push only if the
  :class:`~thinwire.localsgd.push_guard.PushGuard` accepts it (finite, one value per
  parameter, the steps handed out, a norm in line with recent pushes). A refused push is
  rewound like a lost round; after ``guard.max_strikes`` refusals in a row the worker is
  *evicted*: dropped like a dead one and listed in :attr:`evicted`.
* **Stopping early** (:meth:`end_at`): a run may stop before its budget (``stop_after``)
  and resume later; the shard schedules are planned for the whole budget either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.dylu import SpeedTracker
from thinwire.localsgd.messages import Work
from thinwire.localsgd.outer import AsyncBuffer, DelayedNesterov, Nesterov
from thinwire.localsgd.push_guard import PushGuard
from thinwire.localsgd.shards import ShardBook

if TYPE_CHECKING:
    from thinwire.localsgd.config import AsyncConfig

__all__ = ["OUTER_CHOICES", "STALENESS_CHOICES", "ServerCore", "Work"]

OUTER_CHOICES = ("dn", "nesterov", "buffer")
STALENESS_CHOICES = ("none", "poly")


@dataclass
class _Worker:
    busy: bool = False
    steps: int = 0
    since: float = 0.0
    clock: int = 0  # where the round started on its shard's lr schedule
    planned: int = 1


class ServerCore:
    """Global parameters, outer optimizer and bookkeeping of one asynchronous run.

    Args:
        theta: initial global parameters, flattened (copied).
        workers: W, the number of workers the run is planned for (DN's N by default).
        local_steps: H, inner steps per round (of the fastest worker under DyLU).
        total_steps: inner-step budget of the whole run, summed over workers.
        shard_sizes: tokens per data shard (see :class:`ShardBook`).
        outer: ``"dn"`` (Delayed Nesterov) or ``"nesterov"`` (naive, per arrival).
        outer_lr, outer_momentum: outer optimizer lr and beta.
        buffer_size: DN's N; default W. c: DN's c in ``[0, 1/N]``.
        dylu: size rounds by measured speed (DyLU) instead of H for everyone.
        grace_s: grace period in seconds (wall or virtual).
        sync: wait for every live worker before answering (synchronous DiLoCo).
        dylu_ema: weight of the old speed in DyLU's average.
        staleness: ``"none"`` or ``"poly"`` (scale by ``(1 + tau)^-1/2``).
        max_staleness: drop pseudo-gradients staler than this (None: never).
        speeds: declared seconds per inner step of each worker (DyLU from the first
            round); None: measured.
        calibration_steps: under DyLU, the first round of a worker whose speed is neither
            declared nor measured yet (0: a full H).
        min_local_steps: DyLU's floor on a round.
        shard_sampling: ``"least-progress"`` or ``"paper"`` (see :class:`ShardBook`).
        seed: seeds the shard sampler.
        guard: the checks every push must pass (default: :class:`PushGuard` defaults).
    """

    def __init__(
        self,
        theta: torch.Tensor,
        *,
        workers: int,
        local_steps: int,
        total_steps: int,
        shard_sizes: list[int],
        outer: str = "dn",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        buffer_size: int | None = None,
        c: float = 0.0,
        dylu: bool = False,
        grace_s: float = 0.0,
        sync: bool = False,
        dylu_ema: float = 0.5,
        staleness: str = "none",
        max_staleness: int | None = None,
        speeds: dict[int, float] | None = None,
        calibration_steps: int = 0,
        min_local_steps: int = 1,
        shard_sampling: str = "least-progress",
        seed: int = 0,
        guard: PushGuard | None = None,
    ) -> None:
        if workers < 1:
            raise ConfigError(f"asynchronous Local-SGD needs >= 1 worker, got {workers}")
        if local_steps < 1:
            raise ConfigError(f"local steps H must be >= 1, got {local_steps}")
        if total_steps < 1:
            raise ConfigError(f"total inner steps must be >= 1, got {total_steps}")
        if grace_s < 0 or not math.isfinite(grace_s):
            raise ConfigError(f"grace period must be a finite number >= 0, got {grace_s}")
        if outer not in OUTER_CHOICES:
            raise ConfigError(f"unknown outer optimizer {outer!r}; choose one of {OUTER_CHOICES}")
        if staleness not in STALENESS_CHOICES:
            raise ConfigError(
                f"unknown staleness rule {staleness!r}; choose one of {STALENESS_CHOICES}"
            )
        self.theta = torch.nn.Parameter(theta.detach().reshape(-1).float().clone())
        self.n_buffer = workers if buffer_size is None else buffer_size
        self.opt: torch.optim.Optimizer
        if outer == "dn":
            self.opt = DelayedNesterov(
                [self.theta], lr=outer_lr, momentum=outer_momentum, buffer_size=self.n_buffer, c=c
            )
        elif outer == "buffer":
            self.opt = AsyncBuffer(
                [self.theta], lr=outer_lr, momentum=outer_momentum, buffer_size=self.n_buffer
            )
        else:
            self.opt = Nesterov([self.theta], lr=outer_lr, momentum=outer_momentum)
        self.workers = workers
        self.local_steps = local_steps
        self.total_steps = total_steps
        self.use_dylu = dylu
        self.grace_s = grace_s
        self.sync = sync
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.calibration_steps = min(calibration_steps, local_steps)
        self.speeds = SpeedTracker(local_steps, ema=dylu_ema, min_steps=min_local_steps)
        if speeds:
            self.speeds.declare(speeds)
        self.shards = ShardBook(shard_sizes, total_steps, sampling=shard_sampling, seed=seed)
        self.updates_dropped = 0
        self.staleness_seen: dict[int, int] = {}  # tau -> arrivals with it
        # sync mode: a round's arrivals, applied in worker order once all are in
        self._held: dict[int, tuple[torch.Tensor, int, int]] = {}
        self.epoch = 0
        self.version = 0
        self.steps_applied = 0
        self.steps_assigned = 0
        self.updates_applied = 0
        self.updates_rejected = 0
        self.live: dict[int, _Worker] = {}
        self.dead: set[int] = set()
        self.retired: set[int] = set()
        self.waiting: list[int] = []
        self.deadline: float | None = None
        self.planned_steps = total_steps  # the whole run's budget; total_steps: this launch's
        self.guard = guard or PushGuard()
        self.strikes: dict[int, int] = {}  # refused pushes in a row, per worker
        self.evicted: set[int] = set()

    @classmethod
    def from_config(
        cls,
        theta: torch.Tensor,
        cfg: AsyncConfig,
        workers: int,
        shard_sizes: list[int],
        speeds: dict[int, float] | None = None,
    ) -> ServerCore:
        """The server of an :class:`~thinwire.localsgd.config.AsyncConfig` run with
        ``workers`` workers (ids 1..W); the one place the runtime and the simulator build
        it. ``speeds``: declared seconds per step by worker id, overriding ``cfg.speeds``."""
        declared = speeds
        if declared is None and cfg.speeds is not None:
            declared = {w: float(s) for w, s in enumerate(cfg.speeds, start=1)}
        return cls(
            theta,
            workers=workers,
            local_steps=cfg.local_steps,
            total_steps=cfg.steps * workers,
            shard_sizes=shard_sizes,
            outer=cfg.outer,
            outer_lr=cfg.resolved_outer_lr(),
            outer_momentum=cfg.resolved_outer_momentum(),
            c=cfg.c,
            dylu=cfg.dylu,
            grace_s=cfg.grace_s,
            sync=cfg.sync,
            dylu_ema=cfg.dylu_ema,
            staleness=cfg.staleness,
            max_staleness=cfg.max_staleness,
            speeds=declared,
            calibration_steps=cfg.calibration_steps,
            min_local_steps=cfg.min_local_steps,
            shard_sampling=cfg.shard_sampling,
            seed=cfg.seed,
            guard=cfg.push_guard(),
        )

    # --- membership --------------------------------------------------------------------
    def join(self, worker: int, now: float) -> None:
        """``worker`` (new or restarted) wants parameters."""
        self._admit(worker)
        self._wait(worker, now)

    def drop(self, worker: int) -> None:
        """``worker`` is dead: forget its round, its speed and its place in DN's buffer."""
        info = self.live.pop(worker, None)
        if info is None:
            return
        if info.busy:
            self.steps_assigned -= info.steps
            self.shards.release(worker, completed=False)
        self.speeds.remove(worker)
        if worker in self.waiting:
            self.waiting.remove(worker)
        self.dead.add(worker)
        self._resize_buffer()

    def _admit(self, worker: int) -> None:
        if worker not in self.live:
            self.live[worker] = _Worker()
            self.retired.discard(worker)
            self.evicted.discard(worker)
            self.strikes.pop(worker, None)
            if worker in self.dead:
                self.dead.discard(worker)
                self._resize_buffer()

    def _resize_buffer(self) -> None:
        if isinstance(self.opt, (DelayedNesterov, AsyncBuffer)):
            self.opt.set_buffer_size(max(1, self.n_buffer - len(self.dead)))

    def _wait(self, worker: int, now: float) -> None:
        if worker not in self.waiting:
            self.waiting.append(worker)
        if self.deadline is None:
            self.deadline = now + self.grace_s

    # --- updates -----------------------------------------------------------------------
    @torch.no_grad()
    def submit(
        self,
        worker: int,
        epoch: int,
        pseudo_grad: torch.Tensor,
        steps: int,
        seconds_per_step: float,
        now: float,
        version: int | None = None,
    ) -> bool:
        """Apply ``worker``'s pseudo-gradient, computed from theta ``version`` (its
        :class:`Work`'s; None: staleness unknown, taken as 0). True if it was applied (in
        sync mode: accepted for the round); False if it came from another server epoch, was
        staler than ``max_staleness`` (dropped: its steps count as spent) or was refused by
        the guard (nothing changes but the counters; the round is handed out again)."""
        if worker in self.evicted:
            return False  # a leftover of a worker stopped for its pushes
        known = worker in self.live
        self._admit(worker)
        info = self.live[worker]
        was_busy, info.busy = info.busy, False
        if epoch != self.epoch:
            # Computed from a theta of another server epoch (before a restored checkpoint).
            self.updates_rejected += 1
            if was_busy:
                self.steps_assigned -= info.steps
                self.shards.release(worker, completed=False)
            self._wait(worker, now)
            return False
        why, per_step = self.guard.check(
            pseudo_grad,
            steps,
            seconds_per_step,
            numel=self.theta.numel(),
            expected_steps=info.steps if known and was_busy else None,
            max_steps=self.local_steps,
            lr_clock=info.clock if known and was_busy else None,
            planned=info.planned,
        )
        if why is not None:
            self._refuse(worker, was_busy, now)
            return False
        self.strikes.pop(worker, None)
        self.guard.accepted(per_step)
        if not (known and was_busy):
            self.steps_assigned += steps  # a worker presumed dead came back with its round
        self.shards.release(worker, completed=True)
        self.speeds.report(worker, seconds_per_step)
        grad = pseudo_grad.reshape(-1).to(self.theta.dtype)
        tau = 0 if version is None else max(0, self.version - int(version))
        applied = True
        if self.sync:
            self._held[worker] = (grad, steps, tau)
            if not any(w.busy for w in self.live.values()):
                self._flush()
        else:
            applied = self._apply(grad, steps, tau)
        self._wait(worker, now)
        return applied

    def _apply(self, grad: torch.Tensor, steps: int, tau: int) -> bool:
        self.steps_applied += steps
        self.staleness_seen[tau] = self.staleness_seen.get(tau, 0) + 1
        if self.max_staleness is not None and tau > self.max_staleness:
            self.updates_dropped += 1
            return False
        if self.staleness == "poly" and tau > 0:
            grad = grad * (1.0 + tau) ** -0.5
        self.theta.grad = grad
        self.opt.step()
        self.theta.grad = None
        self.version += 1
        self.updates_applied += 1
        return True

    def _refuse(self, worker: int, was_busy: bool, now: float) -> None:
        info = self.live[worker]
        if was_busy:
            self.steps_assigned -= info.steps
            self.shards.release(worker, completed=False)
        self.strikes[worker] = self.strikes.get(worker, 0) + 1
        if self.strikes[worker] >= self.guard.max_strikes:
            self.drop(worker)
            self.evicted.add(worker)
        else:
            self._wait(worker, now)

    @property
    def pushes_refused(self) -> int:
        """Pushes the guard refused over the whole run (resumes included)."""
        return self.guard.total_refused

    def end_at(self, steps: int) -> None:
        """End this launch after ``steps`` inner steps in all (at most the planned budget);
        the shard schedules keep the whole budget, so a resume continues them."""
        self.total_steps = max(1, min(steps, self.planned_steps))

    def _flush(self) -> None:
        """Sync mode: apply the round's arrivals, in worker order."""
        held, self._held = self._held, {}
        for w in sorted(held):
            self._apply(*held[w])

    # --- scheduling --------------------------------------------------------------------
    def due(self, now: float) -> list[int]:
        """Workers to answer now (their grace period is over, or the sync barrier is met)."""
        if self._held and not self.busy:
            self._flush()  # a worker died while the others' round was held
        if not self.waiting:
            return []
        if self.steps_assigned >= self.total_steps:
            # Nothing left to hand out. Stop orders wait until no round is in flight, since
            # a round lost with a dead worker has to be handed out again.
            if self.busy:
                return []
        elif self.sync:
            if any(w.busy for w in self.live.values()):
                return []
            if len(self.live) + len(self.dead) < self.workers:
                return []  # the first round starts when every worker has said hello
        elif self.deadline is None or now < self.deadline:
            return []
        out, self.waiting, self.deadline = self.waiting, [], None
        return sorted(out) if self.sync else out

    def wake_at(self) -> float | None:
        """When :meth:`due` can next answer without another arrival (a grace period ends);
        None when only an arrival can change anything. For event-driven clocks."""
        if not self.waiting or self.sync:
            return None
        if self.steps_assigned >= self.total_steps and self.busy:
            return None
        return self.deadline

    def work_for(self, worker: int, now: float) -> Work | None:
        """The next round for ``worker``, a stop order once the budget is done, or None.

        None means "wait": the budget is handed out but rounds are still in flight (one of
        them may come back to be redone); ``worker`` is put back among the waiting.
        """
        remaining = self.total_steps - self.steps_assigned
        if remaining <= 0 and self.busy and worker in self.live:
            self._wait(worker, now)
            return None
        if remaining <= 0 or worker not in self.live:
            self.live.pop(worker, None)
            self.retired.add(worker)
            return Work(self.epoch, self.version, stop=True)
        steps = self.local_steps
        if self.use_dylu:
            known = self.speeds.known(worker)
            steps = self.speeds.steps(worker) if known else self.calibration_steps or steps
        steps = min(steps, remaining)
        shard, clock = self.shards.take(worker, steps)
        info = self.live[worker]
        info.busy, info.steps, info.since = True, steps, now
        info.clock, info.planned = clock, self.shards.planned[shard]
        self.steps_assigned += steps
        return Work(self.epoch, self.version, shard, steps, clock, info.planned)

    def overdue(self, now: float, factor: float, floor_s: float) -> list[int]:
        """Busy workers silent for ``max(floor_s, factor * expected round time)``."""
        out = []
        for w, info in self.live.items():
            if not info.busy:
                continue
            expected = self.speeds.expected_round_s(w, info.steps)
            limit = floor_s if expected is None else max(floor_s, factor * expected)
            if now - info.since > limit:
                out.append(w)
        return out

    @property
    def busy(self) -> int:
        return sum(1 for w in self.live.values() if w.busy)

    @property
    def finished(self) -> bool:
        """The budget is handed out (or no worker is left) and no round is in flight."""
        return (self.steps_assigned >= self.total_steps or not self.live) and self.busy == 0

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """theta, outer state (m, Delta, t), versions, shard progress and lr clocks, speeds."""
        return {
            "theta": self.theta.detach().clone(),
            "outer": self.opt.state_dict(),
            "outer_kind": type(self.opt).__name__,
            "epoch": self.epoch,
            "version": self.version,
            "steps_applied": self.steps_applied,
            "updates_applied": self.updates_applied,
            "updates_rejected": self.updates_rejected,
            "updates_dropped": self.updates_dropped,
            "shards": self.shards.state_dict(),
            "speeds": self.speeds.state_dict(),
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; starts a new epoch so older updates are rejected."""
        theta = state["theta"]
        if theta.numel() != self.theta.numel():
            raise ConfigError(
                f"checkpoint holds {theta.numel()} parameters, the model has {self.theta.numel()}"
            )
        if state["outer_kind"] != type(self.opt).__name__:
            raise ConfigError(
                f"checkpoint was written with outer optimizer {state['outer_kind']}, "
                f"this run uses {type(self.opt).__name__}"
            )
        with torch.no_grad():
            self.theta.copy_(theta)
        self.opt.load_state_dict(state["outer"])
        self._resize_buffer()
        self.epoch = int(state["epoch"]) + 1
        self.version = int(state["version"])
        self.steps_applied = self.steps_assigned = int(state["steps_applied"])
        self.updates_applied = int(state["updates_applied"])
        self.updates_rejected = int(state["updates_rejected"])
        self.updates_dropped = int(state.get("updates_dropped", 0))
        self.shards.load_state_dict(state["shards"])
        self.speeds.load_state_dict(state["speeds"])
        self.guard.load_state_dict(state.get("guard", {}))
