"""A model's buffers across Local-SGD replicas: DiLoCo and Streaming DiLoCo average them
at each sync (BatchNorm's running statistics). Asynchronous Local-SGD recomputes them for
theta instead: tests/test_localsgd_norm_stats.py.

Two spawned gloo ranks (:func:`thinwire.comm.launch.spawn` makes and destroys the group)
train a small conv net with BatchNorm on different data, so their statistics differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.comm import COUNTER
from thinwire.comm.launch import spawn
from thinwire.localsgd.algorithm.buffers import synced_buffers
from thinwire.localsgd.algorithm.diloco import DiLoCo
from thinwire.localsgd.algorithm.streaming import StreamingDiLoCo


class _Net(nn.Module):
    """Conv, BatchNorm, a linear head, and a non-persistent constant (left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(h * self.scale)


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    # Rank-dependent shift: the replicas' running statistics drift apart.
    x = torch.randn(8, 1, 5, 5, generator=g) + rank
    return x, (x.mean((1, 2, 3)) > rank).long()


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _flat_buffers(model: _Net) -> torch.Tensor:
    """BatchNorm's running mean and variance, then its step counter."""
    bn = model.bn
    return torch.cat([bn.running_mean, bn.running_var, bn.num_batches_tracked.reshape(1)])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _diloco_rank(rank: int, world: int) -> dict[str, Any]:
    COUNTER.reset()
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with DiLoCo(model, opt, sync_every=3) as diloco:
        for step in range(1, 3):
            _step(model, opt, step, rank)
        model.scale.fill_(1.0 + rank)  # a non-persistent buffer: never sent
        # The third step's sync averages what each replica holds after its forward pass.
        x, y = _batch(3, rank)
        F.cross_entropy(model(x), y).backward()
        before = _gathered(_flat_buffers(model).double())
        opt.step()
        opt.zero_grad()
    return {
        "before": before,
        "after": _flat_buffers(model),
        "counter": int(model.bn.num_batches_tracked),
        "scale": float(model.scale),
        "outer": diloco.outer_steps,
        "bytes": COUNTER.snapshot(),
    }


@pytest.mark.timeout(120)
def test_diloco_averages_the_buffers_at_each_sync() -> None:
    results = spawn(_diloco_rank, 2, timeout_s=100)
    a, b = results
    assert a["outer"] == b["outer"] == 1
    assert not torch.equal(a["before"][0], a["before"][1])  # the statistics did differ
    assert torch.equal(a["after"], b["after"])  # one model after the sync
    mean = torch.stack(a["before"]).mean(0).float()
    torch.testing.assert_close(a["after"], mean)
    assert a["counter"] == b["counter"] == 3
    assert (a["scale"], b["scale"]) == (1.0, 2.0)  # derived constants stay each rank's own
    assert a["bytes"]["diloco.allreduce.buffers"]["calls"] == 1


def _streaming_rank(rank: int, world: int, overlap: int) -> dict[str, Any]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = StreamingDiLoCo(model, opt, 4, fragments=2, overlap=overlap, alpha=0.0)
    with s:
        for step in range(1, 9):
            _step(model, opt, step, rank)
        s.finish()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"buffers": _flat_buffers(model), "params": params, "syncs": s.syncs}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [0, 1])
def test_streaming_diloco_ends_on_one_model_buffers_included(overlap: int) -> None:
    a, b = spawn(_streaming_rank, 2, (overlap,), timeout_s=100)
    assert torch.equal(a["params"], b["params"])
    assert torch.equal(a["buffers"], b["buffers"])
    assert a["syncs"] >= 4


def test_only_persistent_real_buffers_are_synced() -> None:
    net = _net()
    assert [b.shape for b in synced_buffers(net)] == [(4,), (4,), ()]  # BN's three
