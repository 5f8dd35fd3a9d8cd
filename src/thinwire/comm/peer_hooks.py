"""PyTorch's own DDP compression hooks, with thinwire's byte accounting around them.

These are the peers a PyTorch user would pick instead of thinwire: fp16 compression
(``fp16_compress_hook``) and PowerSGD (``powerSGD_hook``, Vogels et al. 2019). The
wrappers add nothing to the algorithms; they only report the bytes each one sends, so a
comparison against 1-bit LAMB is made on the same ledger.

PowerSGD's bytes follow its own rules: a gradient viewed as an ``n x m`` matrix is sent
as two factors of ``(n + m) * rank`` fp32 values when that is smaller by at least
``min_compression_rate``, otherwise uncompressed; vectors (biases, norms) always travel
uncompressed; the first ``start_powerSGD_iter`` steps are plain allreduce.
"""

# No `from __future__ import annotations`: DDP inspects the hooks' annotations.

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from thinwire.comm.accounting import record, ring_allreduce_bytes

__all__ = ["fp16_hook", "make_powersgd_state", "powersgd_hook", "powersgd_wire_bytes"]


def fp16_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``fp16_compress_hook`` (gradients cast to fp16 on the wire), accounted."""
    group = process_group if process_group is not None else dist.group.WORLD
    nbytes = bucket.buffer().numel() * 2
    record("ddp.fp16", nbytes, ring_allreduce_bytes(nbytes, dist.get_world_size(group)))
    return default_hooks.fp16_compress_hook(process_group, bucket)


def powersgd_wire_bytes(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> int:
    """Bytes PowerSGD hands to its allreduces for this bucket (before the ring factor)."""
    if state.iter < state.start_powerSGD_iter:
        return bucket.buffer().numel() * bucket.buffer().element_size()
    total = 0
    for grad in bucket.gradients():
        if grad.ndimension() <= 1:
            total += grad.numel() * 4
            continue
        n = grad.shape[0]
        m = grad.numel() // n
        r = min(n, m, state.matrix_approximation_rank)
        compress, uncompressed, compressed = psgd._should_compress(
            n, m, r, state.min_compression_rate
        )
        total += 4 * (compressed if compress else uncompressed)
    return total


def make_powersgd_state(
    rank: int = 4, start_iter: int = 10, process_group: dist.ProcessGroup | None = None
) -> psgd.PowerSGDState:
    """A PowerSGD state with error feedback and warm start (PyTorch's recommended setup).

    ``rank`` trades bytes for accuracy (1 is the most aggressive; 4 is a common choice);
    ``start_iter`` plain-allreduce steps come first, as PyTorch advises.
    """
    return psgd.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=max(2, start_iter),
        use_error_feedback=True,
        warm_start=True,
    )


def powersgd_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook``, accounted. ``state`` is a ``PowerSGDState``, or a
    :class:`~thinwire.comm.powersgd_state.TrackedPowerSGD` for an exact resume."""
    if hasattr(state, "align"):  # a TrackedPowerSGD: lay its buffers out as this bucket is
        state.align(bucket)
        state = state.inner
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    nbytes = powersgd_wire_bytes(state, bucket)
    record("ddp.powersgd", nbytes, ring_allreduce_bytes(nbytes, dist.get_world_size(group)))
    return psgd.powerSGD_hook(state, bucket)
