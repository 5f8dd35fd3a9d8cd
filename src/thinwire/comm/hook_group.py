"""A process group of a comm hook's own, so that its collectives never meet DDP's.

Ranks match collectives by their order on a process group (gloo and NCCL alike). DDP
runs collectives of its own on its group from the thread that calls ``backward()`` and
``forward()``: the bitmap of used parameters at the end of backward
(``find_unused_parameters=True``, and ``static_graph``'s first iteration), the buffers
before forward (``broadcast_buffers=True``), the bucket order after the first iteration,
``join()``'s shadow collectives. A hook that runs its own collectives on a background
thread (:class:`thinwire.comm.hook_worker.HookWorker`) while backward goes on would
interleave with them in a different order on each rank: a hang, or gloo's "collective
mismatch" abort. On a group of its own every group keeps one order on every rank.

The cost: one more group over the same ranks (gloo: a connection per pair of ranks and
a few threads; NCCL: one more communicator, created at its first collective).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["hook_group", "release_group"]


def _every_rank(process_group: dist.ProcessGroup | None) -> bool:
    return process_group is None or dist.get_world_size(process_group) == dist.get_world_size()


def hook_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group over the ranks of ``process_group`` (``None``: every rank), with its
    backend, for a comm hook's own collectives.

    Collective, like ``dist.new_group``: every rank calls it at the same point of its
    program. Over every rank (the usual DDP), every rank of the job calls it; over a
    subgroup, the subgroup's members do (``use_local_synchronization``: the other ranks
    need not know), in the same order as any other group they make that way.
    """
    if _every_rank(process_group):
        # Counter-named like the user's own new_group() calls, so it must be made on every
        # rank, which a DDP over every rank guarantees.
        return dist.new_group()
    ranks = dist.get_process_group_ranks(process_group)
    group = dist.new_group(
        ranks, backend=dist.get_backend(process_group), use_local_synchronization=True
    )
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(f"rank {dist.get_rank()} is not in the hook's group {ranks}")
    return group


def release_group(group: dist.ProcessGroup) -> bool:
    """Destroy a group made by :func:`hook_group` over every rank (local: no collective);
    return whether it is gone (True also once ``dist.destroy_process_group()`` has
    destroyed every group).

    A subgroup's group is kept (False): torch names such a group after its ranks and the
    number of groups alive, so a group made after destroying it would take the same name,
    and its ranks would meet at the dead group's addresses in the store ("Connection
    refused"). Keep using it; ``dist.destroy_process_group()`` ends it with the others.
    """
    if not dist.is_initialized():
        return True
    with contextlib.suppress(ValueError):  # "Invalid process group": already destroyed
        if not _every_rank(group):
            return False
        dist.destroy_process_group(group)
    return True
