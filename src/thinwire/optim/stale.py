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

:class:`StaleGuard` watches the one number that shows it, the energy ``||x||^2`` of
the momentum the 1-bit exchange carries (preconditioned for 1-bit Adam, layer-scaled for
1-bit LAMB), against its value at the first compressed step. The 1-bit code keeps each
block's norm (its scale is the block's RMS), so the number is read off the exchanged
buffer, on every rank alike; the error feedback's residual adds at most about a factor
of 2 to the norm. When it stays above
``growth**2`` times the freeze's for ``patience`` steps in a row, the variance is stale:
an automatic freeze goes back to its full-precision warmup (``v`` follows the gradients
again, lifted at once to cover the gradients of the first warmup step) and freezes once
more when the statistics settle, at most ``max_rewarmups`` times; a fixed
``freeze_step`` is the user's choice and is kept, with one warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StaleGuard"]


@dataclass
class StaleGuard:
    """Says when the steps a frozen variance preconditions have grown too far."""

    growth: float = 4.0
    """Stale once the exchanged momentum's norm is this many times the first compressed
    step's."""
    patience: int = 3
    """Compressed steps in a row above ``growth``: a single noisy step is not enough."""
    max_rewarmups: int = 2
    """Returns to the warmup at most this many times per run (each costs full-precision
    steps); after that the compression stays on, with a warning."""
    reference: float = field(default=0.0, init=False)
    """``||u||^2`` at the freeze (0: not armed)."""
    over: int = field(default=0, init=False)
    rewarmups: int = field(default=0, init=False)
    warned: bool = field(default=False, init=False)

    def arm(self, reference: float) -> None:
        """Start watching against ``reference`` (0: wait for the first compressed step)."""
        self.reference, self.over = reference, 0

    def observe(self, energy: float) -> float | None:
        """One compressed step's exchanged energy; returns the growth of its norm when the
        variance has gone stale, else None."""
        if not self.reference > 0:
            return None
        ratio = math.sqrt(energy / self.reference) if math.isfinite(energy) else math.inf
        self.over = self.over + 1 if ratio > self.growth else 0
        return ratio if self.over >= self.patience else None

    def state_dict(self) -> dict[str, Any]:
        """Numbers only (``torch.distributed.checkpoint`` restores numbers, not flags)."""
        return {
            "reference": self.reference,
            "over": self.over,
            "rewarmups": self.rewarmups,
            "warned": int(self.warned),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference = float(state["reference"])
        self.over = int(state["over"])
        self.rewarmups = int(state["rewarmups"])
        self.warned = bool(state["warned"])
