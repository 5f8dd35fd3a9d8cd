"""Full-precision allreduce, with byte accounting, as a function and as a DDP comm hook.

This is the uncompressed baseline every thinwire method is measured against. The hook
behaves exactly like DDP's built-in allreduce (divide by W, then sum) and additionally
reports its bytes to :mod:`thinwire.comm.accounting`, so the trainer's metrics show
what plain data parallelism puts on the wire.
"""

# No `from __future__ import annotations` here: DDP inspects a comm hook's annotations at
# registration and rejects string annotations.

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record, ring_allreduce_bytes

__all__ = ["all_reduce_mean_", "allreduce_hook"]


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_mean_(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op_name: str = "allreduce"
) -> torch.Tensor:
    """Average ``tensor`` across ``group`` in place and record the bytes; returns it.

    Dividing before the sum (rather than a PREMUL_SUM, which gloo lacks) keeps fp16
    buffers from overflowing at large W.
    """
    w = _group_size(group)
    if w == 1:
        return tensor
    tensor.div_(w)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    nbytes = tensor.numel() * tensor.element_size()
    record(op_name, nbytes, ring_allreduce_bytes(nbytes, w))
    return tensor


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: DDP's own gradient averaging, plus byte accounting.

    Usage: ``ddp_model.register_comm_hook(None, allreduce_hook)`` (``None`` means the
    default process group).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    w = dist.get_world_size(group)
    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    record("ddp.allreduce", nbytes, ring_allreduce_bytes(nbytes, w))
    buf.div_(w)
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
