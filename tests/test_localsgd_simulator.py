"""The virtual-clock simulator: deterministic, equal budgets, sync timing, and the CLI."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.localsgd.inner_state import restart_first_moment_
from thinwire.localsgd.server import Work
from thinwire.localsgd.simulator import SimConfig, gpt_config, simulate, time_to_reach
from thinwire.localsgd.worker import LocalWorker
from thinwire.train.data import TextData
from thinwire.train.model import GPT

_SMALL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16}


def _cfg(method: str, **kw: object) -> SimConfig:
    args: dict = dict(
        method=method, seconds_per_step=(0.5, 1.0, 2.0), local_steps=4, steps_per_worker=8,
        model_overrides=_SMALL, batch_size=4, warmup_steps=2, eval_points=2, eval_sequences=8,
    )  # fmt: skip
    args.update(kw)
    return SimConfig(**args)


@pytest.fixture(scope="module")
def data() -> TextData:
    return TextData(None, 16, 0.05, 0)


@pytest.mark.timeout(120)
def test_simulator_is_deterministic_for_a_seed(data: TextData) -> None:
    a = simulate(_cfg("dn-dylu", jitter=0.2), data)
    b = simulate(_cfg("dn-dylu", jitter=0.2), data)
    assert a["curve"] == b["curve"]
    c = simulate(_cfg("dn-dylu", jitter=0.2, seed=1), data)
    assert c["curve"] != a["curve"]


@pytest.mark.timeout(120)
def test_sync_rounds_wait_for_the_slowest_and_budgets_are_equal(data: TextData) -> None:
    sync = simulate(_cfg("sync"), data)
    # 8 steps per worker, H=4: two rounds, each as long as the slowest worker's 4 steps.
    assert sync["inner_steps"] == 24 and sync["updates"] == 6
    assert sync["sim_time_s"] == pytest.approx(2 * 4 * 2.0)
    for method in ("naive", "dn", "dn-dylu"):
        run = simulate(_cfg(method), data)
        assert run["inner_steps"] == 24
        assert run["sim_time_s"] < sync["sim_time_s"]  # nobody waits for the slowest
    assert time_to_reach(sync["curve"], sync["final_val_loss"]) == sync["sim_time_s"]


def test_bad_simulation_settings() -> None:
    with pytest.raises(ConfigError, match="unknown method"):
        simulate(_cfg("fast"))
    with pytest.raises(ConfigError, match="seconds per step must be > 0"):
        simulate(_cfg("dn", seconds_per_step=(1.0, 0.0)))
    with pytest.raises(ConfigError, match="local-steps must be >= 1"):
        simulate(_cfg("dn", local_steps=0))
    with pytest.raises(ConfigError, match=r"c must be in \[0, 1/N\]"):
        simulate(_cfg("dn", c=0.5))
    with pytest.raises(ConfigError, match="unknown inner momentum 'reset'"):
        simulate(_cfg("dn-dylu", inner_momentum="reset"))
    with pytest.raises(ConfigError, match="shards must be >= 1, got 0"):
        simulate(_cfg("dn", shards=0))


@pytest.mark.timeout(120)
def test_more_shards_than_workers_are_balanced_by_least_progress(data: TextData) -> None:
    # One shard per worker: each keeps its own, so the fast worker's runs past its plan.
    own = simulate(_cfg("dn"), data)
    assert len(own["shard_steps"]) == 3
    assert max(own["shard_steps"]) > own["shard_planned"][0]
    # Twice as many shards as workers: every shard gets its planned share.
    spread = simulate(_cfg("dn", shards=6), data)
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
    model = GPT(gpt_config(_cfg("dn-dylu")))
    shards = data.shards(2)
    a = LocalWorker(model, shards, seq_len=16, batch_size=4, lr=3e-3, warmup_steps=0,
                    min_lr_ratio=0.1)  # fmt: skip
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
def test_simulator_restarts_the_inner_moment_by_default_with_dylu(data: TextData) -> None:
    default = simulate(_cfg("dn-dylu"), data)
    fresh = simulate(_cfg("dn-dylu", inner_momentum="round"), data)
    keep = simulate(_cfg("dn-dylu", inner_momentum="keep"), data)  # still reachable
    assert default["config"]["inner_momentum"] == "round"
    assert keep["config"]["inner_momentum"] == "keep"
    assert default["curve"] == fresh["curve"]
    assert fresh["inner_steps"] == keep["inner_steps"] == 24
    assert fresh["curve"][0] == keep["curve"][0]  # same start
    assert fresh["final_val_loss"] != keep["final_val_loss"]
    assert _cfg("dn").resolved_inner_momentum() == "keep"  # no DyLU: DiLoCo's rule
    assert _cfg("sync").resolved_inner_momentum() == "keep"
    assert _cfg("dn", inner_momentum="round").resolved_inner_momentum() == "round"


@pytest.mark.timeout(200)
def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["simulate", "async", "--methods", "sync,dn", "--seconds-per-step", "1,3",
         "--local-steps", "2", "--steps", "4", "--model", "tiny", "--batch-size", "2",
         "--eval-points", "2", "--inner-momentum", "round", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    blob = json.loads((tmp_path / "results.json").read_text())
    assert set(blob["summary"]) == {"sync", "dn"}
    assert [r["config"]["inner_momentum"] for r in blob["runs"]] == ["round", "round"]
    assert blob["summary"]["sync"]["loss_vs_sync"] == 1.0
    assert (tmp_path / "loss_vs_time.png").exists()
    assert "speedup" in capsys.readouterr().out
    assert main(["simulate", "async", "--seconds-per-step", "1,x", "--out", str(tmp_path)]) == 2


def test_cli_inner_momentum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "async", "--inner-momentum", "reset", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "unknown inner momentum 'reset'" in err
    assert not (tmp_path / "results.json").exists()
