"""The floor under a frozen second moment: what keeps 1-bit steps bounded on any model.

After the freeze, 1-bit Adam and 1-bit LAMB divide the exchanged momentum by the frozen
denominator ``d = sqrt(v_hat) + eps`` of each element. The 1-bit exchange gives every
element of a block an error of about the block's RMS momentum, whatever the element's
own size, so an element whose ``d`` is far below its neighbours' takes a step of
``error / d``: many times the learning rate. On a user's ReLU CNN (2 ranks, freeze at
step 40) 7,519 of the first dense layer's 131,072 second moments were exactly 0 (the
weights behind units that never fired): their ``d`` was ``eps = 1e-8``, the first
compressed steps moved them by ~1e6 x lr, and the run diverged to a loss of 1e26.
Near-dead elements (``d`` a hundredth of their neighbours') blew up one seed in six too.

The floor raises every frozen denominator to at least ``denom_floor`` times the typical
denominator of its layer (parameter tensor): the median over the layer's live elements,
those that saw a gradient of a size that counts (:func:`layer_reference`)::

    d_i <- max(d_i, denom_floor * median_{j in layer(i), live} d_j)

so no element's step exceeds about ``1 / denom_floor`` of a typical step of its layer,
whatever error the 1-bit exchange gives it. The reference is the layer, not the
element's compression block: a unit that never fired empties whole blocks, and when it
comes alive after the freeze (its inputs moved) its momentum is no longer 0, while its
``d`` still is: measured, a CNN whose dead unit revived 9 steps after the freeze
diverged with a block-relative floor. The floor changes nothing where ``d`` is within
``denom_floor`` of its layer's median; it slows only the elements the warmup saw (nearly)
no gradient for, which an exact frozen Adam would step recklessly too once their units
come alive.

Tuning: 0.1 (default) held every zoo model within 3% of its uncompressed baseline over
6 seeds (3 at each size); 0.01 let the ReLU CNN diverge in one seed of six (measured
with the layer's mean as the reference); 0 is the papers' rule. Lower
it for layers whose rows are used rarely but matter (the rows of rare tokens train at
most ``1 / denom_floor`` times slower than Adam would move them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_DENOM_FLOOR",
    "LIVE_SHARE",
    "FloorReport",
    "floor_denominators",
    "layer_reference",
]

DEFAULT_DENOM_FLOOR = 0.1
"""``denom_floor`` of the 1-bit optimizers unless told otherwise (see the module docstring)."""

LIVE_SHARE = 0.01
"""An element counts toward its layer's reference when its ``d`` is at least this share
of the layer's mean ``d`` (:func:`layer_reference`): 100x below the mean, an element is
too quiet to say what a typical step of the layer is. Far from where the floor itself
bites (``denom_floor`` of the median), so it decides only which elements vote."""


@dataclass(frozen=True)
class FloorReport:
    """What the floor did at the freeze (counts over every element of every layer)."""

    elements: int
    zeros: int
    """Second moments that were exactly 0 (the warmup never saw a gradient there)."""
    raised: int
    """Denominators raised to the floor (the zeros among them)."""

    def describe(self) -> str:
        """One clause for the freeze's log line; empty when nothing was raised."""
        if not self.raised:
            return ""
        zeros = (
            f"{self.zeros:,} second moments were 0 (units that never fired?), "
            if self.zeros
            else ""
        )
        return (
            f"{zeros}{self.raised:,} of {self.elements:,} frozen denominators were raised "
            "to the floor of their layer (denom_floor)"
        )


@torch.no_grad()
def floor_denominators(
    denoms: list[torch.Tensor],
    floors: list[float],
    eps: list[float],
    references: list[float | None] | None = None,
) -> FloorReport:
    """Raise each denominator in place to ``floors[k]`` times its layer's reference.

    ``denoms`` are the frozen ``sqrt(v_hat) + eps`` of the compressed parameters;
    ``eps[k]`` tells which entries had ``v = 0`` (their ``d`` equals it).
    ``references``: each layer's :func:`layer_reference`, when ``denoms`` hold only this
    rank's shards of the layers (computed here otherwise).
    """
    total = sum(d.numel() for d in denoms)
    zeros = sum(int((d == e).sum()) for d, e in zip(denoms, eps, strict=True))
    raised = 0
    if references is None:
        references = [layer_reference(d, e) for d, e in zip(denoms, eps, strict=True)]
    for d, k, reference in zip(denoms, floors, references, strict=True):
        if k <= 0 or reference is None:
            continue
        floor = k * reference
        raised += int((d < floor).sum())
        d.clamp_(min=floor)
    return FloorReport(total, zeros, raised)


def layer_reference(denom: torch.Tensor, eps: float) -> float | None:
    """The typical denominator of a layer: the median over its live elements, or None
    when none is. An element is live when its ``d`` is above ``eps`` (its ``v`` is not
    0) and at least :data:`LIVE_SHARE` of the layer's mean ``d``.

    Why the median and not the mean: a layer's denominators are far from alike. In a
    fused query/key/value projection the value rows' gradients are 10-20x the query and
    key rows', so the mean sits near the value rows and a floor at a tenth of it raised
    62% of the tensor on thinwire's GPT (every query and key row), slowing them up to
    10x on a model with no dead unit. The median lies in the bulk of the layer and moves
    little when a few rows are much larger.

    Why only the live elements: when more than half of a layer saw (next to) no
    gradient, the median of all elements is one of theirs and the floor protects
    nothing. Exact zeros are a ReLU layer with most units dead. Near-zeros are the
    rows of a tied byte embedding for the ~190 of 256 bytes a text never uses: after
    1,000 steps of pretraining their ``v`` is ~1e-16 (the output softmax's push on
    logits whose probability is ~0), 1e-4 of the used rows' ``d``. Counted as live,
    they made the median, the floor protected nothing, and the first compressed step
    moved those rows by 15x the embedding's norm (the 1-bit exchange gives them their
    block's momentum; the loss went from 1.9 to 15 in 4 steps).
    """
    mean = float(denom.mean()) if denom.numel() else 0.0
    live = denom[denom > max(eps, LIVE_SHARE * mean)]
    if live.numel() == 0:
        return None
    # The lower median is an element of the layer: no interpolation between two.
    return float(live.median())
