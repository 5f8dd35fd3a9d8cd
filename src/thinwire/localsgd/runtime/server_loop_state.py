"""What the server's loop is told, and what it keeps, in two objects.

* :class:`ServeSettings` (frozen): everything :func:`~thinwire.localsgd.runtime.server_loop.serve`
  is told besides the core, the transport, the workers and the model's signature: the
  evaluation and checkpoint hooks and their intervals, the deadlines that declare a
  worker dead or hung, the wall-clock limit, the clock a resumed run continues from, and
  the pull codec.
* :class:`LoopState`: everything the loop changes as it runs: the counters it reports,
  the incarnations admitted, evicted and waiting to rejoin, the pushes whose payloads
  are still arriving, the heartbeats last seen, and when it next evaluates, checkpoints,
  settles rejoins and checks heartbeats. :meth:`LoopState.counters` turns it into the
  counters ``serve`` returns.

:func:`report` runs one evaluation and hands its record on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.localsgd.algorithm.compression import PullEncoder
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.messages import Envelope
from thinwire.localsgd.task import EvalResult, eval_metrics

__all__ = ["RECORD", "LoopState", "ServeSettings", "report"]

RECORD = ("step", "updates", "rejected", "time_s")
"""An evaluation record's own keys; the rest are the evaluation's metrics."""


@dataclass(frozen=True)
class ServeSettings:
    """How :func:`~thinwire.localsgd.runtime.server_loop.serve` runs (defaults: no evaluation, no
    checkpoint, no wall-clock limit, theta pulled whole in fp32)."""

    evaluate: Callable[[torch.Tensor], EvalResult] | None = None
    """``evaluate(theta)``: runs at the start (of a fresh run), every
    :attr:`eval_every_steps` inner steps applied, and at the end."""
    eval_every_steps: int = 0
    """Inner steps applied between evaluations (0: only at the start and the end)."""
    on_eval: Callable[[dict[str, Any]], None] | None = None
    """Receives every evaluation record: ``step``, ``updates``, ``rejected``, ``time_s``,
    ``val_loss`` and any other metrics it names
    (:func:`~thinwire.localsgd.task.eval_metrics`)."""
    checkpoint: Callable[[ServerCore], None] | None = None
    """``checkpoint(core)``: runs every :attr:`checkpoint_every_steps` and at the end."""
    checkpoint_every_steps: int = 0
    """Inner steps applied between checkpoints (0: only at the end)."""
    dead_after_s: float = 10.0
    """A worker whose heartbeat has not moved for this long is dead."""
    hung_after_min_s: float = 600.0
    """A round is hung (its worker dropped) after ``max(hung_after_min_s,
    hung_after_factor * expected round time)``."""
    hung_after_factor: float = 10.0
    """See :attr:`hung_after_min_s`."""
    max_wall_s: float | None = None
    """Raise :class:`TimeoutError` once serving has taken longer than this (None: never)."""
    elapsed_s: float = 0.0
    """Seconds a resumed run had already been served; reported times (``time_s``,
    ``wall_s``) continue from it."""
    pull: PullEncoder | None = None
    """The pull codec (None: theta goes out whole, in fp32)."""


def _next_multiple(done: int, every: int) -> float:
    """The first multiple of ``every`` past ``done`` (inf when ``every`` is 0: never)."""
    return (done // every + 1) * every if every else math.inf


@dataclass
class LoopState:
    """Everything the server's loop keeps between turns (see :meth:`begin`)."""

    start: float
    """When serving began (``time.monotonic``)."""
    clock0: float
    """Where the run's clock reads 0: ``start`` less the time earlier launches served."""
    next_eval: float
    """Inner steps applied at which to evaluate next (inf: never before the end)."""
    next_ckpt: float
    """Inner steps applied at which to checkpoint next (inf: never before the end)."""
    next_beat_check: float
    """When heartbeats are checked next."""
    next_pending_check: float
    """When the rejoins waiting in :attr:`pending` are settled next."""
    bad_told_at: float
    """When malformed messages were last summarised in the log."""
    beats: dict[int, tuple[int, int, float]]
    """worker -> (incarnation watched, its heartbeat count, when that count was seen)."""
    admitted: dict[int, int] = field(default_factory=dict)
    """worker -> incarnation whose link is open."""
    updates: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(worker, incarnation) -> [pushes applied, inner steps they carried]."""
    joins: list[dict[str, Any]] = field(default_factory=list)
    """Every incarnation admitted: worker, incarnation, and when (``time_s``)."""
    reading: dict[int, tuple[Envelope, Future[torch.Tensor]]] = field(default_factory=dict)
    """worker -> the push whose payload is being received on its link's thread."""
    pending: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """worker -> a rejoin waiting to be decided: (its incarnation, the incarnation
    watched, that one's heartbeat count when the rejoin said hello)."""
    banned: set[tuple[int, int]] = field(default_factory=set)
    """Evicted (worker, incarnation)s: whatever they still send is ignored."""
    last: dict[str, Any] = field(default_factory=dict)
    """The latest evaluation record."""
    stale: int = 0
    """Messages from unknown ranks or replaced incarnations, or of a server-to-worker kind."""
    bad: int = 0
    """Malformed messages in the queue."""
    bad_told: int = 0
    """Malformed messages already summarised in the log."""
    forged: int = 0
    """Messages and payloads whose seal failed."""
    refused_rejoins: int = 0
    """Rejoins refused because the incarnation they would replace was seen alive."""
    pushed: int = 0
    """Bytes of push payloads received."""

    @classmethod
    def begin(
        cls, workers: list[int], steps_applied: int, settings: ServeSettings, now: float
    ) -> LoopState:
        """The state of a loop starting at ``now`` with ``steps_applied`` inner steps
        already applied (a resumed run): evaluations and checkpoints continue on their
        intervals from there."""
        return cls(
            start=now,
            clock0=now - settings.elapsed_s,
            next_eval=_next_multiple(steps_applied, settings.eval_every_steps),
            next_ckpt=_next_multiple(steps_applied, settings.checkpoint_every_steps),
            next_beat_check=now,
            next_pending_check=now,
            bad_told_at=now,
            beats={w: (0, -1, now) for w in workers},
        )

    def counters(self, core: ServerCore) -> dict[str, Any]:
        """The run's counters as :func:`~thinwire.localsgd.runtime.server_loop.serve` returns them
        (without the final evaluation's); ``wall_s`` is read now."""
        return {
            "wall_s": time.monotonic() - self.clock0,
            "dead_workers": sorted(core.dead),
            "incarnations": dict(sorted(self.admitted.items())),
            "joins": self.joins,
            "updates_by_incarnation": [
                {"worker": w, "incarnation": i, "updates": n, "inner_steps": s}
                for (w, i), (n, s) in sorted(self.updates.items())
            ],
            "stale_messages": self.stale,
            "malformed_messages": self.bad,
            "unauthenticated_messages": self.forged,
            "refused_rejoins": self.refused_rejoins,
            "evicted_workers": sorted(core.evicted),
            "push_bytes": self.pushed,
        }


def report(
    core: ServerCore,
    evaluate: Callable[[torch.Tensor], EvalResult],
    on_eval: Callable[[dict[str, Any]], None] | None,
    clock0: float,
) -> dict[str, Any]:
    """Evaluate theta now, hand the record to ``on_eval``, and return it; ``time_s`` is
    the run's clock (which reads 0 at ``clock0``)."""
    metrics = eval_metrics(evaluate(core.theta.detach()))  # val_loss first, then the rest
    rec = {
        "step": core.steps_applied,
        "updates": core.updates_applied,
        "rejected": core.updates_rejected,
        "time_s": time.monotonic() - clock0,
    } | metrics
    if on_eval is not None:
        on_eval(rec)
    return rec
