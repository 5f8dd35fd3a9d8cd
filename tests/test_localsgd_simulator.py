"""The virtual-clock simulator: deterministic, equal budgets, sync timing, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.localsgd.simulator import SimConfig, simulate, time_to_reach
from thinwire.train.data import TextData

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


@pytest.mark.timeout(200)
def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["simulate", "async", "--methods", "sync,dn", "--seconds-per-step", "1,3",
         "--local-steps", "2", "--steps", "4", "--model", "tiny", "--batch-size", "2",
         "--eval-points", "2", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    blob = json.loads((tmp_path / "results.json").read_text())
    assert set(blob["summary"]) == {"sync", "dn"}
    assert blob["summary"]["sync"]["loss_vs_sync"] == 1.0
    assert (tmp_path / "loss_vs_time.png").exists()
    assert "speedup" in capsys.readouterr().out
    assert main(["simulate", "async", "--seconds-per-step", "1,x", "--out", str(tmp_path)]) == 2
