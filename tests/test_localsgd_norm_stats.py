"""Asynchronous Local-SGD's global model gets its own BatchNorm statistics.

theta never runs a forward pass, so the server recomputes its normalization layers'
running statistics from training batches (``AsyncConfig.norm_batches``) before each
evaluation and checkpoint and for the trained model; the simulators do the same before
each evaluation. Checked against statistics computed here by hand, on spawned gloo ranks
for ``run_async`` and in-process for :func:`simulate`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import WarningLines
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimClock, Task, load_trained, run_async, simulate
from thinwire.localsgd.algorithm.norm_stats import NormStats, load_norm_state_, norm_layers

SHIFT = 3.0
"""The data's mean: far from a fresh BatchNorm's running mean of 0."""


class _Net(nn.Module):
    """Conv, BatchNorm, dropout, a linear head; an InstanceNorm that tracks statistics,
    and a buffer of the user's own that a forward pass changes (a call counter)."""

    def __init__(self, own_buffer: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.inorm = nn.InstanceNorm2d(4, track_running_stats=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(4, 2)
        if own_buffer:
            self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "calls"):
            self.calls += 1
        h = F.relu(self.inorm(self.bn(self.conv(x)))).mean((2, 3))
        return self.head(self.drop(h))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _net_with_own_buffer() -> _Net:
    torch.manual_seed(0)
    return _Net(own_buffer=True)


def _batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + shard)
    x = SHIFT + 2.0 * torch.randn(8, 1, 5, 5, generator=g)
    return x, (x.mean((1, 2, 3)) > SHIFT).long()


def _shards(n: int) -> list[Any]:
    return [lambda step, i=i: _batch(step, i) for i in range(n)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _by_hand(model: _Net, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """BatchNorm's running mean over ``batches``: the mean of each batch's channel means."""
    with torch.no_grad():
        means = [model.conv(x).mean((0, 2, 3)) for x, _ in batches]
    return torch.stack(means).mean(0)


# --- the recomputation itself -------------------------------------------------------------
def test_statistics_are_the_plain_mean_over_the_batches_and_nothing_else_moves() -> None:
    model = _net_with_own_buffer()
    sources = _shards(3)
    stats = NormStats(model, sources, _loss, batches=6)
    assert [name for name, _ in norm_layers(model)] == ["bn", "inorm"]
    model.eval()
    rng = torch.get_rng_state()
    momenta = (model.bn.momentum, model.inorm.momentum)
    assert stats.refresh(version=7)
    used = [sources[j % 3](j // 3) for j in range(6)]
    torch.testing.assert_close(model.bn.running_mean, _by_hand(model, used))
    assert int(model.bn.num_batches_tracked) == 6
    assert float(model.inorm.running_var.sub(1).abs().max()) > 1e-3  # it moved too
    assert float(model.calls) == 0  # the user's own buffer is as it was
    assert not model.training  # eval mode is given back
    assert (model.bn.momentum, model.inorm.momentum) == momenta
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's draws are given back
    assert not stats.refresh(version=7)  # the same theta: nothing to do
    saved = stats.state()
    assert set(saved) == {
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
        "inorm.running_mean",
        "inorm.running_var",
        "inorm.num_batches_tracked",
    }
    fresh = _net_with_own_buffer()
    load_norm_state_(fresh, saved)
    assert torch.equal(fresh.bn.running_var, model.bn.running_var)
    with pytest.raises(ConfigError, match=r"buffer 'nope\.running_mean'"):
        load_norm_state_(fresh, {"nope.running_mean": torch.zeros(4)})
    with pytest.raises(ConfigError, match=r"have shape \(3,\)"):
        load_norm_state_(fresh, {"bn.running_mean": torch.zeros(3)})


def test_what_the_model_gets_is_said_when_it_is_not_everything() -> None:
    assert NormStats(_net(), _shards(2), _loss, 16).describe() is None
    off = NormStats(_net(), _shards(2), _loss, 0)
    assert not off.active and "norm_batches=0: the 2 normalization layers" in str(off.describe())
    own = NormStats(_net_with_own_buffer(), _shards(2), _loss, 16)
    assert "1 floating-point buffers outside normalization layers" in str(own.describe())
    plain = NormStats(nn.Linear(2, 2), _shards(2), _loss, 16)
    assert not plain.active and plain.describe() is None and not plain.refresh()
    with pytest.raises(ConfigError, match="norm-batches must be >= 0"):
        AsyncConfig(norm_batches=-1).validate(1)


# --- run_async ----------------------------------------------------------------------------
@torch.no_grad()
def _eval(model: nn.Module) -> dict[str, float]:
    x, y = _batch(10_000, 0)
    return {"loss": float(_loss(model, (x, y))), "bn_mean": float(model.bn.running_mean.mean())}


def _task() -> Task:
    return Task(
        model=_net,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        shards=_shards,
        loss=_loss,
        evaluate=_eval,
    )


def _async_rank(rank: int, world: int, out: str, norm_batches: int, **more: Any) -> dict[str, Any]:
    capture = WarningLines()
    logging.getLogger("thinwire.localsgd").addHandler(capture)
    task = _task()
    cfg = AsyncConfig(
        steps=6,
        local_steps=2,
        dead_after_s=30.0,
        checkpoint_dir=out,
        norm_batches=norm_batches,
        **more,
    )
    summary = run_async(task, cfg)
    return {"summary": summary, "warnings": capture.lines}


@pytest.mark.timeout(120)
def test_run_async_evaluates_and_hands_back_theta_with_its_own_statistics(tmp_path: Path) -> None:
    server, *workers = spawn(_async_rank, 3, (str(tmp_path), 4), timeout_s=100)
    s = server["summary"]
    assert server["warnings"] == [] and all(w["warnings"] == [] for w in workers)
    model = load_trained(_net(), s)
    # theta's statistics over the first 4 batches of the 2 shards, computed here
    used = [_batch(j // 2, j % 2) for j in range(4)]
    torch.testing.assert_close(model.bn.running_mean, _by_hand(model, used))
    assert abs(float(model.bn.running_mean.mean())) > 0.5  # far from a fresh model's 0
    # what the final evaluation scored is that model, and so is the checkpoint's
    assert s["final_metrics"]["bn_mean"] == pytest.approx(float(model.bn.running_mean.mean()))
    assert s["final_val_loss"] == pytest.approx(_eval(model.eval())["loss"])
    again = load_trained(_net(), tmp_path)
    assert torch.equal(again.bn.running_var, model.bn.running_var)
    assert torch.equal(again.inorm.running_mean, model.inorm.running_mean)
    # theta alone: parameters only, the statistics stay a fresh model's
    bare = load_trained(_net(), s["theta"])
    assert torch.equal(bare.bn.running_mean, torch.zeros(4))


def _resumed_rank(
    rank: int, world: int, out: str, stop_after: int | None, resume: bool
) -> dict[str, Any]:
    return _async_rank(rank, world, out, 4, stop_after=stop_after, resume=resume)


@pytest.mark.timeout(180)
def test_a_stopped_and_resumed_run_hands_back_theta_with_its_statistics(tmp_path: Path) -> None:
    out = str(tmp_path)
    stopped = spawn(_resumed_rank, 2, (out, 3, False), timeout_s=100)[0]["summary"]
    assert stopped["stopped_after"] == 3
    done = spawn(_resumed_rank, 2, (out, None, True), timeout_s=100)[0]["summary"]
    model = load_trained(_net(), done)
    used = [_batch(j, 0) for j in range(4)]  # one worker: one shard
    torch.testing.assert_close(model.bn.running_mean, _by_hand(model, used))
    assert not torch.equal(done["theta"], stopped["theta"])
    before, after = stopped["norm_stats"], done["norm_stats"]
    assert not torch.equal(after["bn.running_mean"], before["bn.running_mean"])
    # resumed once more, the budget is met: the checkpoint's statistics, as they were
    again = spawn(_resumed_rank, 2, (out, None, True), timeout_s=100)[0]["summary"]
    assert again["already_done"]
    assert again["final_metrics"] == done["final_metrics"]
    for name, value in after.items():
        assert torch.equal(again["norm_stats"][name], value), name


@pytest.mark.timeout(120)
def test_run_async_without_recomputing_says_so_once(tmp_path: Path) -> None:
    server, *workers = spawn(_async_rank, 2, (str(tmp_path), 0), timeout_s=100)
    assert len(server["warnings"]) == 1, server["warnings"]
    assert "norm_batches=0: the 2 normalization layers keep" in server["warnings"][0]
    assert all(w["warnings"] == [] for w in workers)
    assert "norm_stats" not in server["summary"]
    assert server["summary"]["final_metrics"]["bn_mean"] == 0.0


# --- the simulators -----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["async", "streaming"])
def test_the_simulators_evaluate_theta_with_its_own_statistics(method: str) -> None:
    task = _task()
    extra = {"sync": True, "fragments": 2} if method == "streaming" else {}
    cfg = AsyncConfig(steps=6, local_steps=2, norm_batches=4, **extra)
    out = simulate(task, cfg, SimClock((1.0, 2.0), eval_points=2))
    assert len(out["curve"]) >= 2
    assert all(abs(point["bn_mean"]) > 0.5 for point in out["curve"]), out["curve"]
