"""Synchronous DiLoCo: reduction to inner+outer step, multi-rank averaging, resume, trainer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm import COUNTER
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.diloco import DiLoCo
from thinwire.train.algorithms import make_strategy
from thinwire.train.config import TrainConfig


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(i: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, rank: int = 0) -> None:
    x, y = _batch(i, rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_w1_h1_is_the_inner_step_then_the_outer_nesterov_step() -> None:
    model, ref = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_global = [p.detach().clone() for p in ref.parameters()]
    ref_outer = torch.optim.SGD(ref_global, lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(model, opt, sync_every=1, outer_lr=0.7, inner_momentum="keep") as diloco:
        for i in range(5):
            _inner_step(model, opt, i)
            # reference: the same inner step, then SGD(nesterov) on theta - theta_w
            _inner_step(ref, ref_opt, i)
            with torch.no_grad():
                for g, p in zip(ref_global, ref.parameters(), strict=True):
                    g.grad = g - p
                ref_outer.step()
                for g, p in zip(ref_global, ref.parameters(), strict=True):
                    p.copy_(g)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p, q)
    assert diloco.outer_steps == 5
    _inner_step(model, opt, 9)  # hook removed on exit: no more syncs
    assert diloco.outer_steps == 5


def test_state_dict_resumes_exactly_mid_round() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = DiLoCo(model, opt, sync_every=3)  # restart rule: its hooks see the same state
    for i in range(4):  # one sync, then one step into the next round
        _inner_step(model, opt, i)
        d.after_inner_step()
    saved = copy.deepcopy((d.state_dict(), opt.state_dict(), model.state_dict()))
    twin = _model(seed=5)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(saved[1])
    twin_d = DiLoCo(twin, twin_opt, sync_every=3)
    twin_d.load_state_dict(saved[0])
    for i in range(4, 9):
        _inner_step(model, opt, i)
        d.after_inner_step()
        _inner_step(twin, twin_opt, i)
        twin_d.after_inner_step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("h", "match"), [(0, "must be an integer >= 1"), (2.5, "must be an integer")]
)
def test_bad_h(h: Any, match: str) -> None:
    model = _model()
    with pytest.raises(ConfigError, match=match):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=h)
    with pytest.raises(ConfigError, match="unknown compression"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, compress="int3")


@pytest.mark.parametrize("mode", [None, "keep", "round", "restart", "fresh"])
def test_trainer_diloco_applies_the_inner_state_rule_after_each_sync(mode: str | None) -> None:
    model = _model()
    cfg = TrainConfig(algo="diloco", local_steps=2, inner_momentum=mode, steps=4)
    strategy = make_strategy(model, cfg)
    opt = strategy.optimizer
    rule = mode or "restart"  # the default, the same for every method
    for step in range(1, 4):  # the second step syncs (a round is H = 2 steps)
        _inner_step(model, opt, step)
        assert strategy.after_step is not None
        strategy.after_step(step)
        states = list(opt.state.values())
        if step == 2 and rule == "fresh":  # a new optimizer: no state at all
            assert states == []
            continue
        zeroed = not any(bool(s["exp_avg"].any()) for s in states)
        # Right after the sync the next round starts from a zero first moment under the
        # round and restart rules; the second moment and step count carry over.
        assert zeroed == (step == 2 and rule in ("round", "restart")), step
        assert all(bool(s["exp_avg_sq"].any()) for s in states)
        expected = 1 if (step == 3 and rule == "fresh") else step
        assert all(int(s["step"]) == expected for s in states)
    with pytest.raises(ConfigError, match="unknown inner-state rule 'reset'"):
        DiLoCo(model, opt, 2, inner_momentum="reset")


def test_outer_momentum_zero_is_plain_averaging() -> None:
    # beta = 0, lr = 1 on one worker: the new theta is the replica's parameters.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    d = DiLoCo(model, opt, 2, outer_lr=1.0, outer_momentum=0.0)
    for i in range(2):
        _inner_step(model, opt, i)
    local = [p.detach().clone() for p in model.parameters()]
    assert d.after_inner_step(2)
    for g, p in zip(d.global_params, local, strict=True):
        torch.testing.assert_close(g, p)
    with pytest.raises(ConfigError, match="outer momentum must be in"):
        DiLoCo(model, opt, 2, outer_momentum=1.0)


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    runs = {c: _two_ranks_one(rank, c) for c in ("none", "bf16", "onebit")}
    runs["onebit-plain"] = _two_ranks_one(rank, "onebit", error_feedback=False)
    return runs


def _two_ranks_one(rank: int, compress: str, error_feedback: bool = True) -> dict[str, Any]:
    COUNTER.reset()
    model = _model(seed=rank)  # different inits: DiLoCo broadcasts rank 0's
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(
        model, opt, sync_every=3, outer_lr=0.7, compress=compress, error_feedback=error_feedback
    )
    with diloco as d:
        start = [p.detach().clone() for p in model.parameters()]
        for i in range(3):
            _inner_step(model, opt, i, rank)  # the third step's hook syncs
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    errors = d.state_dict().get("onebit", {})
    return {
        "start": start,
        "flat": flat,
        "outer": d.outer_steps,
        "bytes": COUNTER.snapshot(),
        "residual": [errors[k].abs().sum().item() for k in ("worker_error", "server_error")]
        if errors
        else None,
    }


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return spawn(_two_ranks, 2, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compress", ["none", "bf16", "onebit"])
def test_two_ranks_average_and_stay_equal(compress: str, two_rank_results: list) -> None:
    a, b = (r[compress] for r in two_rank_results)
    for p, q in zip(a["start"], b["start"], strict=True):
        assert torch.equal(p, q)  # rank 0's initial weights everywhere
    assert torch.equal(a["flat"], b["flat"]) and a["outer"] == 1
    # Reference: the mean pseudo-gradient of both ranks' own 3 AdamW steps, one outer step.
    models = [_model(seed=0), _model(seed=0)]
    theta0 = torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])
    pseudo = []
    for r, m in enumerate(models):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for i in range(3):
            _inner_step(m, opt, i, r)
        pseudo.append(theta0 - torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    # First Nesterov step from zero momentum: theta -= lr * (1 + beta) * g.
    expected = theta0 - 0.7 * 1.9 * torch.stack(pseudo).mean(0)
    if compress == "onebit":  # signs times a scale: right direction, not the exact mean
        cos = torch.nn.functional.cosine_similarity(a["flat"] - theta0, expected - theta0, dim=0)
        assert cos > 0.6
    else:
        err = (a["flat"] - expected).norm() / (expected - theta0).norm()
        assert err < {"none": 1e-6, "bf16": 1e-2}[compress]
    op = {"none": "diloco.allreduce", "bf16": "diloco.allreduce.bf16"}.get(compress)
    if op is not None:
        assert a["bytes"][op]["calls"] == 1


@pytest.mark.timeout(120)
def test_one_bit_without_error_feedback_carries_nothing(two_rank_results: list) -> None:
    """``error_feedback=False``: the first sync is the same code (it starts from zero
    error either way), and nothing is left to carry into the next one; with the feedback
    on the worker and server residuals hold what the signs lost. Other codecs have no
    rounding to carry: refused."""
    for rank in two_rank_results:
        fed, plain = rank["onebit"], rank["onebit-plain"]
        assert torch.equal(fed["flat"], plain["flat"])
        # (the server's: rank 0's segment; the small model leaves rank 1's all padding)
        assert plain["residual"] == [0.0, 0.0] and fed["residual"][0] > 0
    assert two_rank_results[0]["onebit"]["residual"][1] > 0
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ConfigError, match="error feedback is onebit's here: 'bf16'"):
        DiLoCo(model, opt, 2, compress="bf16", error_feedback=False)


def _train_rank(rank: int, world: int, out: str) -> dict[str, Any]:
    from thinwire.train.config import TrainConfig
    from thinwire.train.trainer import train

    cfg = TrainConfig(
        algo="diloco",
        model="tiny",
        n_layer=1,
        n_embd=32,
        n_head=2,
        seq_len=16,
        steps=6,
        local_steps=3,
        batch_size=4,
        eval_interval=6,
        eval_sequences=8,
        log_interval=3,
        checkpoint_interval=0,
        out_dir=out,
        progress=False,
        device="cpu",
    )
    return train(cfg)


@pytest.mark.timeout(120)
def test_trainer_runs_diloco(tmp_path: Path) -> None:
    summary = spawn(_train_rank, 2, (str(tmp_path),), timeout_s=100)[0]
    assert summary["algo"] == "diloco" and summary["steps"] == 6
    assert summary["comm_by_op"]["diloco.allreduce"]["calls"] == 2  # 6 steps / H=3
    assert "ddp.allreduce" not in summary["comm_by_op"]


# --- the trainable set may change; no `with` needed --------------------------------------
def _unfreeze_rank(rank: int, world: int) -> dict[str, Any]:
    """The last layer frozen at construction and thawed at step 3; the first layer's
    bias trains one round, then is frozen (its momentum is not zero by then)."""
    model = _model()
    first, last = model[0], model[2]
    last.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # torch skips frozen ones
    with DiLoCo(model, opt, sync_every=3, outer_lr=0.7) as diloco:
        for i in range(1, 7):
            if i == 3:
                last.requires_grad_(True)
            if i == 4:
                first.bias.requires_grad_(False)
                frozen_at = first.bias.detach().clone()
            _inner_step(model, opt, i, rank)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "bias": first.bias.detach().clone(),
        "frozen_at": frozen_at,
        "outer": diloco.outer_steps,
    }


@pytest.mark.timeout(120)
def test_a_parameter_thawed_later_is_synced_and_a_frozen_one_stays_put() -> None:
    a, b = spawn(_unfreeze_rank, 2, timeout_s=100)
    assert a["outer"] == b["outer"] == 2
    start = _model()
    for p, q, p0 in zip(a["params"], b["params"], start.parameters(), strict=True):
        assert torch.equal(p, q) and not torch.equal(p, p0)  # every one moved, and agrees
    # Frozen mid-round: the second sync leaves it as the user froze it (each rank's own
    # last inner step), with no outer-momentum step on top.
    assert torch.equal(a["bias"], a["frozen_at"]) and torch.equal(b["bias"], b["frozen_at"])


def _no_with_rank(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, opt, sync_every=2)  # no `with`, no after_inner_step calls
    for i in range(4):
        _inner_step(model, opt, i, rank)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    diloco.__exit__(None, None, None)  # as leaving a `with` block: no more syncs
    _inner_step(model, opt, 4, rank)
    _inner_step(model, opt, 5, rank)
    return {"flat": flat, "outer": diloco.outer_steps}


@pytest.mark.timeout(120)
def test_diloco_syncs_without_with_until_exit() -> None:
    a, b = spawn(_no_with_rank, 2, timeout_s=100)
    assert a["outer"] == b["outer"] == 2
    assert torch.equal(a["flat"], b["flat"])


def test_a_loop_that_counts_its_own_steps_is_not_counted_twice() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = DiLoCo(model, opt, sync_every=3)
    synced = []
    for i in range(7):
        _inner_step(model, opt, i)
        synced.append(d.after_inner_step(i + 1))
    assert synced == [False, False, True, False, False, True, False]
    assert (d.local_step, d.outer_steps) == (7, 2)


def test_a_save_from_before_frozen_parameters_were_tracked_loads() -> None:
    """The earlier state: global/local copies and the outer SGD over the trainable
    parameters only. Loaded, each lands on its own parameter, momentum included."""
    model = _model()
    model[0].bias.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    glob = [p.detach().clone() + 1 for p in trainable]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    for g in glob:
        g.grad = torch.full_like(g, 0.5)
    outer.step()
    old = {
        "global": [g.detach().clone() for g in glob],
        "local": [p.detach().clone() + 2 for p in trainable],
        "outer": outer.state_dict(),
        "local_step": 4,
        "outer_steps": 1,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = DiLoCo(model, opt, sync_every=3, outer_lr=0.7)
    bias = model[0].bias.detach().clone()
    d.load_state_dict(old)
    live = [i for i, p in enumerate(d.params) if p.requires_grad]
    assert live == [0, 2, 3]
    for k, i in enumerate(live):
        assert torch.equal(d.global_params[i], glob[k])
        assert torch.equal(d.params[i].detach(), old["local"][k])
        buf = d.outer.state[d.global_params[i]]["momentum_buffer"]
        assert torch.equal(buf, outer.state[glob[k]]["momentum_buffer"])
    assert torch.equal(model[0].bias, bias) and d.outer.state.get(d.global_params[1]) is None
    assert d.state_dict()["trainable"] == live


def _frozen_mid_round_rank(rank: int, world: int) -> dict[str, Any]:
    """The first layer's bias trains one step of the second round, then is frozen: the
    replicas moved apart before the freeze."""
    model = _model()
    bias = model[0].bias
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with DiLoCo(model, opt, sync_every=3, outer_lr=0.7) as diloco:
        for i in range(1, 10):
            if i == 5:
                bias.requires_grad_(False)
            _inner_step(model, opt, i, rank)
            if i == 6:
                after = bias.detach().clone()
    return {"after": after, "bias": bias.detach().clone(), "outer": diloco.outer_steps}


@pytest.mark.timeout(120)
def test_a_parameter_frozen_mid_round_ends_its_round_then_stays_put() -> None:
    a, b = spawn(_frozen_mid_round_rank, 2, timeout_s=100)
    assert a["outer"] == b["outer"] == 3
    # Its round ends in the plain average of the replicas, so they agree again.
    assert torch.equal(a["after"], b["after"])
    # From then on it stays as the user froze it: no outer-momentum step on top.
    assert torch.equal(a["bias"], a["after"]) and torch.equal(b["bias"], b["after"])


def test_a_frozen_backbone_costs_no_global_copy_and_no_checkpoint_space() -> None:
    model = _model()
    model[0].requires_grad_(False)  # the backbone, frozen at construction
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = DiLoCo(model, opt, sync_every=2)
    for g, p in zip(d.global_params[:2], model[0].parameters(), strict=True):
        assert g.data_ptr() == p.data_ptr()  # a view of the parameter itself
    for i in range(4):
        _inner_step(model, opt, i)
    state = d.state_dict()
    assert [t.numel() for t in state["global"][:2]] == [0, 0]
    assert [t.numel() for t in state["local"][:2]] == [0, 0]
    # Thawed: from its next inner step it has a copy of its own, taken before that step.
    model[0].requires_grad_(True)
    start = model[0].weight.detach().clone()
    _inner_step(model, opt, 4)
    assert d.global_params[0].data_ptr() != model[0].weight.data_ptr()
    assert torch.equal(d.global_params[0], start)
    # A resume into a fresh DiLoCo puts the save back as it was.
    state = d.state_dict()
    fresh = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=2)
    fresh.load_state_dict(state)
    for g, h in zip(fresh.global_params, d.global_params, strict=True):
        assert torch.equal(g, h)
    assert fresh.global_params[0].data_ptr() != model[0].weight.data_ptr()
    d.close()
    fresh.close()
