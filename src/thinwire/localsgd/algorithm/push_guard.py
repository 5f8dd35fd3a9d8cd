"""The server checks every push before it applies it.

One bad pseudo-gradient is enough to ruin an asynchronous run: NaN or inf spreads into
theta at the next outer step, and a push a thousand times too large (a worker whose
learning rate is wrong, or one that is not on your side) throws theta far away. The
server applies pushes one at a time, so it can look at each first. :class:`PushGuard`
refuses a push that is

* ``shape``: not one value per parameter;
* ``steps``: not the number of inner steps the server handed out for that round (a
  push that claims more would make the run report steps nobody trained);
* ``timing``: a seconds-per-step that is not a finite positive number (DyLU would
  size every later round from it);
* ``non-finite``: any NaN or inf, or a norm that overflows;
* ``norm``: a norm per inner step at full learning rate more than ``max_ratio`` times
  the median of the last ``history`` accepted pushes' (the median: a few outliers in the
  history do not move it). Until ``warmup`` pushes have been accepted there is no median
  yet and only the other checks apply; the history is part of the server's checkpoint,
  so a resumed run keeps its bound.

The server (:class:`~thinwire.localsgd.algorithm.server_core.ServerCore`) refuses three more kinds
before the payload is even looked at, and counts them here too (:meth:`PushGuard.count`):

* ``epoch``: computed from the theta of another server epoch (before a resume);
* ``version``: tagged with a theta version newer than the one its round was handed
  (it would otherwise pass as perfectly fresh);
* ``duplicate``: sent while the worker had no round in flight, or tagged with an older
  version than its round's (a push of a round already answered): a push sent twice.

The norm is compared per inner step at full learning rate, ``||g|| / sum of the round's
relative inner lr`` (each step's share of the peak lr on the shard's schedule, floored at
1%): DyLU gives slow workers rounds of a few steps and fast ones rounds of H, and a
round moves roughly in proportion to its steps and their learning rate (Adam's steps are
about lr long), which the warmup makes 20 times smaller at first. Measured on the tiny
GPT (``tools/push_norms.py``: simulator, paper speeds 0.58/0.75/1.51/3.33 s per step, H
from 1 to 20, with and without DyLU), the largest ratio of a healthy push to the median
before it was 9; without the lr it reached 17 (H = 1, DyLU, during the warmup). The
default bound of 20 leaves room; a push from a worker with a learning rate of 50 instead
of 3e-3 is thousands of times over.

A refused push is never applied; its round is rewound and handed out again, so the step
budget is still met exactly. Every refusal counts toward stopping its sender: the server
(:class:`~thinwire.localsgd.algorithm.server_core.ServerCore`) stops a worker after ``max_strikes``
refusals in a row, or after ``max_strikes`` refusals of the kinds an honest worker never
sends (:data:`LASTING`), which an accepted push in between does not forgive (a worker
that pushes every round twice is stopped too).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.shards import inner_lr

__all__ = ["LASTING", "REASONS", "PushGuard", "describe"]

REASONS = ("shape", "steps", "timing", "non-finite", "norm", "epoch", "version", "duplicate")
"""Why a push can be refused, as counted in :attr:`PushGuard.refused` (the order is part
of the wire format: :class:`~thinwire.localsgd.messages.Refused` names a reason by its
place here)."""

LASTING = frozenset({"shape", "steps", "timing", "epoch", "version", "duplicate"})
"""Reasons no honest worker produces (a wrong shape, step count, timing, epoch, version,
or a push with no round in flight): an accepted push does not wipe them off the
sender's record. ``non-finite`` and ``norm`` can befall an honest worker once (a loss
spike), so an accepted push forgives those."""

_TEXT = {
    "shape": "not one value per parameter",
    "steps": "it claims other inner steps than its round had",
    "timing": "its seconds per step is not a finite number > 0",
    "non-finite": "NaN or inf values",
    "norm": "far larger than the recent pushes",
    "epoch": "computed from another server epoch's parameters",
    "version": "tagged with a newer parameter version than its round's",
    "duplicate": "a round already pushed, or no round in flight: a push sent twice",
}


def describe(reason: str | None) -> str:
    """``reason``, and what it means in words (for logs and a stopped worker's error)."""
    if reason is None:
        return "unknown"
    return f"{reason} ({_TEXT[reason]})" if reason in _TEXT else reason


class PushGuard:
    """Validation of pushes on the server (see the module docstring).

    Args:
        max_ratio: refuse a push whose norm per inner step exceeds this many times the
            median of recent accepted pushes; 0 turns the norm bound off (the other
            checks stay). Lower it (3-5) to react sooner to a worker going astray;
            raise it if healthy pushes are refused (the log names the ratio).
        history: accepted pushes the median is taken over; 32 spans several rounds of
            every worker, so one lr warmup or one slow worker does not dominate.
        warmup: accepted pushes before the norm bound applies.
        max_strikes: refused pushes in a row (or refusals of the :data:`LASTING` kinds in
            all) after which the server stops the worker.
        lr_warmup, min_lr_ratio: the workers' inner lr schedule (``AsyncConfig``'s
            ``warmup_steps`` and ``min_lr_ratio``), to compare pushes at full lr.
    """

    def __init__(
        self,
        max_ratio: float = 20.0,
        history: int = 32,
        warmup: int = 3,
        max_strikes: int = 3,
        *,
        lr_warmup: int = 0,
        min_lr_ratio: float = 1.0,
    ) -> None:
        if not (max_ratio == 0 or (max_ratio > 1 and math.isfinite(max_ratio))):
            raise ConfigError(f"max push ratio must be 0 (off) or a number > 1, got {max_ratio}")
        if history < 1 or warmup < 1 or warmup > history or max_strikes < 1:
            raise ConfigError(
                f"push history ({history}), warmup ({warmup}) and strikes ({max_strikes}) "
                "must be >= 1, with warmup <= history"
            )
        self.max_ratio = max_ratio
        self.warmup = warmup
        self.max_strikes = max_strikes
        self.lr_warmup, self.min_lr_ratio = lr_warmup, min_lr_ratio
        self.norms: deque[float] = deque(maxlen=history)
        self.refused: dict[str, int] = {}
        self.last_ratio = 0.0
        self.last_refusal: str | None = None

    def check(
        self,
        grad: torch.Tensor,
        steps: int,
        seconds_per_step: float,
        *,
        numel: int,
        expected_steps: int | None,
        max_steps: int,
        lr_clock: int | None = None,
        planned: int = 1,
    ) -> tuple[str | None, float]:
        """``(reason, norm per full-lr step)``: reason None when the push may be applied.

        ``expected_steps``: the round's steps as handed out (None for a worker the
        server had presumed dead, whose round it no longer knows: then 1..``max_steps``).
        ``lr_clock``, ``planned``: where the round started on its shard's lr schedule, and
        the schedule's length (None: unknown, taken as full lr).
        """
        why = self._why(grad, steps, seconds_per_step, numel, expected_steps, max_steps)
        per_step = math.nan
        if why is None:
            norm = float(torch.linalg.vector_norm(grad.detach().float()))
            per_step = norm / self._lr_steps(steps, lr_clock, planned)
            if not math.isfinite(norm):
                why = "non-finite"
            elif self.max_ratio and len(self.norms) >= self.warmup:
                median = statistics.median(self.norms)
                # Pushes of exactly zero (a frozen model, an lr of 0) give the bound no
                # scale: it applies again once the history holds real steps.
                self.last_ratio = per_step / median if median > 0 else 0.0
                if self.last_ratio > self.max_ratio:
                    why = "norm"
        if why is not None:
            self.count(why)
        return why, per_step

    def count(self, why: str) -> None:
        """Count a refusal for ``why`` (one of :data:`REASONS`), whoever decided it."""
        self.refused[why] = self.refused.get(why, 0) + 1
        self.last_refusal = why

    def _why(
        self,
        grad: torch.Tensor,
        steps: int,
        seconds_per_step: float,
        numel: int,
        expected_steps: int | None,
        max_steps: int,
    ) -> str | None:
        if grad.numel() != numel:
            return "shape"
        if steps != expected_steps if expected_steps is not None else not 1 <= steps <= max_steps:
            return "steps"
        if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
            return "timing"
        if not bool(torch.isfinite(grad).all()):
            return "non-finite"
        return None

    def _lr_steps(self, steps: int, lr_clock: int | None, planned: int) -> float:
        if lr_clock is None:
            return float(steps)
        w, floor = self.lr_warmup, self.min_lr_ratio
        shares = (inner_lr(lr_clock + i, planned, 1.0, w, floor) for i in range(steps))
        return sum(max(share, 0.01) for share in shares)

    def accepted(self, per_step: float) -> None:
        """Record an applied push's norm per step."""
        self.norms.append(per_step)

    @property
    def total_refused(self) -> int:
        return sum(self.refused.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": list(self.norms),
            "refused": dict(self.refused),
            "last_ratio": self.last_ratio,
            "last_refusal": self.last_refusal,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms.clear()
        self.norms.extend(float(n) for n in state.get("norms", []))
        self.refused = {str(k): int(v) for k, v in state.get("refused", {}).items()}
        self.last_ratio = float(state.get("last_ratio", 0.0))  # saved before it was kept
        self.last_refusal = state.get("last_refusal")
