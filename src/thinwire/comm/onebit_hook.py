"""DDP communication hook: 1-bit error-feedback compression of gradient buckets.

Plugs the compressed allreduce (:class:`thinwire.comm.onebit_allreduce.OneBitAllreduce`)
into PyTorch DDP's own extension point, the way PowerSGD's hook does::

    from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook

    state = OneBitHookState(process_group=None, warmup_steps=100)
    ddp_model.register_comm_hook(state, onebit_hook)

Each gradient bucket is averaged with sign bits plus one scale per rank and segment,
32x fewer bytes than fp32. What the compression loses is kept per bucket, on the
worker and on the server side, and added back next step (error-feedback sign SGD:
Seide et al. 2014, Karimireddy et al. arXiv 1901.09847, Tang et al. arXiv 2102.02888).
Because only the gradients change, it works with any optimizer.

Tuning guide:

* ``warmup_steps``: plain (uncompressed) allreduce for this many steps first. Early
  training is the most sensitive to compression error, and DDP rebuilds its buckets
  after the first step (residuals of the first layout would be discarded). 5-10% of
  the run is a good start; never less than 1.
* Bucket size (``bucket_cap_mb`` of DDP): every bucket costs 3 collective latencies
  here, so larger buckets (e.g. 100 MB) pay off on a WAN.
* Momentum-based optimizers tolerate 1-bit gradients worse than SGD at high learning
  rates; for Adam-style training prefer compressing the momentum (1-bit Adam/LAMB in
  :mod:`thinwire.optim`), which is what that family of papers does.
* The hook runs the collective synchronously inside backward: there is no overlap of
  communication with the remaining backward computation. On a slow network the wire
  time dominates either way; on a fast one, plain allreduce is the better choice.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook inspects the
# hook's annotations at runtime and rejects string annotations.
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.allreduce import allreduce_hook
from thinwire.comm.onebit_allreduce import NonFiniteError, OneBitAllreduce
from thinwire.compress.onebit import DEFAULT_CHUNK

__all__ = ["OneBitHookState", "onebit_hook"]

_NONFINITE = ("allreduce", "raise")


class OneBitHookState:
    """State of :func:`onebit_hook`: step counter, options and per-bucket residuals.

    Args:
        process_group: group to average over (``None``: the default group).
        warmup_steps: steps of plain allreduce before compression starts.
        nonfinite: what a bucket with NaN/Inf gradients does. ``"allreduce"`` (default)
            sends it uncompressed, so the NaN/Inf reaches the optimizer exactly as with
            plain DDP (a ``GradScaler`` then skips the step) and the residuals stay
            untouched; ``"raise"`` raises :class:`NonFiniteError` on every rank.
        chunk: elements per step of the in-place residual updates (see
            :class:`OneBitAllreduce`).

    The state pickles without the process group (it is ``None`` after unpickling,
    i.e. the default group; set ``state.process_group`` again if needed). Residuals
    travel with it, so a checkpoint of the state resumes exactly.
    """

    __slots__ = (
        "_allreduces",
        "_pending",
        "chunk",
        "iteration",
        "nonfinite",
        "process_group",
        "warmup_steps",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        warmup_steps: int = 10,
        nonfinite: str = "allreduce",
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.nonfinite = nonfinite
        self.chunk = chunk
        self.iteration = 0
        self._allreduces: dict[int, OneBitAllreduce] = {}
        self._pending: dict[int, dict[str, Any]] = {}

    def allreduce_for(self, bucket_index: int, numel: int) -> OneBitAllreduce:
        """The collective (and residuals) of one bucket; fresh if the bucket was rebuilt."""
        ar = self._allreduces.get(bucket_index)
        if ar is None:
            ar = self._allreduces[bucket_index] = OneBitAllreduce(self.process_group, self.chunk)
            pending = self._pending.pop(bucket_index, None)
            if pending is not None:
                ar.load_state_dict(pending)
        if ar.numel is not None and ar.numel != numel:
            # DDP rebuilt its buckets (same layout on every rank): old residuals are moot.
            ar.reset()
        return ar

    def state_dict(self) -> dict[str, Any]:
        """Options, step counter and every bucket's residuals (this rank's)."""
        buckets = dict(self._pending)
        buckets.update({i: ar.state_dict() for i, ar in self._allreduces.items()})
        return {
            "warmup_steps": self.warmup_steps,
            "nonfinite": self.nonfinite,
            "chunk": self.chunk,
            "iteration": self.iteration,
            "buckets": buckets,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warmup_steps = state["warmup_steps"]
        self.nonfinite = state["nonfinite"]
        self.chunk = state["chunk"]
        self.iteration = state["iteration"]
        self._allreduces = {}
        # Loaded on first use, when the process group is known.
        self._pending = dict(state["buckets"])

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.load_state_dict(state)


def onebit_hook(
    state: OneBitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket with 1-bit compression (after ``state.warmup_steps``).

    Register with ``ddp_model.register_comm_hook(state, onebit_hook)``.
    """
    buf = bucket.buffer()
    if state.iteration < state.warmup_steps:
        fut = allreduce_hook(state.process_group, bucket)
    else:
        allreduce = state.allreduce_for(bucket.index(), buf.numel())
        try:
            allreduce(buf, out=buf)
            devices = [buf.device] if buf.is_cuda else None
            fut = torch.futures.Future(devices=devices)
            fut.set_result(buf)
        except NonFiniteError:
            if state.nonfinite == "raise":
                raise
            fut = allreduce_hook(state.process_group, bucket)
    if bucket.is_last():
        state.iteration += 1
    return fut
