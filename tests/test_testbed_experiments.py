"""End-to-end training on the testbed (thinwire.testbed.experiments).

The config handed to each host and the stage split are checked everywhere; one tiny 2-host
run at 1 Gbit/s (needs root, about 30 s on 2 cores) checks that the result carries NIC
bytes agreeing with the collectives' own accounting and a warmup/compression split that
matches where 1-bit LAMB really started compressing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import TINY_FLAGS, own_clusters
from thinwire.errors import ConfigError
from thinwire.testbed import unavailable_reason
from thinwire.testbed.experiments import (
    compare_on_testbed,
    expected_tx_total,
    stage_times,
    train_command,
    train_on_testbed,
)
from thinwire.train.algorithms import default_lr
from thinwire.train.config import TrainConfig

_REASON = unavailable_reason()


def test_train_command_carries_every_field_through_the_config_file(tmp_path: Path) -> None:
    """What a testbed host trains is exactly the config it was handed: every field,
    those no flag sets (FILE_ONLY: betas, the asynchronous timeouts) included."""
    from thinwire.cli.main import build_parser
    from thinwire.cli.train import config_from_args

    cfg = TrainConfig(
        algo="async-diloco",
        model="small",
        steps=80,
        lr=0.0123,
        betas=(0.8, 0.99),
        powersgd_rank=1,
        bias_correction=False,
        dead_after_s=3.0,
        slowdown=(1.0, 2.5),
        dylu=True,
        inner_momentum="keep",
        out_dir=str(tmp_path / "out"),
        progress=False,
    )
    argv = train_command(cfg, tmp_path / "cfg.json", ["--eval-interval", "40"])
    assert argv[:6] == [
        sys.executable,
        "-m",
        "thinwire",
        "train",
        "--config",
        str(tmp_path / "cfg.json"),
    ]
    parsed = config_from_args(build_parser().parse_args(argv[3:]))
    assert parsed.eval_interval == 40  # a flag after the file wins
    assert parsed.to_dict() == {**cfg.to_dict(), "eval_interval": 40}


def test_stage_times_splits_at_freeze_step() -> None:
    # steps 1-4 take 2 s and send 100 bytes each; steps 5-8 take 0.5 s and send 10.
    recs, t, c = [], 0.0, 0
    for s in range(1, 9):
        t += 2.0 if s <= 4 else 0.5
        c += 100 if s <= 4 else 10
        recs.append({"step": s, "time_s": t, "comm_bytes": c, "compressing": int(s >= 4)})
    recs.append({"step": 8, "val_loss": 1.0})  # evaluation records are ignored
    st = stage_times(recs, freeze_step=4, samples_per_step=32)
    assert st["warmup"]["steps"] == 4 and st["compression"]["steps"] == 4
    assert st["warmup"]["mean_step_s"] == pytest.approx(2.0)
    assert st["compression"]["mean_step_s"] == pytest.approx(0.5)
    assert st["compression"]["samples_per_s"] == pytest.approx(64.0)
    assert st["warmup"]["wire_bytes_per_step"] == pytest.approx(100)
    assert st["compression"]["wire_bytes_per_step"] == pytest.approx(10)
    assert st["first_compressing_step"] == 5


def test_stage_times_spreads_coarse_intervals() -> None:
    recs = [{"step": 5, "time_s": 10.0}, {"step": 10, "time_s": 12.5}]
    st = stage_times(recs, freeze_step=5, samples_per_step=1)
    assert st["warmup"]["mean_step_s"] == pytest.approx(2.0)
    assert st["compression"]["mean_step_s"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="no training records"):
        stage_times([{"step": 0, "val_loss": 3.0}], 1, 1)


def test_expected_tx_counts_broadcasts_once_per_receiver() -> None:
    ops = {
        "optim.allreduce": {"calls": 2, "payload_bytes": 800, "wire_bytes": 600},
        "trainer.broadcast": {"calls": 1, "payload_bytes": 100, "wire_bytes": 100},
    }
    # 4 ranks each send the allreduce's 600 bytes; the broadcast reaches 3 receivers.
    assert expected_tx_total(ops, 4) == 4 * 600 + 3 * 100


def test_non_empty_out_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        train_on_testbed(TrainConfig(), 2, "1gbit", tmp_path)


def test_a_spec_setting_the_algorithm_ignores_is_refused_before_any_cluster(
    tmp_path: Path,
) -> None:
    """No host is started (none could be here): the spec is refused first."""
    with pytest.raises(ConfigError, match="lamb does not use freeze_step"):
        compare_on_testbed(["lamb@freeze_step=3"], TrainConfig(), 2, ["1gbit"], tmp_path)


def test_each_algorithm_gets_its_tuned_lr_unless_one_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison commands give LAMB-style and Adam-style optimizers their own
    default peak lr; ``--lr`` (or an lr in ``--config``) sets one for all, and a run
    spec's own lr wins. (Only the routing is checked here: the runs are replaced by a
    recorder.)"""
    from thinwire.cli.main import main
    from thinwire.train import compare as compare_mod

    seen: list[tuple[str, float]] = []

    def recorder(cfgs: list[TrainConfig], workers: int, timeout_s: float) -> list[dict]:
        seen.extend((c.algo, c.lr) for c in cfgs)
        raise KeyboardInterrupt  # stop after recording: the rest needs real runs

    monkeypatch.setattr(compare_mod, "local_runner", recorder)
    (tmp_path / "lr.json").write_text('{"lr": 0.007}')
    for argv, want in [
        (
            ["onebit-lamb", "adamw-powersgd"],
            [default_lr("onebit-lamb"), default_lr("adamw-powersgd")],
        ),
        (["onebit-lamb", "adamw", "--lr", "0.005"], [0.005, 0.005]),
        (["lamb", "adamw@lr=0.001"], [default_lr("lamb"), 0.001]),
        (["lamb", "adamw", "--config", str(tmp_path / "lr.json")], [0.007, 0.007]),
    ]:
        seen.clear()
        out = ["--out", str(tmp_path / "o"), "--overwrite"]
        assert main(["compare", "--algos", *argv, *out]) == 130
        assert [lr for _, lr in seen] == want
    assert default_lr("onebit-lamb") != default_lr("adamw-powersgd")


@pytest.mark.root
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(120)
def test_onebit_lamb_on_two_hosts(tmp_path: Path) -> None:
    before = own_clusters()
    cfg = TrainConfig(
        algo="onebit-lamb",
        model="tiny",
        seq_len=32,
        batch_size=4,
        steps=10,
        freeze_step=4,
        warmup_steps=2,
        eval_interval=10,
        eval_sequences=8,
        checkpoint_interval=0,
    )
    res = train_on_testbed(cfg, hosts=2, rate="1gbit", out_dir=tmp_path / "run", timeout_s=100)

    # The rank-0 summary came back, merged with what the testbed measured.
    assert res["algo"] == "onebit-lamb" and res["world_size"] == 2 and res["steps"] == 10
    tb = res["testbed"]
    assert tb["rate"] == "1gbit" and tb["hosts"] == 2 and tb["wall_s"] > 0
    assert all(b > 0 for b in tb["nic_tx_bytes"]) and all(0 < u < 1 for u in tb["utilization"])
    # What the interfaces sent agrees with the accounted bytes (headers, rendezvous).
    assert res["accounted_wire_bytes"] > 1_000_000  # the start-up broadcast alone is ~1.6 MB
    assert 0.95 < res["nic_over_accounted"] < 1.15, res["nic_over_accounted"]

    st = res["stages"]
    assert st["freeze_step"] == 4
    assert st["warmup"]["steps"] == 4 and st["compression"]["steps"] == 6
    assert st["first_compressing_step"] == 5  # the optimizer agrees with the split
    # 1-bit momentum sends far fewer bytes per step than the fp32 warmup.
    assert st["compression"]["wire_bytes_per_step"] < st["warmup"]["wire_bytes_per_step"] / 5
    assert st["compression"]["mean_step_s"] > 0
    assert res["final_train_loss"] == res["final_train_loss"]  # not NaN
    saved = json.loads((tmp_path / "run" / "testbed_run.json").read_text())
    assert saved["nic_over_accounted"] == res["nic_over_accounted"]
    # The cluster this call brought up is gone again.
    assert own_clusters() <= before


@pytest.mark.root
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(180)
def test_testbed_compare_is_the_comparison_driver_on_hosts(tmp_path: Path) -> None:
    """``thinwire compare --testbed``: the one driver, its runs on 2 hosts, ratios against
    the first, the stages split at the 1-bit run's freeze, NIC bytes, one figure."""
    from thinwire.cli.main import main

    tiny = TINY_FLAGS
    out = tmp_path / "cmp"
    argv = ["compare", "--testbed", "--algos", "lamb", "onebit-lamb@freeze_step=3", "--hosts", "2"]
    argv += ["--rates", "1gbit", "--steps", "8", "--batch-size", "2", "--warmup-steps", "2"]
    argv += ["--eval-interval", "4", "--eval-sequences", "4", "--checkpoint-interval", "0"]
    assert main([*argv, *tiny, "--out", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["algo"] for r in rows] == ["lamb", "onebit-lamb@freeze_step=3"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0
    assert all(r["rate"] == "1gbit" and r["nic_tx_mb_per_host"] > 0 for r in rows)
    result = json.loads((out / "1gbit-r0" / "comparison.json").read_text())
    assert result["where"] == {"kind": "testbed", "hosts": 2, "rate": "1gbit", "round": 0}
    lamb, onebit = result["runs"].values()
    assert lamb["config"]["lr"] == default_lr("lamb")  # each at its tuned lr
    for r in (lamb, onebit):  # both timed over the same steps: the 1-bit run's split
        assert r["stages"]["freeze_step"] == 3 and r["stages"]["compression"]["steps"] == 5
    assert onebit["bytes_reduction"] > 1 and lamb["bytes_reduction"] == 1.0
    assert (out / "1gbit-r0" / "comparison.png").stat().st_size > 0
    assert (out / "comparison.png").stat().st_size > 0
