"""The simulator and real processes agree: synchronous DiLoCo with the same seed, data and H
gives the same validation curve through the simulator, through the asynchronous runtime's
server in sync mode (real processes), and through the trainer's allreduce DiLoCo."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from thinwire.comm.launch import spawn
from thinwire.localsgd import SimClock, for_method, simulate
from thinwire.train.async_task import async_config, gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

TOLERANCE = 2e-3
"""Largest difference in validation loss (nats) allowed between the three paths. They
differ only in the order of floating-point sums (the server applies W arrivals one by one,
the allreduce averages them at once; the trainer's evaluation is split between ranks)."""


def _cfg(out: Path, algo: str) -> TrainConfig:
    return TrainConfig(
        algo=algo,
        model="tiny",
        n_layer=1,
        n_embd=32,
        n_head=2,
        seq_len=16,
        steps=6,
        local_steps=3,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        eval_interval=3,
        eval_sequences=8,
        log_interval=3,
        checkpoint_interval=0,
        out_dir=str(out),
        progress=False,
        device="cpu",
        sync=algo == "async-diloco",
    )


def _rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from thinwire.train.trainer import train

    return train(cfg)


def _curve(out: Path, per_worker: int) -> list[float]:
    """Validation losses at 0, 3 and 6 inner steps per worker, from ``metrics.jsonl``."""
    records = read_metrics(out / "metrics.jsonl")
    by_step = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    return [by_step[s * per_worker] for s in (0, 3, 6)]


@pytest.mark.timeout(240)
def test_sync_diloco_simulated_and_real_give_the_same_curve(tmp_path: Path) -> None:
    sim_cfg = _cfg(tmp_path / "sim", "async-diloco")
    acfg = for_method(replace(async_config(sim_cfg), checkpoint_dir=None), "sync")
    sim = simulate(gpt_task(sim_cfg), acfg, SimClock((1.0, 2.0), eval_points=2))
    simulated = [p["val_loss"] for p in sim["curve"]]
    assert [p["steps"] for p in sim["curve"]] == [0, 6, 12]

    # Real processes, asynchronous runtime with the sync barrier: 1 server + 2 workers.
    server = _cfg(tmp_path / "server", "async-diloco")
    spawn(_rank, 3, (server,), timeout_s=200)
    through_server = _curve(tmp_path / "server", 2)  # the server counts all workers' steps

    # Real processes, the trainer's allreduce DiLoCo: 2 workers.
    allreduce = _cfg(tmp_path / "allreduce", "diloco")
    spawn(_rank, 2, (allreduce,), timeout_s=200)
    through_allreduce = _curve(tmp_path / "allreduce", 1)

    assert simulated[2] < simulated[0] - 0.05  # it trained: the comparison means something
    for other in (through_server, through_allreduce):
        for a, b in zip(simulated, other, strict=True):
            assert abs(a - b) <= TOLERANCE, (simulated, through_server, through_allreduce)
