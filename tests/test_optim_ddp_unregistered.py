"""A model under DDP whose thinwire optimizer was not registered with it says so.

DDP then averages every gradient in fp32 during backward and the optimizer averages
again (its warmup) or compresses what DDP already sent: no bytes are saved and the
byte counts look compressed. The optimizer sees at its first averaged step that the
gradients were already equal on every rank, and says so in one line on rank 0.
Two spawned gloo ranks.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import WarningLines
from thinwire.comm.launch import spawn


def _rank(rank: int, world: int, wiring: str) -> list[str]:
    from thinwire.optim import OneBitLamb

    capture = WarningLines()
    logging.getLogger("thinwire").addHandler(capture)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3)
    net: Any = model
    if wiring != "plain":
        net = nn.parallel.DistributedDataParallel(model)
    if wiring == "registered":
        opt.register_ddp(net)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randint(2, (16,), generator=g)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [line for line in capture.lines if "register_ddp" in line]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("wiring", "said"), [("unregistered", 1), ("registered", 0), ("plain", 0)])
def test_ddp_without_register_ddp_is_said_once(wiring: str, said: int) -> None:
    first, second = spawn(_rank, 2, (wiring,), timeout_s=100)
    assert len(first) == said and second == []
    if said:
        assert "call opt.register_ddp(ddp_model)" in first[0]
