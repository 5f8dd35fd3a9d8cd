"""The virtual-clock simulator: deterministic, equal budgets, sync timing, and the CLI."""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimClock, for_method, simulate
from thinwire.localsgd.algorithm.inner_state import restart_first_moment_
from thinwire.localsgd.algorithm.server_core import Work
from thinwire.localsgd.algorithm.virtual_clock import time_to_reach
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.train.async_task import gpt_loss, gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.model import GPT


def _cfg(method: str, **kw: Any) -> AsyncConfig:
    return for_method(
        AsyncConfig(**({"local_steps": 4, "steps": 8, "warmup_steps": 2} | kw)), method
    )


def _sim(
    method: str,
    data: TextData | None = None,
    seconds_per_step: tuple[float, ...] = (0.5, 1.0, 2.0),
    jitter: float = 0.0,
    seed: int = 0,
    **kw: Any,
) -> dict[str, Any]:
    """A small GPT through the simulator: the trainer's task, one config, one clock."""
    model = TrainConfig(
        n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=4, eval_sequences=8, seed=seed
    )
    clock = SimClock(seconds_per_step, jitter=jitter, seed=seed, eval_points=2)
    return simulate(gpt_task(model, data), _cfg(method, **kw), clock)


@pytest.fixture(scope="module")
def data() -> TextData:
    return TextData(None, 16, 0.05, 0)


@pytest.mark.timeout(120)
def test_simulator_is_deterministic_for_a_seed(data: TextData) -> None:
    a = _sim("dn-dylu", data, jitter=0.2)
    b = _sim("dn-dylu", data, jitter=0.2)
    assert a["curve"] == b["curve"]
    c = _sim("dn-dylu", data, jitter=0.2, seed=1)
    assert c["curve"] != a["curve"]


@pytest.mark.timeout(120)
def test_sync_rounds_wait_for_the_slowest_and_budgets_are_equal(data: TextData) -> None:
    sync = _sim("sync", data)
    # 8 steps per worker, H=4: two rounds, each as long as the slowest worker's 4 steps.
    assert sync["inner_steps"] == 24 and sync["updates"] == 6
    assert sync["sim_time_s"] == pytest.approx(2 * 4 * 2.0)
    for method in ("naive", "dn", "dn-dylu"):
        run = _sim(method, data)
        assert run["inner_steps"] == 24
        assert run["sim_time_s"] < sync["sim_time_s"]  # nobody waits for the slowest
    assert time_to_reach(sync["curve"], sync["final_val_loss"]) == sync["sim_time_s"]


def test_bad_simulation_settings() -> None:
    with pytest.raises(ConfigError, match="unknown method"):
        _sim("fast")
    with pytest.raises(ConfigError, match="seconds per step must be > 0"):
        _sim("dn", seconds_per_step=(1.0, 0.0))
    with pytest.raises(ConfigError, match="local-steps must be >= 1"):
        _sim("dn", local_steps=0)
    with pytest.raises(ConfigError, match=r"c must be in \[0, 1/N\]"):
        _sim("dn", c=0.5)
    with pytest.raises(ConfigError, match="unknown inner-state rule 'reset'"):
        _sim("dn-dylu", inner_momentum="reset")
    with pytest.raises(ConfigError, match="shards must be >= 1, got 0"):
        _sim("dn", shards=0)


@pytest.mark.timeout(120)
def test_more_shards_than_workers_are_balanced_by_least_progress(data: TextData) -> None:
    # One shard per worker: each keeps its own, so the fast worker's runs past its plan.
    own = _sim("dn", data)
    assert len(own["shard_steps"]) == 3
    assert max(own["shard_steps"]) > own["shard_planned"][0]
    # Twice as many shards as workers: every shard gets its planned share.
    spread = _sim("dn", data, shards=6)
    assert len(spread["shard_steps"]) == 6
    assert spread["shard_steps"] == spread["shard_planned"]
    assert spread["inner_steps"] == own["inner_steps"] == 24  # the same budget


@pytest.mark.timeout(60)
def test_restarted_first_moment_forgets_earlier_rounds(data: TextData) -> None:
    """A 1-step round (DyLU's slowest worker at small H) must not replay stale momentum.

    Two workers with different momentum histories run the same 1-step round from the same
    theta: with the carried first moment their pseudo-gradients differ (that moment is
    what degraded DN+DyLU), after a restart they agree. The second moment and the step
    count survive the restart.
    """
    torch.manual_seed(0)
    model = GPT(TrainConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16).gpt_config())
    adamw = functools.partial(torch.optim.AdamW, lr=3e-3)
    shards = data.shard_batches(2, batch_size=4)
    a = LocalWorker(
        model, adamw, shards, gpt_loss, warmup_steps=0, min_lr_ratio=0.1, inner_momentum="keep"
    )
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    a.run_round(theta.clone(), Work(0, 0, shard=0, steps=3, lr_clock=0, planned=50))
    b = copy.deepcopy(a)
    for state in b.opt.state.values():
        state["exp_avg"].add_(torch.randn_like(state["exp_avg"]))  # another history
    one_step = Work(0, 1, shard=1, steps=1, lr_clock=3, planned=50)
    ga = copy.deepcopy(a).run_round(theta.clone(), one_step).pseudo_grad
    gb = copy.deepcopy(b).run_round(theta.clone(), one_step).pseudo_grad
    assert not torch.allclose(ga, gb)  # the carried moment dominates a 1-step round
    squares = [s["exp_avg_sq"].clone() for s in a.opt.state.values()]
    assert restart_first_moment_(a.opt) == restart_first_moment_(b.opt) == len(squares) > 0
    for state, square in zip(a.opt.state.values(), squares, strict=True):
        assert not state["exp_avg"].any()
        assert torch.equal(state["exp_avg_sq"], square) and int(state["step"]) == 3
    ga = a.run_round(theta.clone(), one_step).pseudo_grad
    gb = b.run_round(theta.clone(), one_step).pseudo_grad
    torch.testing.assert_close(ga, gb)


@pytest.mark.timeout(120)
def test_simulator_applies_one_inner_state_rule_to_every_method(data: TextData) -> None:
    default = _sim("dn-dylu", data)
    restart = _sim("dn-dylu", data, inner_momentum="restart")
    keep = _sim("dn-dylu", data, inner_momentum="keep")
    assert default["config"]["inner_momentum"] == "restart"
    assert keep["config"]["inner_momentum"] == "keep"
    assert default["curve"] == restart["curve"]
    assert restart["inner_steps"] == keep["inner_steps"] == 24
    assert restart["curve"][0] == keep["curve"][0]  # same start
    assert restart["final_val_loss"] != keep["final_val_loss"]
    for method in ("sync", "naive", "poly", "polythres", "buffer", "dn", "dn-dylu"):
        assert _cfg(method).resolved_inner_momentum() == "restart"  # like for like
        assert _cfg(method, inner_momentum="keep").resolved_inner_momentum() == "keep"


@pytest.mark.timeout(200)
def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--methods",
            "sync,dn",
            "--seconds-per-step",
            "1,3",
            "--local-steps",
            "2",
            "--steps",
            "4",
            "--model",
            "tiny",
            "--batch-size",
            "2",
            "--eval-points",
            "2",
            "--inner-momentum",
            "round",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    blob = json.loads((tmp_path / "results.json").read_text())
    assert set(blob["summary"]["best"]) == {"sync", "dn"}
    assert [r["config"]["inner_momentum"] for r in blob["runs"]] == ["round", "round"]
    assert blob["summary"]["best"]["sync"]["loss_vs_sync"] == 1.0
    assert (tmp_path / "loss_vs_time.png").exists()
    assert "speed-up" in capsys.readouterr().out
    assert main(["simulate", "--seconds-per-step", "1,x", "--out", str(tmp_path)]) == 2


def test_cli_inner_momentum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--inner-momentum", "reset", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "unknown inner-state rule 'reset'" in err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.timeout(120)
def test_the_cli_says_when_a_run_ends_above_its_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--methods", "sync", "--seconds-per-step", "1,3", "--model", "tiny"]
    args += ["--local-steps", "2", "--steps", "6", "--batch-size", "2", "--eval-points", "2"]
    assert main([*args, "--sweep", "sync:outer-lr=8", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: sync outer-lr=8\.0 seed 0 ended above its start \(\d", err)
    assert main([*args, "--out", str(tmp_path / "b")]) == 0  # the default trains: nothing
    assert "ended above its start" not in capsys.readouterr().err
