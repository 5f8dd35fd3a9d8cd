"""The parameter server of asynchronous Local-SGD, free of any transport or clock.

:class:`ServerCore` holds the global model (theta and the outer optimizer,
:class:`~thinwire.localsgd.algorithm.global_model.GlobalModel`), the workers' roster
(:class:`~thinwire.localsgd.algorithm.roster.Roster`), the DyLU speed table, the shard book and the
budget of inner steps, and decides *what* happens; the
multi-process runtime (:mod:`thinwire.localsgd.runtime.server_loop`) and the virtual-clock
simulator (:mod:`thinwire.localsgd.algorithm.virtual_clock`) only decide *when*: they call
:meth:`~ServerCore.join`, :meth:`~ServerCore.submit`, :meth:`~ServerCore.due` and
:meth:`~ServerCore.work_for` with the current time (wall or virtual), so a simulation
runs exactly the code a real run does.

Mechanics (Liu et al., 2024, https://arxiv.org/abs/2401.09135):

* Each pseudo-gradient is applied on arrival, one at a time, by the outer optimizer
  (Delayed Nesterov with ``N`` = live workers, naive Nesterov, or the asynchronous
  buffer), optionally discounted or dropped by its staleness.
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
  restored from a checkpoint starts a new epoch, and refuses updates tagged with another
  epoch: they were computed from parameters the restored server never had. A push must
  carry the version its round was handed (a future version would pass as fresh), and a
  push from a worker with no round in flight (one sent twice) is refused
  (:meth:`screen`, which the runtime asks before it reads the payload).
* **Dead workers** (:meth:`drop`) leave DN's buffer size and DyLU's reference speed;
  their shard is rewound and freed. A worker that shows up again is simply re-admitted.
* **Checked pushes**: :meth:`submit` applies a push only if the
  :class:`~thinwire.localsgd.algorithm.push_guard.PushGuard` accepts it (finite, one value per
  parameter, the steps handed out, a norm in line with recent pushes). A refused push is
  rewound like a lost round. Every refusal (``epoch``, ``version`` and ``duplicate``
  included) counts toward stopping its sender: after ``guard.max_strikes`` refusals in a
  row, or as many of the kinds no honest worker sends
  (:data:`~thinwire.localsgd.algorithm.push_guard.LASTING`), the worker is *evicted*: dropped like
  a dead one and listed in :attr:`evicted`.
* **Stopping early** (:meth:`end_at`): a run may stop before its budget (``stop_after``)
  and resume later; the shard schedules are planned for the whole budget either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.dylu import SpeedTracker
from thinwire.localsgd.algorithm.global_model import OUTER_CHOICES, STALENESS_CHOICES, GlobalModel
from thinwire.localsgd.algorithm.push_guard import LASTING, PushGuard
from thinwire.localsgd.algorithm.roster import Roster
from thinwire.localsgd.algorithm.shards import ShardBook
from thinwire.localsgd.messages import Work

if TYPE_CHECKING:
    from thinwire.localsgd.config import AsyncConfig

__all__ = ["OUTER_CHOICES", "STALENESS_CHOICES", "ServerCore", "ServerSettings", "Work"]


@dataclass(frozen=True)
class ServerSettings:
    """What a :class:`ServerCore` is built with (besides the initial theta).

    Args:
        workers: W, the number of workers the run is planned for (DN's N by default).
        local_steps: H, inner steps per round (of the fastest worker under DyLU).
        total_steps: inner-step budget of the whole run, summed over workers.
        shard_sizes: tokens per data shard (see :class:`ShardBook`).
        outer, outer_lr, outer_momentum, c, staleness, max_staleness,
            outer_momentum_warmup: the outer optimizer and the staleness rules (see
            :class:`GlobalModel`).
        buffer_size: DN's N; default W.
        dylu: size rounds by measured speed (DyLU) instead of H for everyone.
        grace_s: grace period in seconds (wall or virtual).
        sync: wait for every live worker before answering (synchronous DiLoCo).
        dylu_ema: weight of the old speed in DyLU's average.
        speeds: declared seconds per inner step of each worker (DyLU from the first
            round); None: measured.
        calibration_steps: under DyLU, the first round of a worker whose speed is neither
            declared nor measured yet (0: a full H).
        min_local_steps: DyLU's floor on a round.
        shard_sampling: ``"least-progress"`` or ``"paper"`` (see :class:`ShardBook`).
        seed: seeds the shard sampler.
        guard: the checks every push must pass (default: :class:`PushGuard` defaults).
    """

    workers: int
    local_steps: int
    total_steps: int
    shard_sizes: list[int]
    outer: str = "dn"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_momentum_warmup: int = 0
    buffer_size: int | None = None
    c: float = 0.0
    dylu: bool = False
    grace_s: float = 0.0
    sync: bool = False
    dylu_ema: float = 0.5
    staleness: str = "none"
    max_staleness: int | None = None
    speeds: dict[int, float] | None = None
    calibration_steps: int = 0
    min_local_steps: int = 1
    shard_sampling: str = "least-progress"
    seed: int = 0
    guard: PushGuard | None = None

    def check(self) -> None:
        """Raise :class:`ConfigError` for settings no run can have."""
        if self.workers < 1:
            raise ConfigError(f"asynchronous Local-SGD needs >= 1 worker, got {self.workers}")
        if self.local_steps < 1:
            raise ConfigError(f"local steps H must be >= 1, got {self.local_steps}")
        if self.total_steps < 1:
            raise ConfigError(f"total inner steps must be >= 1, got {self.total_steps}")
        if self.grace_s < 0 or not math.isfinite(self.grace_s):
            raise ConfigError(f"grace period must be a finite number >= 0, got {self.grace_s}")


class ServerCore:
    """Global model (``model``), roster (``roster``) and budget of one asynchronous run.

    Args:
        theta: initial global parameters, flattened (copied).
        settings: everything else (:class:`ServerSettings`). :meth:`of` takes them as
            keywords, :meth:`from_config` from an
            :class:`~thinwire.localsgd.config.AsyncConfig`.
    """

    def __init__(self, theta: torch.Tensor, settings: ServerSettings) -> None:
        settings.check()
        s = settings
        self.model = GlobalModel(
            theta,
            buffer_size=s.workers if s.buffer_size is None else s.buffer_size,
            outer=s.outer,
            outer_lr=s.outer_lr,
            outer_momentum=s.outer_momentum,
            c=s.c,
            staleness=s.staleness,
            max_staleness=s.max_staleness,
        )
        self.model.ramp_momentum(s.outer_momentum_warmup)
        self.theta, self.opt = self.model.theta, self.model.opt  # the model's, for reading
        self.workers = s.workers
        self.local_steps = s.local_steps
        self.total_steps = s.total_steps
        self.use_dylu = s.dylu
        self.sync = s.sync
        self.calibration_steps = min(s.calibration_steps, s.local_steps)
        self.speeds = SpeedTracker(s.local_steps, ema=s.dylu_ema, min_steps=s.min_local_steps)
        if s.speeds:
            self.speeds.declare(s.speeds)
        self.shards = ShardBook(
            s.shard_sizes, s.total_steps, sampling=s.shard_sampling, seed=s.seed
        )
        self.epoch = 0
        self.steps_assigned = 0
        self.updates_rejected = 0
        self.roster = Roster(s.grace_s)
        # The roster's own containers, which it only ever changes in place: live workers
        # and their rounds, and those dead, sent home, or evicted for their pushes.
        self.live, self.dead = self.roster.live, self.roster.dead
        self.retired, self.evicted = self.roster.retired, self.roster.evicted
        self.planned_steps = s.total_steps  # the whole run's budget; total_steps: this launch's
        self.guard = s.guard or PushGuard()

    @classmethod
    def of(cls, theta: torch.Tensor, **settings: Any) -> ServerCore:
        """``ServerCore.of(theta, workers=..., local_steps=..., ...)``: the settings of
        :class:`ServerSettings` as keywords."""
        return cls(theta, ServerSettings(**settings))

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
        return cls.of(
            theta,
            workers=workers,
            local_steps=cfg.local_steps,
            total_steps=cfg.steps * workers,
            shard_sizes=shard_sizes,
            outer=cfg.outer,
            outer_lr=cfg.resolved_outer_lr(),
            outer_momentum=cfg.resolved_outer_momentum(),
            outer_momentum_warmup=cfg.outer_momentum_warmup,
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

    # --- the global model's counters --------------------------------------------------
    @property
    def version(self) -> int:
        return self.model.version

    @property
    def steps_applied(self) -> int:
        return self.model.steps_applied

    @property
    def updates_applied(self) -> int:
        return self.model.updates_applied

    @property
    def updates_dropped(self) -> int:
        return self.model.updates_dropped

    @property
    def staleness_seen(self) -> dict[int, int]:
        return self.model.staleness_seen

    # --- membership --------------------------------------------------------------------
    def join(self, worker: int, now: float) -> None:
        """``worker`` (new or restarted) wants parameters."""
        self._admit(worker)
        self.roster.wait(worker, now)

    def drop(self, worker: int) -> None:
        """``worker`` is dead: forget its round, its speed and its place in DN's buffer."""
        info = self.roster.remove(worker)
        if info is None:
            return
        if info.busy:
            self._rewind(worker, info.steps)
        self.speeds.remove(worker)
        self.model.resize(len(self.dead))

    def _admit(self, worker: int) -> None:
        if self.roster.admit(worker):  # back from the dead: DN's N grows back
            self.model.resize(len(self.dead))

    def _rewind(self, worker: int, steps: int) -> None:
        """``worker``'s round is lost: its steps and its place on the shard go back."""
        self.steps_assigned -= steps
        self.shards.release(worker, completed=False)

    # --- updates -----------------------------------------------------------------------
    def screen(self, worker: int, epoch: int, version: int | None) -> str | None:
        """Why a push ``worker`` announces must be refused before its payload is read
        (``epoch``, ``version`` or ``duplicate``, see
        :mod:`~thinwire.localsgd.algorithm.push_guard`); None if it may be checked and
        applied. Changes nothing."""
        if epoch != self.epoch:
            return "epoch"
        info = self.live.get(worker)
        if info is None:
            # Presumed dead (or never admitted): it may come back with the round it was on,
            # whose version the server no longer knows; it cannot be newer than theta's.
            return "version" if version is not None and version > self.version else None
        if not info.busy:
            return "duplicate"
        if version is not None and version != info.version:
            # Older: a round this worker already pushed (sent again); newer: no such round.
            return "duplicate" if version < info.version else "version"
        return None

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
        sync mode: accepted for the round); False if it was staler than ``max_staleness``
        (dropped: its steps count as spent, as the paper's PolyThres has it) or refused: by
        :meth:`screen` (another epoch, another version, no round in flight) or by the guard.
        A refused push changes nothing but the counters, counts toward stopping its sender,
        and its round is handed out again."""
        if worker in self.evicted:
            return False  # a leftover of a worker stopped for its pushes
        early = self.screen(worker, epoch, version)
        known = worker in self.live
        self._admit(worker)
        info = self.live[worker]
        was_busy, info.busy = info.busy, False
        if early is not None:
            if early == "epoch":
                self.updates_rejected += 1  # the evaluation records' count, as before
            self.guard.count(early)
            self._refuse(worker, early, was_busy, now)
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
            self._refuse(worker, why, was_busy, now)
            return False
        self.roster.forgive(worker)
        self.guard.accepted(per_step)
        if not (known and was_busy):
            self.steps_assigned += steps  # a worker presumed dead came back with its round
        self.shards.release(worker, completed=True)
        self.speeds.report(worker, seconds_per_step)
        grad = pseudo_grad.reshape(-1).to(self.theta.dtype)
        tau = self.model.staleness_of(version)
        applied = True
        if self.sync:
            self.model.hold(worker, grad, steps, tau)
            if not any(w.busy for w in self.live.values()):
                self.model.flush()
        else:
            applied = self.model.apply(grad, steps, tau)
        self.roster.wait(worker, now)
        return applied

    def _refuse(self, worker: int, why: str, was_busy: bool, now: float) -> None:
        if was_busy:
            self._rewind(worker, self.live[worker].steps)
        if self.roster.strike(worker, self.guard.max_strikes, lasting=why in LASTING):
            self.drop(worker)
            self.evicted.add(worker)
        else:
            self.roster.wait(worker, now)

    def refuse_unread(self, worker: int, why: str, now: float) -> None:
        """Count ``worker``'s push refused by :meth:`screen` before its payload was read
        (the runtime then closes the link, whose state it can no longer trust), and evict
        ``worker``: its round is rewound and handed out again."""
        if why == "epoch":
            self.updates_rejected += 1
        self.guard.count(why)
        self.roster.strike(worker, self.guard.max_strikes, lasting=why in LASTING)
        self.drop(worker)
        self.evicted.add(worker)

    @property
    def pushes_refused(self) -> int:
        """Pushes the guard refused over the whole run (resumes included)."""
        return self.guard.total_refused

    def end_at(self, steps: int) -> None:
        """End this launch after ``steps`` inner steps in all (at most the planned budget);
        the shard schedules keep the whole budget, so a resume continues them."""
        self.total_steps = max(1, min(steps, self.planned_steps))

    # --- scheduling --------------------------------------------------------------------
    def due(self, now: float) -> list[int]:
        """Workers to answer now (their grace period is over, or the sync barrier is met)."""
        if self.model.holding and not self.busy:
            self.model.flush()  # a worker died while the others' round was held
        if not self.roster.waiting:
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
        elif self.roster.deadline is None or now < self.roster.deadline:
            return []
        return self.roster.take_waiting(ordered=self.sync)

    def wake_at(self) -> float | None:
        """When :meth:`due` can next answer without another arrival (a grace period ends);
        None when only an arrival can change anything. For event-driven clocks."""
        if not self.roster.waiting or self.sync:
            return None
        if self.steps_assigned >= self.total_steps and self.busy:
            return None
        return self.roster.deadline

    def work_for(self, worker: int, now: float) -> Work | None:
        """The next round for ``worker``, a stop order once the budget is done, or None.

        None means "wait": the budget is handed out but rounds are still in flight (one of
        them may come back to be redone); ``worker`` is put back among the waiting.
        """
        remaining = self.total_steps - self.steps_assigned
        if remaining <= 0 and self.busy and worker in self.live:
            self.roster.wait(worker, now)
            return None
        if remaining <= 0 or worker not in self.live:
            self.roster.retire(worker)
            return Work(self.epoch, self.version, stop=True)
        steps = self.local_steps
        if self.use_dylu:
            known = self.speeds.known(worker)
            steps = self.speeds.steps(worker) if known else self.calibration_steps or steps
        steps = min(steps, remaining)
        shard, clock = self.shards.take(worker, steps)
        info = self.live[worker]
        info.busy, info.steps, info.since = True, steps, now
        info.clock, info.planned, info.version = clock, self.shards.planned[shard], self.version
        self.steps_assigned += steps
        return Work(self.epoch, self.version, shard, steps, clock, info.planned)

    def overdue(self, now: float, factor: float, floor_s: float) -> list[int]:
        """Busy workers silent for ``max(floor_s, factor * expected round time)``."""
        return self.roster.overdue(now, factor, floor_s, self.speeds.expected_round_s)

    @property
    def busy(self) -> int:
        """Rounds in flight."""
        return self.roster.busy

    @property
    def finished(self) -> bool:
        """The budget is handed out (or no worker is left) and no round is in flight."""
        return (self.steps_assigned >= self.total_steps or not self.live) and self.busy == 0

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """theta, outer state (m, Delta, t), versions, shard progress and lr clocks, speeds."""
        return {
            **self.model.state_dict(),
            "epoch": self.epoch,
            "updates_rejected": self.updates_rejected,
            "shards": self.shards.state_dict(),
            "speeds": self.speeds.state_dict(),
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; starts a new epoch so older updates are rejected."""
        self.model.load_state_dict(state)
        self.model.resize(len(self.dead))
        self.epoch = int(state["epoch"]) + 1
        self.steps_assigned = self.model.steps_applied
        self.updates_rejected = int(state["updates_rejected"])
        self.shards.load_state_dict(state["shards"])
        self.speeds.load_state_dict(state["speeds"])
        self.guard.load_state_dict(state.get("guard", {}))

    def snapshot(self) -> dict[str, Any]:
        """The whole server as it stands, rounds in flight included: for the same run to
        go on from here in another process (:meth:`restore`; the simulator's
        checkpoints). :meth:`state_dict` is a relaunch's instead: a new epoch, whose
        workers join again and whose rounds in flight are handed out again."""
        return {
            "model": self.model.snapshot(),
            "roster": self.roster.state_dict(),
            "shards": self.shards.snapshot(),
            "speeds": self.speeds.state_dict(),
            "guard": self.guard.state_dict(),
            "epoch": self.epoch,
            "steps_assigned": self.steps_assigned,
            "updates_rejected": self.updates_rejected,
            "total_steps": self.total_steps,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`snapshot` as if never stopped (same epoch, same rounds in
        flight), on a server built with the same settings."""
        self.model.restore(state["model"])
        self.roster.load_state_dict(state["roster"])
        self.shards.restore(state["shards"])
        self.speeds.load_state_dict(state["speeds"])
        self.guard.load_state_dict(state["guard"])
        self.epoch = int(state["epoch"])
        self.steps_assigned = int(state["steps_assigned"])
        self.updates_rejected = int(state["updates_rejected"])
        self.total_steps = int(state["total_steps"])
