"""Stop a diverged run with a clear message, before it saves a bad checkpoint.

A run whose loss turned non-finite, blew up far past where it started, or whose
optimizer skipped most steps (the 1-bit optimizers and LAMB skip a step whose averaged
gradient is not finite) is not training any more. Left alone it ends with exit status 0
and a summary that looks like a result. :class:`DivergenceGuard` checks every metric
record and every validation pass, and raises :class:`~thinwire.errors.DivergedError`
at the first sign; the trainer calls it before it would write a checkpoint of that step,
so the newest checkpoint on disk is the last one taken while the run was healthy.

The values it sees are the same on every rank (the loss is the all-reduced mean, the
skipped-step count follows from the averaged gradients), so every rank stops at the
same step and none is left waiting in a collective.

Tuning: the defaults flag only what is clearly broken. A byte-level language model
starts near ``ln(256) = 5.5`` nats; a healthy run's loss spikes stay within a small
multiple of that (the largest seen in thinwire's benchmarks is 8.3, a 1.5x spike),
while the diverged 1-bit Adam run of the issue reached 3708.
"""

from __future__ import annotations

import math

from thinwire.errors import DivergedError

__all__ = ["DivergenceGuard"]


class DivergenceGuard:
    """Raises :class:`DivergedError` when the run has diverged.

    Args:
        reference_loss: the loss of a uniform guess, ``ln(vocabulary)`` for a language
            model (about where a fresh model starts); the blow-up bound is relative to it.
        blowup_factor: the run has diverged when the mean training loss or the
            validation loss exceeds ``blowup_factor * reference_loss``. 4 leaves room for
            the spikes of aggressive learning rates; lower it to stop bad runs sooner.
        max_skipped_fraction: the run has diverged when more than this share of its
            steps so far were skipped (non-finite averaged gradients), counted once at
            least ``min_steps`` steps are done. A few skipped steps are normal right
            after a learning-rate change; most steps skipped means no training.
        min_steps: steps before the skipped-step rule applies.
        last_checkpoint: describes the newest checkpoint for the message (updated by
            :meth:`saved`).
    """

    def __init__(
        self,
        reference_loss: float,
        blowup_factor: float = 4.0,
        max_skipped_fraction: float = 0.5,
        min_steps: int = 10,
        last_checkpoint: int | None = None,
    ) -> None:
        if not (math.isfinite(reference_loss) and reference_loss > 0):
            raise ValueError(f"reference_loss must be finite and > 0, got {reference_loss}")
        self.bound = blowup_factor * reference_loss
        self.max_skipped_fraction = max_skipped_fraction
        self.min_steps = min_steps
        self.last_checkpoint = last_checkpoint

    def saved(self, step: int) -> None:
        """Record that a checkpoint of ``step`` is now the newest one."""
        self.last_checkpoint = step

    def _fail(self, step: int, what: str) -> None:
        kept = (
            f"the last good checkpoint, step {self.last_checkpoint}, is kept for --resume"
            if self.last_checkpoint
            else "no checkpoint was written (start again in another --out)"
        )
        raise DivergedError(
            f"the run diverged at step {step}: {what}; {kept}. Lower --lr, or raise "
            "--warmup-steps or --freeze-step"
        )

    def check_train(self, step: int, loss: float, skipped_steps: int | None = None) -> None:
        """Check a metric record: the mean training loss and the skipped-step count."""
        if not math.isfinite(loss):
            self._fail(step, f"training loss is {loss}")
        if loss > self.bound:
            self._fail(step, f"training loss {loss:.4g} is past {self.bound:.3g}")
        many = skipped_steps is not None and skipped_steps > self.max_skipped_fraction * step
        if many and step >= self.min_steps:
            self._fail(step, f"{skipped_steps} of {step} steps were skipped (non-finite gradients)")

    def check_val(self, step: int, val_loss: float) -> None:
        """Check a validation loss."""
        if not math.isfinite(val_loss):
            self._fail(step, f"validation loss is {val_loss}")
        if val_loss > self.bound:
            self._fail(step, f"validation loss {val_loss:.4g} is past {self.bound:.3g}")
