"""Asynchronous Local-SGD whose workers are islands of ranks, the inner model sharded by FSDP2.

An island of 2 ranks must train what one worker with the whole model trains (the same
batches, split between its ranks, gradients averaged by FSDP2): synchronous rounds make
that exact up to rounding, checked against the same run with workers of one rank. Also:
the layout of the ranks, a stop and resume (each rank keeps its shard of the inner
state), an asynchronous method with a compressed push, and the one-line refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.comm.launch import DistributedError, spawn
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, Task, for_method, rejoin_async, run_async
from thinwire.localsgd.runtime.island import island_ranks, workers_of
from thinwire.localsgd.task import batch_part

_W_TRUE = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 16 -> 1 rows: FSDP2 gives one rank a row and the other none (an uneven shard).
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _units(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)


def _source(index: int) -> Any:
    def batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * (index + 1) + step)
        x = torch.randn(16, 4, generator=g)
        return {"x": x, "y": x @ _W_TRUE + 0.01 * torch.randn(16, 1, generator=g)}

    return batch


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


@torch.no_grad()
def _evaluate(model: nn.Module) -> float:
    return float(_loss(model, _source(99)(0)))


def _task() -> Task:
    return Task(
        model=_model,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.02),
        shards=lambda n: [_source(i) for i in range(n)],
        loss=_loss,
        evaluate=_evaluate,
        shard=_units,
    )


def _cfg(**kw: Any) -> AsyncConfig:
    base: dict[str, Any] = {
        "steps": 12,
        "local_steps": 3,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "heartbeat_s": 0.2,
        "dead_after_s": 30.0,
    }
    method = kw.pop("method", "sync")
    return for_method(AsyncConfig(**(base | kw)), method)


_KEPT = ("theta", "final_val_loss", "rounds", "steps", "state_restored", "inner_steps")
_KEPT += ("updates_applied", "comm_bytes")
"""What a rank's result brings back to the test (the summary holds more)."""


def _rank(rank: int, world: int, cfg: AsyncConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {k: v for k, v in run_async(_task(), cfg).items() if k in _KEPT}


def test_island_ranks_put_the_leaders_first() -> None:
    assert island_ranks(2, 3) == [[1, 3, 4], [2, 5, 6]]
    assert island_ranks(3, 1) == [[1], [2], [3]]
    assert workers_of(7, 3) == 2 and workers_of(4, 1) == 3
    with pytest.raises(ConfigError, match="must split into islands of 2"):
        workers_of(4, 2)


def test_batch_part_splits_every_tensor_by_rows() -> None:
    batch = {"x": torch.arange(10).view(5, 2), "y": (torch.arange(5), 3), "n": "name"}
    parts = [batch_part(batch, i, 2) for i in range(2)]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert [len(p["y"][0]) for p in parts] == [3, 2]  # the first part one row longer
    assert parts[1]["y"][1] == 3 and parts[1]["n"] == "name"
    assert batch_part(batch, 0, 1) is batch
    with pytest.raises(ConfigError, match="a batch of 5 rows cannot be split over an island of 8"):
        batch_part(batch, 0, 8)


@pytest.mark.timeout(240)
def test_islands_of_two_train_what_workers_of_one_train() -> None:
    whole = spawn(_rank, 3, (_cfg(),), timeout_s=120)
    islands = spawn(_rank, 5, (_cfg(shard_within=2),), timeout_s=120)
    reference, sharded = whole[0]["theta"], islands[0]["theta"]
    assert not torch.equal(reference, _flat_start())  # it trained
    err = (sharded - reference).norm() / reference.norm()
    assert err < 1e-5, f"islands drifted from whole workers: {err:.2e}"
    assert islands[0]["inner_steps"] == whole[0]["inner_steps"] == 24
    # Every rank of an island ran every round: leaders (ranks 1, 2) and their partners.
    assert [r["rounds"] for r in islands[1:]] == [4, 4, 4, 4]
    # Only the leaders talk to the server: the same bytes as workers of one rank.
    assert islands[0]["comm_bytes"] == whole[0]["comm_bytes"]


def _flat_start() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _model().parameters()])


@pytest.mark.timeout(300)
def test_a_stopped_island_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    straight = spawn(_rank, 5, (_cfg(shard_within=2),), timeout_s=120)[0]["theta"]
    kept = {"shard_within": 2, "checkpoint_dir": str(tmp_path)}
    spawn(_rank, 5, (_cfg(stop_after=6, **kept),), timeout_s=120)
    assert sorted(p.name for p in tmp_path.glob("localsgd_worker*.pt")) == [
        f"localsgd_worker{r}.pt" for r in range(1, 5)
    ]  # every rank its own shard of the inner state
    resumed = spawn(_rank, 5, (_cfg(resume=True, **kept),), timeout_s=120)
    assert all(r["state_restored"] for r in resumed[1:])
    torch.testing.assert_close(resumed[0]["theta"], straight, rtol=0, atol=1e-6)
    # A state lost on one host: that island starts fresh on every rank, the other keeps.
    lost = {"shard_within": 2, "checkpoint_dir": str(tmp_path / "lost")}
    spawn(_rank, 5, (_cfg(stop_after=6, **lost),), timeout_s=120)
    (tmp_path / "lost" / "localsgd_worker3.pt").unlink()  # island 0's other rank (1 and 3)
    partial = spawn(_rank, 5, (_cfg(resume=True, **lost),), timeout_s=120)
    assert [r["state_restored"] for r in partial[1:]] == [False, True, False, True]


@pytest.mark.timeout(240)
def test_delayed_nesterov_islands_with_compressed_pushes_and_pulls_learn() -> None:
    cfg = _cfg(
        shard_within=2,
        method="dn-dylu",
        compress="onebit",
        compress_pull="bf16",
        steps=18,
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    out = spawn(_rank, 5, (cfg,), timeout_s=150)
    assert out[0]["inner_steps"] == 36
    assert out[0]["final_val_loss"] < 0.6 * _evaluate(_model())  # 0.45x measured
    leaders, partners = out[1:3], out[3:5]
    assert [r["rounds"] for r in partners] == [r["rounds"] for r in leaders]


@pytest.mark.timeout(120)
def test_islands_that_do_not_divide_the_ranks_are_refused_on_every_rank() -> None:
    with pytest.raises(DistributedError, match="must split into islands of 2"):
        spawn(_rank, 4, (_cfg(shard_within=2),), timeout_s=60)
    with pytest.raises(ConfigError, match="shard_within must be an integer >= 1"):
        _cfg(shard_within=0).validate()


def test_a_rejoin_of_an_island_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot rejoin a worker of 2 ranks"):
        rejoin_async(_task(), _cfg(shard_within=2), 1, host="127.0.0.1", port=1)


def _train_rank(rank: int, world: int, cfg: Any) -> dict[str, Any]:
    from thinwire.train.async_task import run

    return run(cfg)


@pytest.mark.timeout(240)
def test_thinwire_train_runs_islands_like_whole_workers(tmp_path: Path) -> None:
    from conftest import tiny_async_config
    from thinwire.cli.train import format_summary

    runs = {}
    for k in (1, 2):
        cfg = tiny_async_config(tmp_path / f"k{k}", sync=True, shard_within=k)
        runs[k] = spawn(_train_rank, 1 + 2 * k, (cfg,), timeout_s=150)[0]
    whole, islands = runs[1], runs[2]
    assert islands["shard_within"] == 2 and islands["workers"] == 2
    assert islands["inner_steps"] == whole["inner_steps"] == 24
    assert islands["final_val_loss"] == pytest.approx(whole["final_val_loss"], rel=1e-5)
    assert islands["comm_bytes"] == whole["comm_bytes"]  # leaders alone talk to the server
    assert "2 workers of 2 ranks (FSDP2 inside each) plus the server" in format_summary(islands)


def test_thinwire_train_refuses_islands_that_do_not_divide_the_ranks(tmp_path: Path) -> None:
    from conftest import tiny_async_config
    from thinwire.train.algorithms import check_config

    cfg = tiny_async_config(tmp_path, shard_within=2)
    with pytest.raises(ConfigError, match="divide the 3 training ranks"):
        check_config(cfg, 4)
    check_config(cfg, 5)  # 2 islands of 2 and the server


_CALLS = [0]


def _failing_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch.distributed as dist

    _CALLS[0] += 1
    if dist.get_rank() == 3 and _CALLS[0] > 4:  # island 0's second rank, in its 2nd round
        raise RuntimeError("a bad batch on one rank of an island")
    return _loss(model, batch)


def _failing_rank(rank: int, world: int, cfg: AsyncConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = _task()
    task.loss = _failing_loss
    out = run_async(task, cfg)
    return {k: out[k] for k in ("inner_steps", "dead_workers", "complete") if k in out}


@pytest.mark.timeout(240)
def test_a_failed_round_ends_its_island_and_the_run_goes_on() -> None:
    cfg = _cfg(shard_within=2, method="dn", link_timeout_s=20.0, dead_after_s=5.0)
    out = spawn(_failing_rank, 5, (cfg,), timeout_s=150, may_fail=(1, 3))
    server = out[0]
    assert server["dead_workers"] == [1]  # island 0, through its leader
    assert server["inner_steps"] == 24 and server["complete"]  # the other island finished


def test_each_rank_of_an_island_holds_rows_as_fsdp2_lays_them_out() -> None:
    from thinwire.localsgd.algorithm.island_params import _local, row_share

    assert [row_share(torch.Size([1, 16]), 2, r) for r in range(2)] == [16, 0]
    assert [row_share(torch.Size([5, 3]), 2, r) for r in range(2)] == [9, 6]
    assert [row_share(torch.Size([5]), 4, r) for r in range(4)] == [2, 2, 1, 0]
    with pytest.raises(ConfigError, match="shard every parameter along dimension 0"):
        _local(torch.zeros(3, 4), 2, 0)  # all 12 elements where rows 0-1 (8) belong


def _shard_by_columns(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from thinwire.localsgd.algorithm.island_params import scatter_theta_

    mesh = init_device_mesh("cpu", (world,))
    layer = nn.Linear(4, 4)
    fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    theta = torch.arange(20, dtype=torch.float32) if rank == 0 else None
    try:
        scatter_theta_(list(layer.parameters()), theta, mesh.get_group(), rank, world)
    except ConfigError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(120)
def test_parameters_sharded_by_columns_are_refused_not_loaded_into_the_wrong_places() -> None:
    said = spawn(_shard_by_columns, 2, timeout_s=60)
    assert all("shard every parameter along dimension 0" in line for line in said), said
