"""A model's buffers (BatchNorm's running statistics and the like) across DiLoCo replicas.

Buffers are not parameters: no optimizer moves them and no pseudo-gradient carries them,
yet each replica's forward passes change them (``running_mean``/``running_var`` follow
that replica's batches). Unsynced, the replicas stop being one model the moment a round
ends, and rank 0's checkpoint holds only rank 0's statistics. So at every outer sync
DiLoCo and Streaming DiLoCo replace them with their average over the replicas:

* floating-point buffers: the mean (BatchNorm's running statistics are means over
  batches, and the replicas saw equally many, so the mean is the statistic over all of
  them, up to the variance between replicas that ``running_var`` leaves out);
* integer and bool buffers (``num_batches_tracked``): the rounded mean. Every replica
  takes the same number of steps, so the counters agree and this returns their common
  value; it is chosen over rank 0's value or the max because it rides the same single
  allreduce as the floats, where either of those would need a second collective.

The buffers travel uncompressed, in float64 (exact for counters up to 2^53), in one flat
allreduce: a BatchNorm layer has 2 per channel, a few KB for a whole ResNet, nothing next
to the pseudo-gradient. A model without buffers sends nothing. Only persistent buffers
(those in ``state_dict``) travel: a large constant registered as persistent (an attention
mask in some GPT code) is sent at every sync, 8 bytes an element; register it with
``persistent=False`` to keep it off the wire.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import record
from thinwire.comm.allreduce import all_reduce_mean_

__all__ = [
    "average_buffers_",
    "broadcast_buffers_",
    "flat_buffers",
    "load_buffers_",
    "synced_buffers",
]


def synced_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a sync averages: the persistent, real-valued ones. A non-persistent
    buffer is left out of the model's ``state_dict`` by its author because it is derived
    (an attention mask, a rotary table): equal on every replica, and possibly large.
    Complex buffers have no rounding rule here (no torch layer keeps one)."""
    out = []
    for name, b in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf not in module._non_persistent_buffers_set and not b.is_complex():
            out.append(b)
    return out


def flat_buffers(buffers: list[torch.Tensor]) -> torch.Tensor:
    """``buffers`` as one flat float64 copy (what a sync sends)."""
    return torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])


@torch.no_grad()
def load_buffers_(buffers: list[torch.Tensor], flat: torch.Tensor, keep: float = 0.0) -> None:
    """Put the averaged ``flat`` back into ``buffers``: floats as ``keep * local + (1 -
    keep) * average`` (Streaming DiLoCo's alpha; 0 replaces them), integers and bools
    rounded (a counter cannot be mixed, and the average of equal counters is exact)."""
    offset = 0
    for b in buffers:
        seg = flat[offset : offset + b.numel()].view_as(b)
        offset += b.numel()
        if not b.is_floating_point():
            b.copy_(seg.round())
        elif keep:
            b.mul_(keep).add_(seg.to(b.dtype), alpha=1.0 - keep)
        else:
            b.copy_(seg)


def average_buffers_(
    buffers: list[torch.Tensor], group: dist.ProcessGroup | None, op_name: str
) -> None:
    """Replace ``buffers`` by their average over ``group`` (one flat allreduce; nothing
    when there are no buffers), so every replica holds the same ones."""
    if not buffers:
        return
    load_buffers_(buffers, all_reduce_mean_(flat_buffers(buffers), group, op_name=op_name))


def broadcast_buffers_(
    buffers: list[torch.Tensor], group: dist.ProcessGroup | None, op_name: str
) -> None:
    """Give every replica the group's first rank's ``buffers`` (with the parameters at
    the start, so a model loaded on rank 0 alone starts whole everywhere)."""
    if not buffers:
        return
    flat = flat_buffers(buffers)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(flat, src=src, group=group)
    record(op_name, flat.numel() * flat.element_size(), flat.numel() * flat.element_size())
    load_buffers_(buffers, flat)
