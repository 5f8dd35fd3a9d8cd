"""The layers a user's loop trains may change: a data-dependent branch reaches a layer on
one rank and not another, a layer is frozen or unfrozen after the 1-bit switch, a group
is added to a running optimizer. Each is handled as ``torch.optim`` with DDP would handle
it, or said in one line: never a silent mix of ranks' gradients or a layer that never
trains."""

from __future__ import annotations

import logging

import pytest
import torch

from thinwire.comm import spawn
from thinwire.optim import Lamb, OneBitAdam, OneBitLamb

CLASSES = {"lamb": Lamb, "onebit-adam": OneBitAdam, "onebit-lamb": OneBitLamb}


class _Branches(torch.nn.Module):
    """A trunk and two heads of different sizes; ``head`` picks the one a batch uses.
    ``unused`` trains (requires_grad) but no batch ever reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 2)
        self.b = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.trunk(x))).sum(-1)


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, generator=g)


def _grads(model: _Branches, rank: int, t: int, head: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x, y = _batch(rank, t)
    torch.nn.functional.mse_loss(model(x, head), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _branch_run(rank: int, world: int, name: str) -> dict:
    """Rank 0's batches reach head ``a``, the others' head ``b``: each step, what the
    optimizer was given against the exact average (a rank without a gradient counting
    zero, as DDP's find_unused_parameters averages), and the weights."""
    torch.manual_seed(0)
    model = _Branches()
    kw = {} if name == "lamb" else {"freeze_step": 100}
    opt = CLASSES[name](model.parameters(), lr=0.01, **kw)
    head = "a" if rank == 0 else "b"
    out: dict = {"exact": [], "used": [], "unused_grad": [], "weights": []}
    unused = model.unused.weight.detach().clone()
    for t in range(3):
        # Every rank's gradients (the replicas are equal), averaged here: the reference.
        exact = {}
        for r in range(world):
            theirs = _grads(model, r, t, "a" if r == 0 else "b")
            for n, g in theirs.items():
                exact[n] = exact.get(n, 0) + g / world
        model.zero_grad(set_to_none=True)
        x, y = _batch(rank, t)
        torch.nn.functional.mse_loss(model(x, head), y).backward()
        opt.step()
        out["exact"].append(exact)
        out["used"].append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        out["unused_grad"].append(model.unused.weight.grad is None)
    out["weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["unused_moved"] = not torch.equal(model.unused.weight.detach(), unused)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CLASSES))
def test_a_branch_one_rank_does_not_reach_is_averaged_as_zero(name: str) -> None:
    """Before the fix the optimizer packed only the gradients a rank had: rank 0's head
    ``a`` was averaged with rank 1's head ``b`` (or the allreduce failed on their sizes)."""
    results = spawn(_branch_run, 2, (name,), timeout_s=100)
    for rank, res in enumerate(results):
        for exact, used in zip(res["exact"], res["used"], strict=True):
            assert set(used) == set(exact), f"rank {rank}: layers given {set(used)}"
            for n in exact:
                torch.testing.assert_close(used[n], exact[n], msg=f"rank {rank}, {n}")
        assert all(res["unused_grad"]), "a layer no rank reached must keep grad None"
        assert not res["unused_moved"]
    assert torch.equal(results[0]["weights"], results[1]["weights"])


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    )


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    x, y = _batch(0, t)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
    opt.step()


@pytest.mark.parametrize("name", ["onebit-adam", "onebit-lamb"])
def test_a_layer_frozen_after_the_switch_stays_put_and_resumes(name: str) -> None:
    model = _model()
    opt = CLASSES[name](model.parameters(), lr=0.01, freeze_step=3)
    for t in range(5):
        _step(model, opt, t)
    assert opt.compressing
    layer = model[2]
    layer.requires_grad_(False)
    weights = layer.weight.detach().clone()
    momentum = opt.state[layer.weight]["exp_avg"].clone()
    for t in range(5, 9):
        _step(model, opt, t)
    # Before: the frozen layer kept moving on its decaying momentum.
    assert torch.equal(layer.weight.detach(), weights)
    assert torch.equal(opt.state[layer.weight]["exp_avg"], momentum)
    assert opt.compressing, "freezing a layer needs no return to the warmup"
    layer.requires_grad_(True)
    _step(model, opt, 9)
    assert not torch.equal(layer.weight.detach(), weights)
    assert opt.compressing


@pytest.mark.parametrize("name", ["onebit-adam", "onebit-lamb"])
def test_a_layer_unfrozen_after_the_switch_trains(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: it had no momentum, so the compressed stage never moved it, silently."""
    model = _model()
    model[3].requires_grad_(False)
    opt = CLASSES[name](model.parameters(), lr=0.01, freeze_step=3)
    for t in range(5):
        _step(model, opt, t)
    assert opt.compressing
    model[3].requires_grad_(True)
    weights = model[3].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="thinwire.optim"):
        _step(model, opt, 5)
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "2 parameter(s) began to train after the switch at step 3" in m
        and "back to the full-precision warmup, to freeze again at step 8" in m
        for m in said
    ), said
    assert not torch.equal(model[3].weight.detach(), weights)
    assert not opt.compressing and opt.freeze_step == 8
    for t in range(6, 10):
        _step(model, opt, t)
    assert opt.compressing, "the fixed warmup's length again, then compression"
    assert "exp_avg" in opt.state[model[3].weight]


def test_a_group_added_after_the_switch_trains(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    opt = OneBitLamb(list(model[:3].parameters()), lr=0.01, freeze_step="auto", total_steps=40)
    t = 0
    while not opt.compressing:
        _step(model, opt, t)
        t += 1
    opt.add_param_group({"params": list(model[3].parameters())})
    weights = model[3].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="thinwire.optim"):
        _step(model, opt, t)
    assert any("began to train after the switch" in r.getMessage() for r in caplog.records)
    assert not opt.compressing and opt.freeze_step is None  # the automatic rule decides again
    assert not torch.equal(model[3].weight.detach(), weights)


def test_a_layer_no_batch_reaches_does_not_undo_the_switch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unused head trains (requires_grad) but never gets a gradient: not a newcomer.
    Should one reach it only after the switch, the rank says so once."""
    model = _model()
    head = torch.nn.Linear(8, 1)
    opt = OneBitAdam([*model.parameters(), *head.parameters()], lr=0.01, freeze_step=3)
    with caplog.at_level(logging.WARNING, logger="thinwire.optim"):
        for t in range(8):
            _step(model, opt, t)
        assert opt.compressing and not caplog.records
        for t in range(8, 10):
            x, y = _batch(0, t)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
            head.weight.grad = torch.ones_like(head.weight)  # reached, at last
            opt.step()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "have gradients but had none in the warmup" in said[0], said
    assert opt.compressing


def test_a_resume_in_the_warmup_a_new_layer_started_ends_as_the_straight_run() -> None:
    def run(stop: int | None) -> torch.Tensor:
        model = _model()
        model[3].requires_grad_(False)
        opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=3)
        for t in range(12):
            if t == 5:
                model[3].requires_grad_(True)
            if t == stop:  # in the second warmup (steps 6-8): a fresh optimizer, loaded
                state = opt.state_dict()
                opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=3)
                opt.load_state_dict(state)
                assert not opt.compressing and opt.freeze_step == 8
            _step(model, opt, t)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert torch.equal(run(stop=7), run(stop=None))
