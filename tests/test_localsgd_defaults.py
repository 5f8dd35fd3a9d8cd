"""A default synchronous DiLoCo run trains: it ends clearly below the byte-frequency loss.

The byte-frequency loss (:meth:`TextData.unigram_loss`) is what a model that knows only
how often each byte occurs scores. Synchronous DiLoCo at the former defaults (outer lr
0.7 with the inner state kept, H = 20) sat there on a new text, flat from its first
evaluation; every asynchronous speed-up was measured against that stalled baseline. The
check has two parts: the final loss is at least ``MARGIN`` below the byte-frequency loss,
and still falling in the second half of the run (a stall below it fails too). It is
calibrated: the former defaults fail it, which the first test shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from thinwire.comm.launch import spawn
from thinwire.localsgd import AsyncConfig, SimClock, for_method, simulate
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import read_metrics

MARGIN = 0.4
"""Nats per byte below the byte-frequency loss a short default run must end."""
STEPS = 100
"""Inner steps per worker: 10 rounds at the default H."""


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The simulator in this process: one intra-op thread (a busy 2-core host slows a
    second one down, rather than up)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trains(curve: list[float], unigram: float) -> bool:
    """Start, middle, end of a run: clearly below byte frequencies, and still improving."""
    _, half, final = curve
    return final < unigram - MARGIN and final < half - 0.05


def _sim(**kw: Any) -> list[float]:
    cfg = for_method(AsyncConfig(steps=STEPS, **kw), "sync")
    run = simulate(gpt_task(TrainConfig()), cfg, SimClock((1.0, 1.0), eval_points=2))
    return [p["val_loss"] for p in run["curve"]]


@pytest.mark.timeout(600)
def test_default_sync_diloco_in_the_simulator_trains_and_the_old_defaults_did_not() -> None:
    unigram = TextData().unigram_loss()
    assert unigram == pytest.approx(3.292, abs=1e-3)
    new = _sim()
    assert _trains(new, unigram), (new, unigram)
    old = _sim(local_steps=20, outer_lr=0.7, outer_momentum=0.9, inner_momentum="keep")
    assert not _trains(old, unigram), (old, unigram)  # the check catches the old stall


def _rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from thinwire.train.trainer import train

    return train(cfg)


@pytest.mark.timeout(600)
def test_default_trainer_diloco_trains(tmp_path: Path) -> None:
    cfg = TrainConfig(
        algo="diloco",
        steps=STEPS,
        eval_interval=STEPS // 2,
        checkpoint_interval=0,
        out_dir=str(tmp_path),
        progress=False,
        device="cpu",
    )
    spawn(_rank, 2, (cfg,), timeout_s=580)
    records = read_metrics(tmp_path / "metrics.jsonl")
    curve = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(curve) == 3
    assert _trains(curve, TextData().unigram_loss()), curve
