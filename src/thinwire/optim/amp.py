"""Loss scaling (``torch.amp.GradScaler``) with optimizers that average across ranks.

torch's GradScaler decides whether to step from *this rank's* gradients: it skips
``opt.step()`` where they hold an Inf or NaN. Under DDP the gradients are averaged during
backward, so every rank sees the same overflow and skips alike. thinwire's optimizers
average inside ``step()`` (without DDP, and after the 1-bit switch under
``register_ddp``), so one rank's overflow would make that rank alone skip: its
collectives would then pair with the other ranks' next step, the replicas would drift
apart silently, and the run would hang at its last collective.

So the optimizers declare ``_step_supports_amp_scaling``: the scaler then calls
``step()`` on every rank, with the scale to divide the gradients by (``grad_scale``;
None when ``scaler.unscale_(opt)`` ran already, e.g. for clipping) and this rank's
verdict (``found_inf``). :func:`unscale_for_scaler` divides the gradients, and the
step's own check (after averaging, or inside the 1-bit collective) decides on every rank
alike whether to skip. What remains rank-local is the scaler's *update*: a rank that saw
no overflow where another did grows its loss scale while the other backs off. That is
harmless where the optimizer averages the unscaled gradients, but under DDP (which
averages the scaled ones during backward) scales that differ would mix. :class:`GradScaler`
agrees on the verdict across the ranks (one 4-byte allreduce per step), so every rank's
scale moves alike; with torch's own scaler the first step where the ranks disagreed is
said in one line.

Use it as torch's::

    scaler = thinwire.optim.GradScaler("cuda")      # "cpu" for bf16/fp16 on CPU
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                            # optional, before clipping
    scaler.step(opt)
    scaler.update()
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from thinwire.optim.sharded import local

__all__ = ["GradScaler", "note_scaler_verdict", "unscale_for_scaler"]

_log = logging.getLogger(__name__)


def unscale_for_scaler(opt: torch.optim.Optimizer) -> None:
    """Divide ``opt``'s gradients by the scale a GradScaler handed to ``step()`` (nothing
    when it handed none, or when the gradients were unscaled already). An Inf stays an
    Inf: the step's own check skips it on every rank."""
    scale = getattr(opt, "grad_scale", None)
    if scale is None:
        return
    # This rank's shards of FSDP2's gradients, and the scale as a number (a power of 2:
    # dividing by it is exact), so that the same call serves DTensors and plain tensors.
    grads = [local(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, float(scale))


def note_scaler_verdict(opt: Any, stepped: bool) -> None:
    """Say once when this rank's GradScaler verdict (``found_inf``) differs from the
    step the ranks took together: the ranks' loss scales now differ."""
    found = getattr(opt, "found_inf", None)
    if found is None or getattr(opt, "_told_scales_differ", False):
        return
    if bool(found.item() > 0) == stepped:  # this rank saw Inf and the ranks stepped, or not
        opt._told_scales_differ = True
        _log.warning(
            "%s: at step %d this rank's GradScaler %s NaN/Inf in its own gradients but the "
            "ranks %s the step together, so the ranks' loss scales now differ; use "
            "thinwire.optim.GradScaler, which agrees on overflows across the ranks",
            type(opt).__name__,
            getattr(opt, "global_step", 0) + getattr(opt, "skipped_steps", 0),
            "found" if stepped else "did not find",
            "took" if stepped else "skipped",
        )


class GradScaler(torch.amp.GradScaler):
    """torch's GradScaler whose overflow verdict is agreed across the ranks of the
    optimizer's process group (its ``process_group``; the default group otherwise), so
    that every rank skips alike and keeps the same loss scale. Costs one allreduce of
    one number per optimizer step; with one process it is torch's."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not (dist.is_available() and dist.is_initialized()):
            return per_device
        # A sharded optimizer's group is its replica group: agree over every rank instead.
        group = (
            None
            if getattr(optimizer, "sharded", False)
            else getattr(optimizer, "process_group", None)
        )
        if dist.get_world_size(group) == 1:
            return per_device
        # One collective on every rank, however many devices (or none) hold gradients.
        verdict = found_inf.new_zeros(())
        for flag in per_device.values():
            verdict = torch.maximum(verdict, flag.to(verdict.device))
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
        for flag in per_device.values():
            flag.copy_(verdict.to(flag.device))
        return per_device
