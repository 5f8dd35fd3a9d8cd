"""The 1-bit DDP comm hook: equals plain DDP in warmup, trains after it, pickles, resumes."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm import COUNTER, spawn
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook

WARMUP = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 8, generator=gen)
    w = torch.arange(8, dtype=torch.float32) / 8
    return x, (x @ w).unsqueeze(1).sin()


def _train(rank: int, hook: bool, steps: int, opt_name: str) -> tuple[list, list, object]:
    # A tiny bucket cap gives several buckets, so per-bucket residuals are exercised.
    ddp = DDP(_model(), bucket_cap_mb=0.0002)
    state = None
    if hook:
        state = OneBitHookState(warmup_steps=WARMUP)
        ddp.register_comm_hook(state, onebit_hook)
    opt_cls = torch.optim.Adam if opt_name == "adam" else torch.optim.SGD
    opt = opt_cls(ddp.parameters(), lr=0.01 if opt_name == "adam" else 0.1)
    x, y = _data(rank)
    grads, losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        losses.append(loss.item())
        opt.step()
    return grads, losses, state


def _hook_body(rank: int, world: int, opt_name: str) -> dict:
    plain_grads, _, _ = _train(rank, hook=False, steps=WARMUP, opt_name=opt_name)
    COUNTER.reset()
    grads, losses, state = _train(rank, hook=True, steps=60, opt_name=opt_name)
    # Global loss: average over ranks, so the check does not depend on one shard.
    start = torch.tensor([losses[WARMUP]])
    end = torch.tensor([sum(losses[-5:]) / 5])
    dist.all_reduce(start)
    dist.all_reduce(end)
    blob = pickle.dumps(state)
    restored = pickle.loads(blob)
    return {
        "warmup_equal": all(
            torch.allclose(a, b, rtol=1e-6, atol=1e-7)
            for step_a, step_b in zip(plain_grads, grads[:WARMUP], strict=True)
            for a, b in zip(step_a, step_b, strict=True)
        ),
        "compressed_grads": grads[-1],
        "start": start.item() / world,
        "end": end.item() / world,
        "buckets": len(state.state_dict()["buckets"]),
        "iteration": restored.iteration,
        "restored_pg": restored.process_group,
        "restored_buckets": len(restored.state_dict()["buckets"]),
        "onebit_calls": COUNTER.snapshot().get("onebit.phase1", {}).get("calls", 0),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_hook_matches_ddp_in_warmup_then_trains(opt_name: str) -> None:
    reports = spawn(_hook_body, 2, args=(opt_name,), timeout_s=220)
    for rep in reports:
        assert rep["warmup_equal"]
        assert rep["end"] < 0.5 * rep["start"], (rep["start"], rep["end"])
        assert rep["buckets"] >= 2
        assert rep["onebit_calls"] == rep["buckets"] * (60 - WARMUP)
        assert rep["iteration"] == 60 and rep["restored_pg"] is None
        assert rep["restored_buckets"] == rep["buckets"]
    # After warmup the compressed gradients are identical on every rank.
    for a, b in zip(reports[0]["compressed_grads"], reports[1]["compressed_grads"], strict=True):
        assert torch.equal(a, b)


def _nonfinite_body(rank: int, world: int) -> tuple[bool, bool]:
    ddp = DDP(_model())
    state = OneBitHookState(warmup_steps=0)
    ddp.register_comm_hook(state, onebit_hook)
    x, y = _data(rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    before = state.state_dict()["buckets"]
    ddp.zero_grad()
    bad = x.clone()
    if rank == 1:
        bad[0, 0] = float("inf")
    torch.nn.functional.mse_loss(ddp(bad), y).backward()
    after = state.state_dict()["buckets"]
    has_nonfinite = any(not torch.isfinite(p.grad).all() for p in ddp.parameters())
    unchanged = all(
        torch.equal(before[i][k], after[i][k])
        for i in before
        for k in ("worker_error", "server_error")
    )
    return has_nonfinite, unchanged


@pytest.mark.timeout(120)
def test_nonfinite_gradients_pass_through_and_keep_residuals() -> None:
    for has_nonfinite, unchanged in spawn(_nonfinite_body, 2, timeout_s=100):
        assert has_nonfinite and unchanged


def test_state_validates_options() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        OneBitHookState(warmup_steps=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        OneBitHookState(nonfinite="skip")
