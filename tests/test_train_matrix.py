"""Every algorithm through every path a user takes: a checkpoint in each stage, metrics
logged right after it, a resume to the end; and the resumed run equals the straight one
wherever the algorithm is deterministic.

The stages: warmup and compression for the 1-bit optimizers (the checkpoint before and
after the freeze), mid-round for DiLoCo (a stop between two synchronisations), any step
for the others. Each chain runs in one 2-rank group: the straight run, then the same run
cut into pieces by ``stop_after`` and resumed.

The same chains then run at 3 and 4 ranks, where only the parameters are compared. From
3 ranks on, an allreduce's rounding depends on where each element sits in DDP's gradient
bucket (``(a + b) + c != a + (b + c)``; with 2 ranks ``a + b == b + a``), so only there
does a resume that reduces in another bucket layout than the straight run show
(:mod:`thinwire.comm.resumable_ddp`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from conftest import tiny_config
from thinwire.comm.launch import spawn
from thinwire.train.algorithms import algorithm_names
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics
from thinwire.train.trainer import train

STEPS = 12
# (algo, stops, config overrides). Stops cut the run; each piece ends in a checkpoint.
CASES: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "adamw": ((5,), {}),
    "adamw-fp16": ((5,), {}),
    "adamw-powersgd": ((5,), {"powersgd_start": 2}),
    "lamb": ((5,), {}),
    # freeze at 6: stop 3 is in warmup, stop 9 in the compression stage
    "onebit-adam": ((3, 9), {"freeze_step": 6}),
    "onebit-lamb": ((3, 9), {"freeze_step": 6}),
    # the automatic freeze (capped at 30% of 12 steps = step 4): stops on both sides
    "onebit-lamb-auto": ((2, 7), {"freeze_step": "auto"}),
    # the 1-bit DDP hook after 4 plain steps, overlapped with backward or not; the sync
    # variant's first stop is past the freeze, so a process that started at step 0 saves
    # residuals that a resumed one must find by their parameters
    "adamw-onebit": ((2, 7), {"freeze_step": 4}),
    "adamw-onebit-sync": ((6, 9), {"freeze_step": 4}),
    # H = 4: stops at 6 and 9 are mid-round
    "diloco": ((6, 9), {"local_steps": 4}),
    # after a pretraining (thinwire.train.start): a resume must neither pretrain again nor
    # lose the pretraining's data offset
    "onebit-lamb-pretrained": ((3, 9), {"freeze_step": 6, "pretrain_steps": 4}),
    "diloco-pretrained": ((6, 9), {"local_steps": 4, "pretrain_steps": 3}),
    # Streaming DiLoCo: fragments sent at steps 2, 4, 6, 8, ... and applied a step later,
    # so the stop at 6 leaves a quantized fragment in flight (its error feedback too)
    "diloco-streaming": (
        (6, 9),
        {"local_steps": 4, "fragments": 2, "fragment_overlap": 1, "compress": "int4"},
    ),
    # FSDP2 inside islands of 2 ranks, the optimizer across them (one island at 2 ranks,
    # two at 4): the optimizer state saved as each rank's shards, put back as DTensors
    "lamb-sharded": ((5,), {"shard_within": 2}),
    "onebit-lamb-sharded": ((3, 9), {"freeze_step": 6, "shard_within": 2}),
    "onebit-adam-sharded": ((3, 9), {"freeze_step": 6, "shard_within": 2}),
    # an island is one DiLoCo worker: its AdamW state saved as shards, stops mid-round
    "diloco-sharded": ((6, 9), {"local_steps": 4, "shard_within": 2}),
    # the momentum exchanged in int8 after the freeze: its error feedback saved and loaded
    "onebit-lamb-int8": ((3, 9), {"freeze_step": 6, "exchange": "int8"}),
}
VARIANTS = ("-auto", "-pretrained", "-streaming", "-sharded", "-int8")
"""Suffixes of a case's name that set a variant of its algorithm."""


def _algo(name: str) -> str:
    for suffix in VARIANTS:
        name = name.removesuffix(suffix)
    return name


def _chain(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict[str, Any]]:
    return [train(cfg) for cfg in cfgs]


def _chains(rank: int, world: int, chains: list[list[TrainConfig]]) -> list[list[str]]:
    """Every chain in one group, as each run's parameter hash."""
    return [[train(cfg)["param_sha256"] for cfg in chain] for chain in chains]


def _configs(tmp_path: Path, name: str) -> tuple[TrainConfig, list[TrainConfig]]:
    stops, overrides = CASES[name]
    algo = _algo(name)
    base = dict(algo=algo, steps=STEPS, log_interval=1, checkpoint_interval=0, **overrides)
    straight = tiny_config(tmp_path / "straight", **base)
    pieces = [
        tiny_config(tmp_path / "pieces", **base, stop_after=stop, resume=i > 0)
        for i, stop in enumerate(stops)
    ]
    pieces.append(tiny_config(tmp_path / "pieces", **base, resume=True))
    return straight, pieces


KEYS = ("step", "samples", "loss", "lr", "val_loss", "comm_bytes", "compressing", "event")


def _records(run_dir: str) -> list[dict[str, Any]]:
    return [
        {k: r[k] for k in KEYS if k in r} for r in read_metrics(Path(run_dir) / "metrics.jsonl")
    ]


def test_every_algorithm_is_covered() -> None:
    # async-diloco's resume (a server checkpoint, a new epoch) is not deterministic;
    # tests/test_localsgd_async.py takes it through checkpoint and resume.
    covered = {_algo(name) for name in CASES} | {"async-diloco"}
    assert covered == set(algorithm_names())


SMOKE = "onebit-lamb"
"""The fast lane's compression run: 1-bit LAMB through warmup, freeze, checkpoints, resume."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.smoke) if n == SMOKE else n for n in CASES]
)
def test_checkpoint_log_resume_is_exact(tmp_path: Path, name: str) -> None:
    straight, pieces = _configs(tmp_path, name)
    per_rank = spawn(_chain, 2, ([straight, *pieces],), timeout_s=220)
    for summaries in per_rank:
        assert summaries[-1]["param_sha256"] == summaries[0]["param_sha256"]
        assert summaries[-1]["comm_bytes"] == summaries[0]["comm_bytes"]
        assert summaries[-1]["freeze_step"] == summaries[0]["freeze_step"]
    assert per_rank[0][0]["param_sha256"] == per_rank[1][0]["param_sha256"]
    a, b = _records(straight.out_dir), _records(pieces[-1].out_dir)
    # a stop also evaluates (the number a user sees when the slot ends): leave those out
    stops = {c.stop_after for c in pieces[:-1]}
    extra = [r for r in b if "val_loss" in r and r["step"] in stops - {STEPS}]
    extra = [r for r in extra if r["step"] % straight.eval_interval]
    assert len(extra) == sum(1 for s in stops if s % straight.eval_interval)
    assert [r for r in b if r not in extra] == a
    # every record after a checkpoint was written, and is plain JSON numbers
    logged = [r["step"] for r in b if "loss" in r]
    assert logged == list(range(1, STEPS + 1))
    for line in (Path(pieces[-1].out_dir) / "metrics.jsonl").read_text().splitlines():
        for value in json.loads(line).values():
            assert isinstance(value, (int, float, str)) and not isinstance(value, bool)
    if name.startswith("onebit"):  # the optimizers' own freeze
        freeze = per_rank[0][0]["freeze_step"]
        assert pieces[0].stop_after <= freeze < pieces[1].stop_after
        events = [r for r in b if r.get("event") == "freeze"]
        assert [r["step"] for r in events] == [freeze]
    summary = json.loads((Path(pieces[-1].out_dir) / "summary.json").read_text())
    assert math.isfinite(summary["final_val_loss"]) and summary["steps"] == STEPS


# Every algorithm's chain at 3 and 4 ranks, in one group per world size: starting a group
# of tiny-model ranks costs more than a chain, so one group keeps the added time to about
# a minute per world size on 2 cores. The chains and their stops are the 2-rank ones
# above (each stop in the stage it tests); the metric records are not compared again, as
# they follow from the same code at 2 ranks; the parameters are what the world size
# changes.
@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [3, 4])
def test_resume_is_exact_at_3_and_4_workers(tmp_path: Path, world: int) -> None:
    # A pretrained start changes no bucket layout: its chains run at 2 ranks only. Islands
    # of 2 ranks do not divide 3.
    names = [
        name
        for name in CASES
        if not name.endswith("-pretrained") and not (world == 3 and name.endswith("-sharded"))
    ]
    chains = {name: _configs(tmp_path / name, name) for name in names}
    runs = [[straight, *pieces] for straight, pieces in chains.values()]
    per_rank = spawn(_chains, world, (runs,), timeout_s=400)
    ends = [[(chain[0], chain[-1]) for chain in hashes] for hashes in per_rank]
    pairs = zip(names, ends[0], strict=True)
    differ = [name for name, (straight, resumed) in pairs if resumed != straight]
    assert differ == [], f"resumed != straight at {world} ranks: {differ}"
    # the replicas agree at the end (DiLoCo's differ between rounds, hence not the stops)
    assert all(mine == ends[0] for mine in ends[1:])
