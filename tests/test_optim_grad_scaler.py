"""Loss scaling with the optimizers that average across ranks (:mod:`thinwire.optim.amp`).

One rank's loss overflows at one step. torch's GradScaler would skip ``opt.step()`` on
that rank alone, and its collectives would pair with the other rank's next step: the
replicas drift apart silently and the run hangs at its last collective. Now every rank
steps (or skips) alike, with torch's scaler (which says once that the loss scales now
differ) and with thinwire's (which agrees on the overflow, so the scales stay equal).
Two spawned gloo ranks, fp16 autocast on the CPU; LAMB and the 1-bit optimizers in both
stages, with and without DDP.
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

STEPS = 8
OVERFLOW_AT = 2  # on rank 0 only; the 1-bit optimizers switch after step 3


def _train(
    net: nn.Module,
    opt: Any,
    scaler_kind: str,
    rank: int,
    dtype: torch.dtype,
    unscale_at: int | None = None,
) -> list[float]:
    """The user's autocast loop, rank 0's loss overflowing once; the scale after each step."""
    from thinwire.optim import GradScaler

    scaler = GradScaler("cpu") if scaler_kind == "thinwire" else torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(rank)
    scales = []
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=g), torch.randint(2, (16,), generator=g)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(net(x), y)
        if rank == 0 and step == OVERFLOW_AT:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if step == unscale_at:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales


def _rank(rank: int, world: int, name: str, scaler_kind: str, ddp: bool) -> dict[str, Any]:
    from thinwire.optim import Lamb, OneBitAdam, OneBitLamb

    capture = WarningLines()
    logging.getLogger("thinwire").addHandler(capture)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    kinds = {"lamb": Lamb, "onebit-lamb": OneBitLamb, "onebit-adam": OneBitAdam}
    extra = {} if name == "lamb" else {"freeze_step": 3}
    opt = kinds[name](model.parameters(), lr=1e-2, **extra)
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(model)
        opt.register_ddp(net)
    # step 5 unscales first, as before clipping: the scaler hands no scale then
    scales = _train(net, opt, scaler_kind, rank, torch.float16, unscale_at=5)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "params": params,
        "steps": opt.global_step,
        "skipped": opt.skipped_steps,
        "compressing": bool(getattr(opt, "compressing", False)),
        "scales": scales,
        "warnings": [line for line in capture.lines if "GradScaler" in line],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "ddp"),
    [("lamb", False), ("onebit-lamb", False), ("onebit-adam", False), ("onebit-lamb", True)],
)
@pytest.mark.parametrize("scaler_kind", ["torch", "thinwire"])
def test_one_ranks_overflow_is_skipped_by_every_rank(
    name: str, ddp: bool, scaler_kind: str
) -> None:
    a, b = spawn(_rank, 2, (name, scaler_kind, ddp), timeout_s=100)
    assert torch.equal(a["params"], b["params"])  # one model, no step paired with another
    assert a["skipped"] == b["skipped"] == 1
    assert a["steps"] == b["steps"] == STEPS - 1
    assert a["compressing"] == b["compressing"] == (name != "lamb")
    assert torch.isfinite(a["params"]).all()
    if scaler_kind == "thinwire" or ddp:  # under DDP the overflow is averaged to every rank
        assert a["scales"] == b["scales"]
        assert a["warnings"] == b["warnings"] == []
    else:
        # torch's scaler decides per rank: rank 1 grew its scale where rank 0 backed off
        assert a["scales"][OVERFLOW_AT] < b["scales"][OVERFLOW_AT]
        assert a["warnings"] == [] and len(b["warnings"]) == 1
        assert "the ranks' loss scales now differ" in b["warnings"][0]


def _hsdp_rank(rank: int, world: int, scaler_kind: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from thinwire.optim import OneBitLamb

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    fully_shard(model, mesh=mesh["shard"])
    replicas = mesh.get_group("replicate")
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3, process_group=replicas)
    scales = _train(model, opt, scaler_kind, rank, torch.bfloat16)
    shard = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return {"shard": shard, "skipped": opt.skipped_steps, "scale": scales[-1]}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scaler_kind", ["torch", "thinwire"])
def test_hsdp_islands_skip_an_overflow_alike(scaler_kind: str) -> None:
    """4 ranks: 2 islands of 2 (FSDP2 inside, the 1-bit exchange across): rank 0's
    overflow reaches its island through FSDP2's reduce-scatter, the other island through
    the optimizer's check; every rank skips that one step and the replicas stay equal."""
    out = spawn(_hsdp_rank, 4, (scaler_kind,), timeout_s=130)
    assert [r["skipped"] for r in out] == [1, 1, 1, 1]
    assert torch.equal(out[0]["shard"], out[2]["shard"])  # rank r and r + 2: one shard
    assert torch.equal(out[1]["shard"], out[3]["shard"])
    scales = [r["scale"] for r in out]
    if scaler_kind == "thinwire":
        assert len(set(scales)) == 1
    else:  # torch's: the other island did not see the overflow, and grew its scale
        assert scales[0] == scales[1] < scales[2] == scales[3]
