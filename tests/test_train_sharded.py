"""``--shard-within``: the trainer with FSDP2 inside islands and thinwire across them.

Checkpoints and resumes of every sharded algorithm are in tests/test_train_matrix.py
(the ``-sharded`` cases, at 2 and 4 ranks); here: the sharded run trains as the DDP run
does, sends less across islands, and bad layouts are one line before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import tiny_config
from thinwire.analysis.recorded import load_record, profile_from_record
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.train.algorithms import check_config
from thinwire.train.checkpoint import check_run_identity, write_run_identity
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics
from thinwire.train.trainer import train


def _runs(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict[str, Any]]:
    return [train(cfg) for cfg in cfgs]


def _losses(out_dir: str) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(out_dir) / "metrics.jsonl") if "loss" in r]


@pytest.mark.timeout(180)
def test_sharded_lamb_trains_as_ddp_lamb_and_sends_a_third(tmp_path: Path) -> None:
    # 5 validation windows over 4 ranks, one per batch: rank 0 holds 2 and rank 1 one,
    # so the ranks of island 0 only stay in step if evaluation pads rank 1's forwards.
    common = dict(algo="lamb", batch_size=1, eval_sequences=5, checkpoint_interval=0)
    ddp = tiny_config(tmp_path / "ddp", **common)
    hsdp = tiny_config(tmp_path / "hsdp", **common, shard_within=2)
    # 1-bit LAMB that never freezes: its warmup's gradients cross in bf16, as under DDP
    warm = tiny_config(tmp_path / "warm", **common | {"algo": "onebit-lamb"}, shard_within=2)
    warm.freeze_step = warm.steps
    ddp_run, hsdp_run, warm_run = spawn(_runs, 4, ([ddp, hsdp, warm],), timeout_s=170)[0]
    assert hsdp_run["shard_within"] == 2 and ddp_run["shard_within"] == 1
    # the same averages summed in another order: equal to rounding, step by step
    assert _losses(hsdp.out_dir) == pytest.approx(_losses(ddp.out_dir), rel=1e-5)
    assert hsdp_run["final_val_loss"] == pytest.approx(ddp_run["final_val_loss"], rel=1e-5)
    # per step a rank sends 2 * (3/4) of the gradient under DDP's ring over 4 ranks, and
    # 2 * (1/2) of its half across 2 islands: a third
    per_step = [
        run["comm_by_op"]["optim.allreduce" if run is hsdp_run else "ddp.allreduce"]
        for run in (ddp_run, hsdp_run)
    ]
    ratio = per_step[0]["wire_bytes"] / per_step[1]["wire_bytes"]
    assert ratio == pytest.approx(3.0, rel=0.02), per_step
    lamb_sent, warm_sent = (r["comm_by_op"]["optim.allreduce"] for r in (hsdp_run, warm_run))
    assert warm_sent["calls"] == lamb_sent["calls"]
    assert 2 * warm_sent["wire_bytes"] == lamb_sent["wire_bytes"]
    # the record of a sharded run is not read as a replica-per-rank job's
    assert profile_from_record(load_record(ddp.out_dir)).params
    with pytest.raises(ConfigError, match="sharded over islands of 2 ranks"):
        profile_from_record(load_record(hsdp.out_dir))


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"algo": "adamw"}, 4, "adamw keeps a whole replica per rank"),
        ({"algo": "adamw-powersgd"}, 4, "sharded runs take lamb, onebit-lamb, onebit-adam, diloco"),
        ({"algo": "lamb", "shard_within": 3}, 4, "must divide the 4 ranks into islands of 3"),
        ({"algo": "lamb", "shard_within": 0}, 4, "shard-within must be an integer >= 1"),
    ],
)
def test_layouts_it_cannot_train_are_one_line(
    settings: dict[str, Any], world: int, message: str
) -> None:
    cfg = TrainConfig(**{"shard_within": 2, **settings})
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, world)


def test_a_resume_with_another_sharding_is_refused(tmp_path: Path) -> None:
    identity = {"algo": "lamb", "world_size": 4}
    write_run_identity(tmp_path, identity | {"shard_within": 2})
    with pytest.raises(ConfigError, match="shard_within: checkpoint has 2, this run has 1"):
        check_run_identity(tmp_path, identity | {"shard_within": 1})
    # a run written before the setting existed ran a replica per rank
    write_run_identity(tmp_path, identity)
    check_run_identity(tmp_path, identity | {"shard_within": 1})
    with pytest.raises(ConfigError, match="shard_within: checkpoint has 1, this run has 2"):
        check_run_identity(tmp_path, identity | {"shard_within": 2})


def test_a_sharded_comparison_says_which_bytes_it_counts() -> None:
    from thinwire.train.compare_report import format_comparison

    run = {
        "final_val_loss": 2.0,
        "loss_ratio": 1.0,
        "comm_bytes": 2**20,
        "bytes_reduction": 1.0,
        "samples_per_s": 10.0,
        "speedup": 1.0,
    }
    result = {"runs": {"lamb": run}, "reference": "lamb", "workers": 4}
    assert "islands" not in format_comparison(result | {"base": {"shard_within": 1}})
    text = format_comparison(result | {"base": {"shard_within": 2}})
    assert text.splitlines()[-1].startswith("(FSDP2 inside 2 islands of 2 ranks: bytes are")
