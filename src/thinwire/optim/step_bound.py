"""The step bound: a compressed step stays within reach of the uncompressed optimizer's.

After the freeze, 1-bit Adam steps with ``m / d`` and 1-bit LAMB with
``c_freeze * f * m / d``, where ``d = sqrt(v) + eps`` is the frozen variance's
denominator. Adam and LAMB keep their steps at a steady length whatever the size of the
gradients: Adam's ``v`` grows with them, and LAMB's trust ratio ``||w|| / ||u||`` makes
every layer's step ``lr * ||w||``. The compression stage has neither: when the gradients
grow past what the frozen ``v`` saw, every step grows with them. 1-bit LAMB's drift
factor ``f`` may shrink the steps by a factor of 2 at most (the paper's bound), and a
layer's step grew 10-40x on thinwire's model zoo, where a BERT classifier sits at chance
for its first ~45 steps and then learns within ~20 with gradient norms 10-40x larger
than on the plateau. A freeze on the plateau, or during the drop, sent both optimizers to
chance (1-bit LAMB on 3 seeds of 3 at the zoo's larger size); a freeze after it too (at
step 100: 2 seeds of 3), since the gradients there jump by 30x from batch to batch.

The bound restores each optimizer's own guarantee, layer by layer, on the update it is
about to apply (the exchanged momentum over the frozen denominator, after the floor of
:mod:`thinwire.optim.floor`):

* **1-bit LAMB**: the layer's ratio ``c_freeze * f`` is at most ``step_bound`` times
  LAMB's own ratio on that update, ``clamp(||w|| / ||u||, min_coeff, max_coeff)``: the
  step is never longer than ``step_bound`` LAMB steps.
* **1-bit Adam**: the layer's update ``u`` is scaled down to at most ``step_bound``
  times the norm of its warmup updates (an average over the last ~10 warmup steps,
  ``state["step_norm_ref"]``): where Adam's growing ``v`` would have kept it.

The direction is kept, and so is error feedback: the bound shortens the applied step,
not the exchanged momentum, so the compression error still returns in later steps. It
applies only while the variance is going stale, once a measure has grown past
:data:`ONSET` times its value at the first compressed step: the gradients
(:class:`GradientGauge`) for 1-bit LAMB, the exchanged momentum (the stale guard's
measure) for 1-bit Adam (``onset_reads_gradients`` of each class says why). Before
that, the 1-bit code's noise makes the exchanged momentum longer than the uncompressed
one, error feedback takes the excess back in later steps, and bounding it shortens good
steps.

Measured (BERT classifier at the zoo's larger size, 2 ranks, 150 steps, seeds 0-2;
LAMB 0.972, AdamW 0.986):

===================================  ===================  ===================
freeze                               without the bound    ``step_bound=2``
===================================  ===================  ===================
1-bit LAMB, automatic (30% cap)      0.526, 0.494, 0.528  0.967, 0.993, 0.999
1-bit LAMB, ``freeze_step=100`` (*)  1.000, 0.592, 0.486  1.000, 1.000, 1.000
1-bit Adam, automatic (30% cap)      0.987, 0.997, 0.787  0.977, 0.997, 0.979
1-bit Adam, ``freeze_step=75`` (*)   0.682, 0.990, 0.999  0.985, 1.000, 0.995
===================================  ===================  ===================

(*) measured with the bound on every compressed step, before it waited for
:data:`ONSET`.

Tuning: 2 (default) leaves room for the 1-bit exchange's noise, which adds to the norm
of the exchanged momentum (the error feedback's residual, up to about 2x). At 1 the
bound held BERT as well, but it also shortened ordinary compressed steps: 1-bit Adam on
the two language models ended 3.8% and 4.2% above AdamW's loss (0.5% and 0.8% without
the bound), and 1-bit LAMB went from 2.3% below LAMB's loss to 0.8% above it. ``None`` is the
papers' rule (no bound). A bound that shortens most compressed steps
(:attr:`~thinwire.optim.OneBitLamb.bounded_steps` close to the count of compressed steps)
says the variance was frozen too early for this model: a later ``freeze_step``
compresses with longer steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.optim.base import check_range

__all__ = [
    "DEFAULT_STEP_BOUND",
    "GAUGE_BETA",
    "ONSET",
    "REF_BETA",
    "GradientGauge",
    "bound_adam_update",
    "bound_lamb_ratio",
    "check_step_bound",
    "track_adam_update",
]

DEFAULT_STEP_BOUND = 2.0
"""A compressed step is at most two uncompressed steps long (see the table above)."""

ONSET = 2.0
"""The bound applies to a compressed step only once its onset measure (the gradients for
1-bit LAMB, the exchanged momentum for 1-bit Adam) is this many times its value at the
first compressed step."""

REF_BETA = 0.9
"""EMA rate of the warmup's update norm (1-bit Adam): about the last 10 warmup steps,
like 1-bit LAMB's trust-ratio EMA."""


GAUGE_BETA = 0.9
"""EMA rate of :class:`GradientGauge`: about the last 10 steps, the momentum's horizon."""


@dataclass
class GradientGauge:
    """How much the gradients have grown since the first compressed step, as the frozen
    variance sees them.

    Each rank adds up ``||g / d||^2`` over its compressed layers (its own gradients over
    the frozen ``d = sqrt(v) + eps``: every element is about 1 in size at the freeze);
    the number travels in the metadata that the 1-bit exchange sends anyway (8 bytes, no
    extra message), and every rank reads the same average. The gauge follows an EMA of
    its square root (like the momentum, one batch 30x larger than the rest moves it by
    3x, not 9x) against its value at the first compressed step.

    Why not the exchanged momentum's norm: the 1-bit code's noise alone grows it. On a
    ReLU MLP half of whose units never fire (frozen at step 20 of 60) it grew 2.8x in 38
    steps while the gradients grew 1.2x; read as a stale variance it switched the bound
    on, and the shortened steps left 1-bit LAMB at 0.75 against LAMB's 0.49 (0.50 with
    this gauge).
    """

    reference: float = field(default=0.0)
    """The square root of the gauge at the first compressed step (0: not armed)."""
    level: float = field(default=0.0)
    """Its EMA since then."""

    def arm(self) -> None:
        """Wait for the first compressed step (after each freeze)."""
        self.reference = self.level = 0.0

    def _level_with(self, energy: float) -> float:
        norm = math.sqrt(energy) if energy >= 0 else math.nan
        return GAUGE_BETA * self.level + (1 - GAUGE_BETA) * norm

    def growth_with(self, energy: float) -> float:
        """The growth once this step's ``energy`` is in (1 when not armed); changes nothing."""
        if not self.reference > 0:
            return 1.0
        level = self._level_with(energy)
        return level / self.reference if math.isfinite(level) else math.inf

    def observe(self, energy: float) -> None:
        """Take one compressed step's number (the first one arms the gauge)."""
        if not self.reference > 0:
            self.reference = self.level = math.sqrt(max(energy, 0.0))
        else:
            self.level = self._level_with(energy)

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "level": self.level}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference, self.level = float(state["reference"]), float(state["level"])


def check_step_bound(step_bound: float | None) -> None:
    """Refuse a bound that is not None or a positive finite number, in one line."""
    if step_bound is not None:
        check_range("step_bound", step_bound, 0.0, float("inf"), lo_open=True, hi_open=True)


def bound_lamb_ratio(coeff: float, lamb_ratio: float, bound: float | None) -> tuple[float, bool]:
    """1-bit LAMB's layer ratio ``coeff``, at most ``bound`` times LAMB's own trust ratio
    ``lamb_ratio`` on the same update (weight decay included); and whether the bound
    shortened it."""
    if bound is None:
        return coeff, False
    limit = bound * lamb_ratio
    return (limit, True) if coeff > limit else (coeff, False)


def track_adam_update(state: dict, norm: torch.Tensor) -> None:
    """Feed one warmup update's norm (the whole layer's, a 0-dim tensor) into the layer's
    reference (an EMA, on the device: no host synchronisation per layer)."""
    ref = state.get("step_norm_ref")
    if ref is None:
        state["step_norm_ref"] = norm.clone()
    else:
        ref.mul_(REF_BETA).add_(norm, alpha=1 - REF_BETA)


def bound_adam_update(
    state: dict, u: torch.Tensor, bound: float | None, norm: torch.Tensor | None
) -> torch.Tensor | None:
    """Scale the compressed update ``u`` down (in place) to at most ``bound`` times the
    layer's warmup norm; ``norm`` is ``u``'s (the whole layer's). Returns a 0-dim
    tensor, 1 where the bound shortened the step (None when there is no bound, or no
    reference: state saved before it existed)."""
    ref = state.get("step_norm_ref")
    if bound is None or ref is None or norm is None:
        return None
    limit = ref * bound
    # min(1, limit / norm) without a branch on the host; a zero update stays zero.
    scale = torch.where(norm > limit, limit / norm.clamp_min(torch.finfo(u.dtype).tiny), 1.0)
    u.mul_(scale)
    return (norm > limit).to(torch.int64)
