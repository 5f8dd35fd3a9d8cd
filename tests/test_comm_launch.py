"""Local spawning, process-group lifecycle, and byte accounting of the plain allreduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thinwire.comm import COUNTER, DistributedError, all_reduce_mean_, spawn
from thinwire.comm.accounting import gather_bytes, ring_allreduce_bytes


def _mean_of_ranks(rank: int, world: int) -> tuple[torch.Tensor, dict]:
    x = torch.full((10,), float(rank))
    all_reduce_mean_(x)
    return x, COUNTER.snapshot()


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad thing on rank one")
    dist.barrier()  # rank 0 would hang here forever without the launcher's cleanup
    return rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_spawn_allreduce_mean_and_bytes(world: int) -> None:
    results = spawn(_mean_of_ranks, world, timeout_s=100)
    expected = sum(range(world)) / world
    for x, snap in results:
        torch.testing.assert_close(x, torch.full((10,), expected))
        assert snap["allreduce"]["calls"] == 1
        assert snap["allreduce"]["payload_bytes"] == 40
        assert snap["allreduce"]["wire_bytes"] == ring_allreduce_bytes(40, world)


@pytest.mark.timeout(120)
def test_failing_rank_is_reported_not_hung() -> None:
    with pytest.raises(DistributedError, match="rank 1 failed: ValueError: bad thing on rank one"):
        spawn(_raise_on_rank_one, 2, timeout_s=100)


def test_byte_formulas() -> None:
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 4) == 1500
    assert gather_bytes(1000, 4) == 750
