"""LAMB on FSDP2-sharded parameters matches LAMB under DDP; the optimizers that do not
take shards yet refuse them in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.launch import spawn

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 4),
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g)
    return x, x[:, :4].sin()


def _wrap(net: torch.nn.Module, layout: str, world: int) -> tuple[torch.nn.Module, object]:
    """The model as the layout trains it, and the optimizer's process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if layout == "ddp":
        return DDP(net), None
    if layout == "fsdp":
        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
        return net, None
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if layout == "hsdp":
        fully_shard(net, mesh=mesh)
        return net, None
    # FSDP2 inside each island, the optimizer across islands.
    fully_shard(net, mesh=mesh["shard"])
    return net, mesh.get_group("replicate")


def _train(rank: int, world: int, layout: str) -> dict:
    from thinwire.optim import Lamb

    net = _model()
    model, group = _wrap(net, layout, world)
    opt = Lamb(net.parameters(), lr=1e-2, weight_decay=0.01, process_group=group)
    if layout == "ddp":
        opt.register_ddp(model)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]
    return {"params": [t.clone() for t in full], "coeffs": opt.get_lamb_coeffs(), "losses": losses}


def _assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert a["coeffs"] == pytest.approx(b["coeffs"], rel=1e-5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("layout", "world"), [("fsdp", 2), ("hsdp", 4), ("island", 4)])
def test_lamb_on_fsdp2_shards_matches_lamb_under_ddp(layout: str, world: int) -> None:
    """Same data per rank, same steps: the whole layers' trust ratios and the weights
    agree with DDP's. Before, a shard's norm read as a float was the shard's own, a
    different trust ratio on every rank with no error."""
    ddp = spawn(_train, world, ("ddp",), timeout_s=100)
    sharded = spawn(_train, world, (layout,), timeout_s=100)
    for r in range(world):
        _assert_same(sharded[r], ddp[0])
    assert ddp[0]["coeffs"] != pytest.approx([1.0] * len(ddp[0]["coeffs"]))  # ratios bite


def _refusals(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from thinwire.optim import Lamb, OneBitAdam, OneBitLamb

    del rank
    out = {}
    net = _model()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(net, mesh=mesh["shard"])
    for name, make in (
        ("onebit_lamb", lambda: OneBitLamb(net.parameters(), freeze_step=5)),
        ("onebit_adam", lambda: OneBitAdam(net.parameters(), freeze_step=5)),
        ("island_without_group", lambda: Lamb(net.parameters())),
        ("bad_group", lambda: Lamb(net.parameters(), process_group=dist.group.WORLD)),
    ):
        try:
            make()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_layouts_it_cannot_train_are_refused_in_one_line() -> None:
    out = spawn(_refusals, 4, (), timeout_s=100)[0]
    assert "OneBitLamb does not take FSDP2-sharded" in out["onebit_lamb"]
    assert "OneBitAdam does not take FSDP2-sharded" in out["onebit_adam"]
    assert "mesh holds 2 of the 4 ranks" in out["island_without_group"]
    assert "mesh size x replicas = world size" in out["bad_group"]
    assert all("\n" not in msg for msg in out.values()), out


def _resume(rank: int, world: int, path: str) -> dict:
    """Train 6 steps straight; and 3, save through torch.distributed.checkpoint's
    state-dict API, load into a fresh model and optimizer, 3 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from thinwire.optim import Lamb

    def run(steps: range, net: torch.nn.Module, opt: Lamb) -> None:
        for step in steps:
            x, y = _batch(step, rank)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def fresh() -> tuple[torch.nn.Module, Lamb]:
        net, _ = _wrap(_model(), "fsdp", world)
        return net, Lamb(net.parameters(), lr=1e-2, weight_decay=0.01)

    net, opt = fresh()
    run(range(STEPS), net, opt)
    straight = [p.full_tensor().clone() for p in net.parameters()]
    net, opt = fresh()
    run(range(3), net, opt)
    dcp.save(
        {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)},
        checkpoint_id=path,
    )
    net, opt = fresh()
    target = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(net, target["model"])
    set_optimizer_state_dict(net, opt, target["optim"])
    run(range(3, STEPS), net, opt)
    resumed = [p.full_tensor().clone() for p in net.parameters()]
    return {"straight": straight, "resumed": resumed, "step": opt.global_step}


@pytest.mark.timeout(150)
def test_sharded_lamb_resumes_through_torch_distributed_checkpoint(tmp_path) -> None:
    for out in spawn(_resume, 2, (str(tmp_path / "dcp"),), timeout_s=120):
        assert out["step"] == STEPS
        for a, b in zip(out["straight"], out["resumed"], strict=True):
            assert torch.equal(a, b)
