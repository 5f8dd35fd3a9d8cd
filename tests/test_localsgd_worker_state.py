"""A worker's inner state across a stop: kept on its host, loaded only where it belongs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from thinwire.localsgd.algorithm.compression import PushEncoder
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.messages import Work
from thinwire.localsgd.runtime.worker_loop import load_worker_state, save_worker_state


def _worker() -> LocalWorker:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    return LocalWorker(
        model,
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        [lambda step: (x, x.sum(1, keepdim=True))],
        lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
        warmup_steps=0,
        min_lr_ratio=1.0,
    )


def _trained() -> LocalWorker:
    w = _worker()
    w.run_round(torch.zeros(4), Work(0, 0, 0, 3, 0, 10))
    return w


def test_the_state_written_at_a_stop_is_loaded_only_for_that_version_and_rank(
    tmp_path: Path,
) -> None:
    path = tmp_path / "localsgd_worker1.pt"
    trained = _trained()
    save_worker_state(path, trained, PushEncoder("onebit"), version=7, rank=1)
    theirs = trained.opt.state_dict()["state"][0]
    for version, rank, expected in ((8, 1, False), (7, 2, False), (7, 1, True)):
        fresh, push = _worker(), PushEncoder("onebit")
        assert load_worker_state(path, fresh, push, version, rank) is expected
        state = fresh.opt.state_dict()["state"]
        if expected:  # AdamW's moments and step count, bit for bit
            assert torch.equal(state[0]["exp_avg_sq"], theirs["exp_avg_sq"])
            assert float(state[0]["step"]) == 3.0
        else:
            assert state == {}  # left fresh, as a new worker would be
    path.write_bytes(b"not a checkpoint")  # damaged: the worker starts fresh
    fresh = _worker()
    assert not load_worker_state(path, fresh, PushEncoder("none"), 7, 1)
    assert fresh.opt.state_dict()["state"] == {}
    assert not load_worker_state(tmp_path / "missing.pt", fresh, PushEncoder("none"), 7, 1)
