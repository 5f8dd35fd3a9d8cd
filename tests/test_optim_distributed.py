"""LAMB, 1-bit Adam, 1-bit LAMB on 2 and 4 gloo ranks: agreement, one collective per step,
bytes, exact resume across the freeze, DDP, and bad input that must not hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm import COUNTER, DistributedError, spawn
from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.onebit_allreduce import onebit_wire_bytes
from thinwire.optim import Lamb, OneBitAdam, OneBitLamb

CLASSES = {"lamb": Lamb, "onebit-adam": OneBitAdam, "onebit-lamb": OneBitLamb}
FREEZE = 3


def _model(seed: int = 0, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4)
    )


def _make(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    kw = {} if name == "lamb" else {"freeze_step": FREEZE}
    return CLASSES[name](model.parameters(), lr=0.01, **kw)


def _local_step(model: torch.nn.Module, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(100 * t + rank)  # each rank its own data
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _digest(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _trained(name: str, rank: int, steps: range, seed: int = 0, data_offset: int = 0) -> tuple:
    """A fresh model and optimizer after local steps ``steps`` (data of step t + offset)."""
    model = _model(seed=seed)
    opt = _make(name, model)
    for t in steps:
        _local_step(model, opt, rank, t + data_offset)
    return model, opt


def _agreement(rank: int, world: int, steps: int) -> dict:
    out = {}
    for name in CLASSES:
        # a different init per rank: construction must broadcast rank 0's weights
        model = _model(seed=rank, hidden=1024)  # ~21K parameters: scales are a rounding error
        opt = _make(name, model)
        trace, calls = [], []
        for t in range(steps):
            before = COUNTER.snapshot()
            _local_step(model, opt, rank, t)
            after = COUNTER.snapshot()
            calls.append({k: after[k]["calls"] - before.get(k, {}).get("calls", 0) for k in after})
            nbytes = {
                k: after[k]["wire_bytes"] - before.get(k, {}).get("wire_bytes", 0) for k in after
            }
            trace.append((_digest(model), nbytes))
        n = sum(p.numel() for p in model.parameters())
        out[name] = {"trace": trace, "calls": calls, "numel": n, "layers": len(opt._params())}
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_every_step_one_collective_per_step(world: int) -> None:
    steps = 6
    everyone = spawn(_agreement, world, (steps,), timeout_s=180)
    for name in CLASSES:
        _check_agreement(name, world, steps, [r[name] for r in everyone])


def _check_agreement(name: str, world: int, steps: int, results: list[dict]) -> None:
    n = results[0]["numel"]
    for t in range(steps):
        for r in range(1, world):
            assert torch.equal(results[r]["trace"][t][0], results[0]["trace"][t][0]), (t, r)
    fp32_bytes = ring_allreduce_bytes(4 * n, world)
    for t, (calls, (_, nbytes)) in enumerate(
        zip(results[0]["calls"], results[0]["trace"], strict=True)
    ):
        compressing = name != "lamb" and t >= FREEZE
        if compressing:
            assert calls.get("onebit.phase1", 0) == 1  # ONE compressed collective per step
            assert calls.get("optim.allreduce", 0) == 0
            total = sum(nbytes.values())
            # ~1/28 of the fp32 allreduce: the bits of both phases, a scale per 256
            # elements and the small metadata gather (72 bytes per peer, 4% of this
            # small model's share), exactly the collective's formula for the fused buffer
            assert total == onebit_wire_bytes(n, world), (total, fp32_bytes)
            assert fp32_bytes / 29 < total < fp32_bytes / 25
        else:
            assert calls.get("optim.allreduce", 0) == 1
            assert calls.get("onebit.phase1", 0) == 0
            # the gradients and one flag per layer (which had a gradient on some rank)
            flags = ring_allreduce_bytes(4 * (n + results[0]["layers"]), world) - fp32_bytes
            assert nbytes["optim.allreduce"] == fp32_bytes + flags
            assert flags < fp32_bytes / 1000


def _resume_all(rank: int, world: int, steps: int, path: str) -> list[tuple]:
    return [
        (name, stop, *_resume(rank, name, steps, stop, f"{path}/{name}-{stop}"))
        for name in ("onebit-adam", "onebit-lamb")
        for stop in (FREEZE - 1, FREEZE, FREEZE + 2)
    ]


def _resume(rank: int, name: str, steps: int, stop: int, path: str) -> tuple:
    Path(path).mkdir(parents=True, exist_ok=True)
    straight = _digest(_trained(name, rank, range(steps))[0])
    model, opt = _trained(name, rank, range(stop))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}/rank{rank}.pt")
    model, opt = _trained(name, rank, range(0), seed=99)
    blob = torch.load(f"{path}/rank{rank}.pt", weights_only=False)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["opt"])
    for t in range(stop, steps):
        _local_step(model, opt, rank, t)
    return straight, _digest(model)


@pytest.mark.timeout(200)
def test_resume_is_bitwise_exact_across_the_freeze(tmp_path: Path) -> None:
    """Stop before, at and after the freeze; each rank saves and restores its own state."""
    for rank_results in spawn(_resume_all, 2, (8, str(tmp_path)), timeout_s=180):
        assert len(rank_results) == 6
        for name, stop, straight, resumed in rank_results:
            assert torch.equal(straight, resumed), (name, stop)


def _world_change(rank: int, world: int, path: str) -> str:
    _, opt = _trained("onebit-lamb", rank, range(FREEZE + 1))
    if rank == 0:
        torch.save(opt.state_dict(), f"{path}/opt.pt")
    return "saved"


@pytest.mark.timeout(120)
def test_world_size_change_between_save_and_load_fails_clearly(tmp_path: Path) -> None:
    spawn(_world_change, 2, (str(tmp_path),), timeout_s=100)
    opt = _make("onebit-lamb", _model())
    with pytest.raises(ValueError, match="saved with world size 2, this group has 1"):
        opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False))


def _mismatched(rank: int, world: int) -> None:
    width = 32 if rank == 0 else 33
    model = torch.nn.Linear(width, 2)
    OneBitLamb(model.parameters(), freeze_step=2)


@pytest.mark.timeout(120)
def test_parameter_shapes_differing_across_ranks_fail_fast() -> None:
    with pytest.raises(DistributedError, match=r"has shape \(2, 3[23]\) on rank [01]"):
        spawn(_mismatched, 2, timeout_s=100)


def _nan_all(rank: int, world: int) -> dict:
    return {name: _nan_on_one_rank(rank, name) for name in CLASSES}


def _nan_on_one_rank(rank: int, name: str) -> dict:
    model = _model()
    opt = _make(name, model)
    out = {}
    for t in range(FREEZE + 3):
        if t in (1, FREEZE + 1):  # once in warmup, once compressing
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            if rank == 1:
                next(iter(model.parameters())).grad[0, 0] = float("inf")
            before = _digest(model)
            moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
            opt.step()
            out[t] = (
                torch.equal(before, _digest(model)),
                all(
                    torch.equal(m, opt.state[p]["exp_avg"])
                    for m, p in zip(moments, model.parameters(), strict=True)
                ),
            )
        else:
            _local_step(model, opt, rank, t)
    onebit = opt._onebit.state_dict() if opt._onebit is not None else None
    return {
        "unchanged": out,
        "skipped": opt.skipped_steps,
        "digest": _digest(model),
        "onebit": onebit,
    }


@pytest.mark.timeout(200)
def test_inf_gradient_on_one_rank_skips_everywhere() -> None:
    everyone = spawn(_nan_all, 2, timeout_s=180)
    for name in CLASSES:
        _check_skipped([r[name] for r in everyone])


def _check_skipped(results: list[dict]) -> None:
    for r in results:
        assert r["skipped"] == 2
        assert all(a and b for a, b in r["unchanged"].values())
        assert torch.equal(r["digest"], results[0]["digest"])
        if r["onebit"] is not None:
            assert torch.isfinite(r["onebit"]["worker_error"]).all()


def _ddp_all(rank: int, world: int) -> dict:
    return {name: _ddp_vs_plain(rank, name) for name in ("lamb", "onebit-lamb")}


def _ddp_vs_plain(rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    digests = []
    calls = 0
    for use_ddp in (False, True):
        model = _model()
        opt = _make(name, model)
        net: torch.nn.Module = model
        if use_ddp:
            net = DDP(model)
            opt.register_ddp(net)
            COUNTER.reset()
        for t in range(FREEZE + 3):
            g = torch.Generator().manual_seed(100 * t + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        digests.append(_digest(model))
        if use_ddp:
            calls = COUNTER.snapshot().get("ddp.allreduce", {}).get("calls", 0)
    dist.barrier()
    return digests[0], digests[1], calls


@pytest.mark.timeout(200)
def test_under_ddp_matches_plain_use() -> None:
    """DDP averages gradients in warmup (and always for LAMB) and sends nothing after the
    freeze; with 2 ranks every sum is a+b, so both paths agree to the bit."""
    for per_rank in spawn(_ddp_all, 2, timeout_s=180):
        for name, (plain, with_ddp, calls) in per_rank.items():
            assert torch.equal(plain, with_ddp), name
            steps_averaged = FREEZE + 3 if name == "lamb" else FREEZE
            assert calls == steps_averaged, name  # one bucket per averaged step, none after


def _dcp_round_trip(rank: int, world: int, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    steps, stop = FREEZE + 5, FREEZE + 2
    straight = _digest(_trained("onebit-lamb", rank, range(steps))[0])
    model, opt = _trained("onebit-lamb", rank, range(stop))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    # A fresh run, brought to the same stage so its state has the shapes to load into
    # (as torch.distributed.checkpoint.state_dict does for lazily created state).
    model, opt = _trained("onebit-lamb", rank, range(stop), seed=7, data_offset=50)
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=path)
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    for t in range(stop, steps):
        _local_step(model, opt, rank, t)
    return straight, _digest(model)


@pytest.mark.timeout(150)
def test_torch_distributed_checkpoint_keeps_each_ranks_error_feedback(tmp_path: Path) -> None:
    for straight, resumed in spawn(_dcp_round_trip, 2, (str(tmp_path / "dcp"),), timeout_s=120):
        assert torch.equal(straight, resumed)


def _ddp_16bit(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = _model()
        opt = _make("onebit-lamb", model)
        net = DDP(model)
        opt.register_ddp(net, wire_dtype=dtype)
        COUNTER.reset()
        for t in range(FREEZE + 3):
            g = torch.Generator().manual_seed(100 * t + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        out[str(dtype)] = (_digest(model), COUNTER.snapshot())
    return out


@pytest.mark.timeout(200)
def test_16bit_warmup_exchange_halves_the_bytes_and_stays_close() -> None:
    """The warmup's gradients may travel as fp16/bf16: half the bytes of fp32, ranks still
    equal, parameters within the rounding of the wire format."""
    ranks = spawn(_ddp_16bit, 2, timeout_s=180)
    fp32, fp32_ops = ranks[0]["torch.float32"]
    for dtype, op, tol in (
        ("torch.float16", "ddp.fp16", 1e-3),
        ("torch.bfloat16", "ddp.bf16", 1e-2),
    ):
        digest, ops = ranks[0][dtype]
        assert torch.equal(digest, ranks[1][dtype][0])
        assert ops[op]["calls"] == fp32_ops["ddp.allreduce"]["calls"] == FREEZE
        assert ops[op]["wire_bytes"] * 2 == fp32_ops["ddp.allreduce"]["wire_bytes"]
        assert (digest - fp32).abs().max() < tol
        assert not torch.equal(digest, fp32)  # it did travel in 16 bits
