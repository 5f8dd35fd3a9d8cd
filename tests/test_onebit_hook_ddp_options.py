"""The 1-bit DDP comm hook under DDP options that run collectives of DDP's own while the
hook's thread runs its collectives: ``find_unused_parameters=True`` (a bitmap allreduce
at the end of backward) and BatchNorm buffers broadcast before forward. The hook talks on
a group of its own, so it neither hangs nor aborts, and the overlapped hook still equals
the synchronous one bit for bit."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm import spawn
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook
from thinwire.comm.register import register_comm_hook

WARMUP = 2
STEPS = 8


class _Branchy(nn.Module):
    """An MLP, with BatchNorm (buffers DDP broadcasts before forward) if asked, and with a
    head that forward never uses if asked (DDP must find it unused every step)."""

    def __init__(self, batchnorm: bool, unused: bool = True) -> None:
        super().__init__()
        norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.body = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 2))
        self.unused = nn.Linear(8, 2) if unused else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _run(rank: int, *, hook: dict[str, Any] | None, batchnorm: bool, unused: bool) -> dict:
    """Momentum SGD on DDP, with the 1-bit hook when ``hook`` gives its options (through
    ``register_comm_hook``; ``close_at``: close the state after that step and go on)."""
    torch.manual_seed(0)
    model = _Branchy(batchnorm, unused)
    # A tiny cap: several buckets, so the thread is still busy when DDP's bitmap goes out.
    ddp = DDP(model, bucket_cap_mb=0.0002, find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = dict(hook or {})
    close_at = options.pop("close_at", None)
    state = None
    if hook is not None:
        state = register_comm_hook(ddp, "onebit", optimizer=opt, warmup_steps=WARMUP, **options)
    grads, losses = [], []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(16, 8, generator=gen)
        loss = (ddp(x) - x[:, :2].sin()).pow(2).mean()
        loss.backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if state is not None and step == close_at:
            state.close()
    if state is not None:
        state.close()
    # Each rank's running statistics saw its own batch last; DDP's broadcast at the next
    # forward makes them rank 0's (eval: no update after it).
    ddp.eval()
    with torch.no_grad():
        ddp(torch.zeros(2, 8))
    flat = torch.cat([t.reshape(-1) for t in model.state_dict().values() if t.is_floating_point()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return {
        "grads": grads,
        "losses": losses,
        "replicas_equal": all(torch.equal(everyone[0], t) for t in everyone),
    }


def _same(a: list[list[torch.Tensor | None]], b: list[list[torch.Tensor | None]]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for sa, sb in zip(a, b, strict=True)
        for x, y in zip(sa, sb, strict=True)
    )


def _options_body(rank: int, world: int, batchnorm: bool, unused: bool) -> dict:
    plain = _run(rank, hook=None, batchnorm=batchnorm, unused=unused)
    sync = _run(rank, hook={"overlap": False}, batchnorm=batchnorm, unused=unused)
    over = _run(rank, hook={}, batchnorm=batchnorm, unused=unused)
    # DDP's own group passed explicitly, and a close() mid-run: the same bits again.
    given = _run(
        rank,
        hook={"process_group": dist.group.WORLD, "close_at": WARMUP + 2},
        batchnorm=batchnorm,
        unused=unused,
    )
    return {
        "warmup_equal": _same(plain["grads"][:WARMUP], over["grads"][:WARMUP]),
        "over_equals_sync": _same(sync["grads"], over["grads"]),
        "given_equals_sync": _same(sync["grads"], given["grads"]),
        "replicas_equal": [r["replicas_equal"] for r in (plain, sync, over, given)],
        "unused_grad": [g[-1] for g in over["grads"]],
        "losses": over["losses"],
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("batchnorm", "unused"),
    [(False, True), (True, False), (True, True)],
    ids=["find_unused", "batchnorm_broadcast_buffers", "both"],
)
def test_hook_trains_under_ddp_options_with_collectives_of_their_own(
    batchnorm: bool, unused: bool
) -> None:
    for rep in spawn(_options_body, 2, args=(batchnorm, unused), timeout_s=180):
        assert rep["warmup_equal"]  # plain DDP's average in warmup
        assert rep["over_equals_sync"] and rep["given_equals_sync"]
        assert all(rep["replicas_equal"])
        if unused:  # the unused head gets no gradient, as under plain DDP
            assert all(g is None for g in rep["unused_grad"])
        assert all(torch.isfinite(torch.tensor(rep["losses"])))


def _subgroup_body(rank: int, world: int) -> dict | None:
    # DDP on ranks 0 and 1 only; rank 2 never touches the hook (nor its group).
    sub = dist.new_group([0, 1])
    if rank == 2:
        return None
    torch.manual_seed(0)
    model = _Branchy(batchnorm=False)
    ddp = DDP(model, process_group=sub, find_unused_parameters=True)
    state = register_comm_hook(ddp, "onebit", warmup_steps=1)
    for step in range(5):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step + 7 * rank))
        ddp(x).pow(2).mean().backward()
        if step == 2:
            state.close()  # the next bucket makes a new group among the members
    group = state.group()
    out = {"group_ranks": dist.get_process_group_ranks(group), "distinct": group is not sub}
    out["grads"] = [p.grad for p in model.body.parameters()]
    state.close()
    return out


@pytest.mark.timeout(120)
def test_hook_on_a_subgroup_makes_its_group_among_the_members() -> None:
    reports = spawn(_subgroup_body, 3, timeout_s=100)
    assert reports[2] is None
    for rep in reports[:2]:
        assert rep["group_ranks"] == [0, 1] and rep["distinct"]
    for a, b in zip(reports[0]["grads"], reports[1]["grads"], strict=True):
        assert torch.equal(a, b)


def _unpickled_body(rank: int, world: int) -> dict:
    """A state unpickled (no group, no thread) makes its group at its first bucket."""
    ddp = DDP(_Branchy(batchnorm=False), find_unused_parameters=True)
    state = pickle.loads(pickle.dumps(OneBitHookState(warmup_steps=1)))
    ddp.register_comm_hook(state, onebit_hook)
    for step in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step + 7 * rank))
        ddp(x).pow(2).mean().backward()
    ranks = dist.get_process_group_ranks(state.group())
    state.close()
    return {"ranks": ranks, "grad": ddp.module.body[0].weight.grad}


@pytest.mark.timeout(120)
def test_unpickled_state_makes_its_group_at_first_use() -> None:
    reports = spawn(_unpickled_body, 2, timeout_s=100)
    assert all(rep["ranks"] == [0, 1] for rep in reports)
    assert torch.equal(reports[0]["grad"], reports[1]["grad"])
