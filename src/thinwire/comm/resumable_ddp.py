"""DDP whose bucket layout after a resume is the one an uninterrupted run has.

DDP averages gradients bucket by bucket. A new ``DistributedDataParallel`` reduces its
first backward pass in an initial layout (torch 2.13: every parameter in one bucket, in
model order; older releases: buckets of ``bucket_cap_mb`` in reverse model order),
records the order in which the gradients became ready, and rebuilds its buckets in that
order before its second forward pass. An uninterrupted run therefore reduces every step
from the second on in the rebuilt layout, while a run resumed from a checkpoint at step
``k`` builds a new DDP and reduces step ``k`` in the initial one.

That matters for the result, not only for speed. The layout decides where each gradient
element sits in the flat bucket, and a ring allreduce (gloo's, NCCL's) sums an element's
W values in an order that depends on its position. With W >= 3, ``(a + b) + c`` and
``a + (b + c)`` round differently in floating point, so the resumed run's first averaged
gradient differs from the straight run's in the last bits and the two runs drift apart.
With W = 2 the sum ``a + b`` is the same either way, which hides the effect.

:class:`ResumableDDP` is DDP plus one method, :meth:`~ResumableDDP.rehearse`: it runs one
forward and backward pass with the comm hook switched off, so DDP learns the
gradient-ready order and rebuilds its buckets before the first real step, exactly as the
first step of the uninterrupted run made it do. Nothing travels, the hook's state does
not move, the random generators and the gradients are left as they were::

    ddp = ResumableDDP(model)
    ddp.register_comm_hook(state, hook)  # any hook, as with DDP
    load_checkpoint(...)
    ddp.rehearse(lambda: ddp(x[:1]).sum().backward())  # one sequence is enough
    # ... the training loop, bit-identical to the run that never stopped

A hook state that must see the rehearsed iteration (one that learns the parameter order
of DDP's first iteration, as :class:`~thinwire.comm.onebit_hook.OneBitHookState` does) may
define ``rehearse(bucket)``; it is called with each bucket instead of the hook.
"""

# No `from __future__ import annotations` here: DDP inspects the comm hook's annotations
# at registration and rejects string annotations.

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ResumableDDP"]


class _HookSwitch:
    """The registered hook and its state, and whether DDP's current iteration is a
    rehearsal (the hook is then skipped)."""

    __slots__ = ("hook", "rehearsing", "state")

    def __init__(self, state: object, hook: Callable[..., Any]) -> None:
        self.state = state
        self.hook = hook
        self.rehearsing = False


def _switched_hook(
    switch: _HookSwitch, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The registered hook, or, while rehearsing, the bucket's local gradients untouched
    (no collective, no bytes, no hook state changed)."""
    if not switch.rehearsing:
        return switch.hook(switch.state, bucket)
    observe = getattr(switch.state, "rehearse", None)
    if observe is not None:
        observe(bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class ResumableDDP(DistributedDataParallel):
    """``DistributedDataParallel`` that can settle its bucket layout before its first real
    step (see the module docstring).

    Takes DDP's arguments. A comm hook is registered as with DDP (once, before the first
    forward pass); it runs unchanged, behind one extra Python call per bucket.
    """

    _hook_switch: _HookSwitch | None = None

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook``: ``hook(state, bucket)`` reduces each bucket."""
        switch = _HookSwitch(state, hook)
        super().register_comm_hook(switch, _switched_hook)
        self._hook_switch = switch

    @property
    def has_hook(self) -> bool:
        """Whether a comm hook is registered."""
        return self._hook_switch is not None

    def wrap_hook(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace the registered hook by ``wrap(hook)``, in place: DDP takes a hook only
        once, so this is how a hook is timed after registration (as
        :func:`thinwire.comm.step_record.record_run` does)."""
        switch = self._hook_switch
        if switch is None:
            raise RuntimeError("ResumableDDP.wrap_hook needs a comm hook registered first")
        switch.hook = wrap(switch.hook)

    def rehearse(self, forward_backward: Callable[[], None]) -> None:
        """Run ``forward_backward`` (one forward pass through this module and a backward
        pass from its output, the graph of a training step) without communicating, so
        that DDP rebuilds its buckets as after a first training step.

        Call it on every rank before the first step of a run that resumes from a
        checkpoint, when this DDP has not run a forward pass yet. Each rank rehearses on
        its own (no collective); DDP agrees on the new layout at the next forward pass,
        as it always does. The model's gradients and the random generators are as they
        were before, and so is the hook's state, unless it asks to see the rehearsal (a
        ``rehearse(bucket)`` method, see the module docstring). A batch of one sequence
        builds the same graph as a full one, at a fraction of the cost.

        Raises:
            RuntimeError: no comm hook was registered (DDP's built-in allreduce cannot be
                switched off), or DDP has rebuilt its buckets already.
        """
        switch = self._hook_switch
        if switch is None:
            raise RuntimeError("ResumableDDP.rehearse needs a comm hook registered first")
        if getattr(self, "_has_rebuilt_buckets", False):
            raise RuntimeError("ResumableDDP.rehearse: the buckets are already rebuilt")
        params = list(self.module.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None  # the rehearsal's gradients must not add to a caller's
        cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        switch.rehearsing = True
        try:
            with torch.random.fork_rng(devices=cuda):  # dropout draws are given back
                forward_backward()
        finally:
            switch.rehearsing = False
            for p, g in zip(params, grads, strict=True):
                p.grad = g
