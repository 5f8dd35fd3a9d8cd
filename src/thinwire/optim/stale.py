"""When a frozen variance goes stale: the gradients outgrew it after the freeze.

1-bit Adam and 1-bit LAMB freeze Adam's second moment ``v`` and from then on step with
``u = m / (sqrt(v) + eps)``. If the gradients grow well past what ``v`` saw, every step
grows with them, up to the step bound of :mod:`thinwire.optim.step_bound` (1-bit LAMB's
drift factor alone can shrink them by a factor of 2 at most), and the frozen ``v`` no
longer says which elements should move most. The classic case is a plateau: a BERT
classifier on thinwire's model zoo sat at chance for its first ~45 steps, the automatic
freeze capped the warmup there, the loss began to fall a few steps later, and the
gradients (and the steps) grew many times over: the model collapsed to chance and
stayed there (3 seeds of 3 for 1-bit LAMB, 1 of 3 for 1-bit Adam).

:class:`StaleGuard` watches the one number that shows it: how large each rank's own
gradient is, as the frozen variance sees it, ``sum ||g / d||^2`` over the compressed
layers (``d = sqrt(v) + eps``, floored). At the freeze every element of ``g / d`` is
about 1 in size; when the gradients grow by ``G``, the number grows by ``G^2``. Each rank
sends its number in the metadata the 1-bit exchange already carries (8 bytes, no extra
message), and every rank reads the same average. The guard follows an EMA of it
(:data:`LEVEL_BETA`, the momentum's horizon) against its value at the first compressed
step. When the EMA stays above ``growth**2`` times that for ``patience`` steps in a row,
the variance is stale: an automatic freeze goes back to its full-precision warmup (``v``
follows the gradients again, lifted at once to cover the gradients of the first warmup
step) and freezes once more when the statistics settle, at most ``max_rewarmups`` times;
a fixed ``freeze_step`` is the user's choice and is kept, with one warning.

Why the gradients and not the exchanged momentum: the momentum the 1-bit exchange hands
back carries the code's noise, which builds up over the first tens of compressed steps.
On a ReLU MLP whose units half never fire, the exchanged momentum's norm grew 2.8x in 38
steps after the freeze while the gradients grew 1.2x; read as staleness, that growth
switched the step bound on, and its shortened steps left 1-bit LAMB at 0.75 against
LAMB's 0.49 (0.50 with the gradients as the gauge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LEVEL_BETA", "StaleGuard"]

LEVEL_BETA = 0.9
"""EMA rate of the guard's gradient gauge: about the last 10 steps, the horizon of the
momentum that the frozen variance preconditions."""


@dataclass
class StaleGuard:
    """Says when the steps a frozen variance preconditions have grown too far."""

    growth: float = 4.0
    """Stale once the gradients are this many times their size at the first compressed
    step."""
    patience: int = 3
    """Compressed steps in a row above ``growth``: a single noisy step is not enough."""
    max_rewarmups: int = 2
    """Returns to the warmup at most this many times per run (each costs full-precision
    steps); after that the compression stays on, with a warning."""
    reference: float = field(default=0.0, init=False)
    """The gauge at the first compressed step (0: not armed)."""
    level: float = field(default=0.0, init=False)
    """EMA of the gauge since then."""
    over: int = field(default=0, init=False)
    rewarmups: int = field(default=0, init=False)
    warned: bool = field(default=False, init=False)

    def arm(self, reference: float) -> None:
        """Start watching against ``reference`` (0: wait for the first compressed step)."""
        self.reference, self.level, self.over = reference, reference, 0

    def growth_with(self, energy: float) -> float:
        """How many times larger the gradients are than at the first compressed step, once
        this step's gauge ``energy`` is in (the square root of the EMA over its reference;
        1 when not armed). Changes nothing."""
        if not self.reference > 0:
            return 1.0
        level = LEVEL_BETA * self.level + (1 - LEVEL_BETA) * energy
        return math.sqrt(level / self.reference) if math.isfinite(level) else math.inf

    def observe(self, energy: float) -> float | None:
        """One compressed step's gauge (arms the guard on the first); returns the growth
        of the gradients when the variance has gone stale, else None."""
        if not self.reference > 0:
            self.arm(energy)
            return None
        ratio = self.growth_with(energy)
        self.level = LEVEL_BETA * self.level + (1 - LEVEL_BETA) * energy
        self.over = self.over + 1 if ratio > self.growth else 0
        return ratio if self.over >= self.patience else None

    def state_dict(self) -> dict[str, Any]:
        """Numbers only (``torch.distributed.checkpoint`` restores numbers, not flags)."""
        return {
            "reference": self.reference,
            "level": self.level,
            "over": self.over,
            "rewarmups": self.rewarmups,
            "warned": int(self.warned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = float(state["reference"])
        self.level = float(state.get("level", self.reference))
        self.over = int(state["over"])
        self.rewarmups = int(state["rewarmups"])
        self.warned = bool(state["warned"])
