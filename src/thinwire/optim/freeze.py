"""When a 1-bit optimizer stops its full-precision warmup: read from the run.

1-bit Adam and 1-bit LAMB freeze Adam's second moment ``v`` and from then on exchange
only the 1-bit compressed momentum. The papers fix the switch by hand (15-25% of the run
for BERT), and the right point depends on the data, the learning rate and the model:
frozen too early, ``v`` still carries the large gradients of the first steps (or misses
those of rare tokens) and the compressed stage stalls or blows up; frozen too late, the
warmup's full-precision gradients cost most of the run's bytes.

:class:`AutoFreeze` watches the quantity that will be frozen, the denominator
``d = sqrt(v_hat) + eps`` of every element, and switches once it has settled::

    every `window` warmup steps:
        change = sum |d_t - d_(t-window)| / sum d_(t-window)     (all elements, all layers)
    freeze when change < tolerance for `patience` checks in a row (and step >= min_step),
    or at max_step whatever the change.

``v`` is computed from gradients averaged over the ranks, so every rank measures the
same change; the optimizer still takes rank 0's decision to be safe (one tiny broadcast
per check). In the spirit of 0/1 Adam (arXiv 2202.06009), which measured that the
variance changes slowly after an early phase, and of the 1-bit LAMB analysis, which
rests on a stable frozen variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from thinwire.optim.sharded import local, sum_over

__all__ = ["DEFAULT_CAP_SHARE", "NO_FREEZE_WARNING_STEP", "AutoFreeze", "relative_change"]

DEFAULT_CAP_SHARE = 0.3
"""Share of a run of known length after which the automatic freeze switches whatever
the statistics say: 30% bounds the warmup's full-precision bytes at about a third of an
uncompressed run's (``thinwire train``, and the optimizers given ``total_steps``)."""

NO_FREEZE_WARNING_STEP = 100
"""A warmup of unknown length that has not settled by this step says so, once."""


def relative_change(
    current: list[torch.Tensor],
    reference: list[torch.Tensor],
    island: dist.ProcessGroup | None = None,
) -> float:
    """``sum |current - reference| / sum |reference|`` over every element of every tensor
    (of every shard, for FSDP2 shards: DTensors, or plain shards split over ``island``)."""
    pairs = [(local(c), local(r)) for c, r in zip(current, reference, strict=True)]
    device = pairs[0][0].device if pairs else None
    totals = [0.0, 0.0]
    if pairs:  # per-tensor sums stay on the device and are read back in one host sync
        sums = [torch.stack([torch.sub(c, r).abs_().sum(), r.abs().sum()]) for c, r in pairs]
        totals = torch.stack([x.to(device) for x in sums]).double().sum(dim=0).tolist()
    num, den = sum_over(totals, island, device)
    return num / den if den > 0 else math.inf


@dataclass
class AutoFreeze:
    """The rule that ends the warmup once the second moment has settled.

    Pass ``freeze_step="auto"`` (these defaults) or ``freeze_step=AutoFreeze(...)`` to
    :class:`~thinwire.optim.OneBitLamb` or :class:`~thinwire.optim.OneBitAdam`. After the
    switch, :attr:`decided_at` holds the step and :attr:`reason` why (``"settled"`` or
    ``"cap"``); :attr:`history` holds every ``(step, change)`` measured.
    """

    tolerance: float = 0.05
    """Freeze once the denominator changes by less than this fraction per window. Lower
    waits longer (more full-precision bytes, a more representative frozen variance)."""
    window: int = 10
    """Warmup steps between two measurements. Longer windows average out the noise of
    single batches; the change per window grows with it, so scale ``tolerance`` too."""
    patience: int = 2
    """Measurements in a row that must be under ``tolerance``: one calm window after a
    noisy start is not enough."""
    min_step: int = 0
    """Never freeze before this step, e.g. the end of the learning-rate warmup: while the
    learning rate still rises, the gradients (and so ``v``) keep changing."""
    max_step: int = 10_000
    """Freeze here at the latest, settled or not: the bound on the warmup's cost. The
    trainer sets it to 30% of the run."""
    decided_at: int | None = field(default=None, init=False)
    reason: str | None = field(default=None, init=False)
    history: list[tuple[int, float]] = field(default_factory=list, init=False)
    _calm: int = field(default=0, init=False, repr=False)

    @classmethod
    def for_run(
        cls,
        total_steps: int,
        share: float = DEFAULT_CAP_SHARE,
        min_step: int = 0,
        tolerance: float = 0.05,
    ) -> AutoFreeze:
        """The rule for a run of ``total_steps`` optimizer steps: switch once the
        statistics settle, after ``min_step`` (e.g. the end of the learning-rate warmup),
        and after ``share`` of the run at the latest (but never inside ``min_step``)."""
        if isinstance(total_steps, bool) or int(total_steps) != total_steps or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
        if not 0 < share <= 1:
            raise ValueError(f"the freeze's share of the run must be in (0, 1], got {share}")
        cap = max(1, math.ceil(share * total_steps), min_step)
        return cls(tolerance=tolerance, min_step=min_step, max_step=cap)

    def __post_init__(self) -> None:
        for name, value in (("window", self.window), ("patience", self.patience)):
            if value < 1:
                raise ValueError(f"AutoFreeze {name} must be >= 1, got {value}")
        if not self.tolerance > 0 or not math.isfinite(self.tolerance):
            raise ValueError(
                f"AutoFreeze tolerance must be a positive number, got {self.tolerance}"
            )
        if self.min_step < 0:
            raise ValueError(f"AutoFreeze min_step must be >= 0, got {self.min_step}")
        if self.max_step < max(1, self.min_step):
            raise ValueError(
                f"AutoFreeze max_step must be >= max(1, min_step={self.min_step}), "
                f"got {self.max_step}"
            )

    def is_check_step(self, step: int) -> bool:
        """Whether the warmup step ``step`` (1-based) ends a window."""
        return step % self.window == 0

    def decide(self, step: int, change: float | None) -> str | None:
        """Record the change measured at ``step`` (None: not a check step, or no reference
        yet) and say whether the warmup ends with this step: the reason (``"settled"`` or
        ``"cap"``) or None. Nothing is final until :meth:`commit`."""
        if change is not None:
            self.history.append((step, change))
            self._calm = self._calm + 1 if change < self.tolerance else 0
        if step >= self.max_step:
            return "cap"
        if step >= self.min_step and self._calm >= self.patience:
            return "settled"
        return None

    def restart(self, step: int, max_step: int) -> None:
        """Undo the decision: the warmup goes on from ``step`` (a stale freeze, see
        :mod:`thinwire.optim.stale`) and ends once settled, at ``max_step`` at the latest.
        The history is kept."""
        self.decided_at, self.reason, self._calm = None, None, 0
        self.min_step, self.max_step = step, max(step + 1, max_step)

    def commit(self, step: int, reason: str) -> None:
        """The warmup ended with ``step``, for ``reason``."""
        if reason not in self.REASONS[1:]:
            raise ValueError(f"unknown reason {reason!r}")
        self.decided_at, self.reason = step, reason

    def pending(self) -> str:
        """One clause for a warmup that has not ended: what the rule waits for."""
        wait = (
            f"freezes once they change less than {self.tolerance:.1%} per {self.window} "
            f"steps, {self.patience} times in a row, and at step {self.max_step:,} at the latest"
        )
        if not self.history:
            return f"no measurement of the statistics yet ({wait})"
        return (
            f"the statistics it freezes still changed {self.history[-1][1]:.1%} over the "
            f"last {self.window} steps ({wait})"
        )

    def describe(self) -> str:
        """One line for the log: when and why the warmup ended."""
        if self.decided_at is None:
            return "still in warmup"
        if self.reason == "cap":
            if not self.history:
                return f"warmup capped at step {self.decided_at}, before a first measurement"
            return (
                f"warmup capped at step {self.decided_at}; its statistics still changed "
                f"{self.history[-1][1]:.1%} per {self.window} steps "
                f"(tolerance {self.tolerance:.1%})"
            )
        last = f"{self.history[-1][1]:.1%}"
        return (
            f"warmup statistics settled at step {self.decided_at}: they changed {last} over "
            f"the last {self.window} steps (tolerance {self.tolerance:.1%})"
        )

    REASONS: ClassVar[tuple[str | None, ...]] = (None, "settled", "cap")
    """Reasons by code, as they travel between ranks and in checkpoints."""

    def state_dict(self) -> dict[str, float | int | list[float]]:
        """Numbers only (``torch.distributed.checkpoint`` restores numbers, not strings)."""
        return {
            "decided_at": -1 if self.decided_at is None else self.decided_at,
            "reason": self.REASONS.index(self.reason),
            "history": [x for step, change in self.history for x in (float(step), change)],
            "calm": self._calm,
            "min_step": self.min_step,
            "max_step": self.max_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        decided = int(state["decided_at"])
        self.decided_at = None if decided < 0 else decided
        self.reason = self.REASONS[int(state["reason"])]
        flat = [float(x) for x in state["history"]]
        self.history = [(int(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        self._calm = int(state["calm"])
        # Moved by restart(); states saved before it existed keep the configured ones.
        self.min_step = int(state.get("min_step", self.min_step))
        self.max_step = int(state.get("max_step", self.max_step))
