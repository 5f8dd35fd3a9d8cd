"""The server core's scheduling rules: epochs, grace and sync rounds, dead workers, guards."""

from __future__ import annotations

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.config import AsyncConfig


def _core(**kw: object) -> ServerCore:
    args: dict = dict(workers=2, local_steps=4, total_steps=32, shard_sizes=[50, 50])
    args.update(kw)
    return ServerCore.of(torch.zeros(6), **args)


def test_stale_update_from_before_a_restored_checkpoint_is_rejected() -> None:
    core = _core()
    core.join(1, 0.0)
    core.due(0.0)
    work = core.work_for(1, 0.0)
    assert core.submit(1, work.epoch, torch.ones(6), work.steps, 0.1, 1.0)
    saved = core.state_dict()
    restored = _core()
    restored.load_state_dict(saved)
    assert restored.epoch == 1 and torch.equal(restored.theta, core.theta)
    restored.join(1, 2.0)
    before = restored.theta.detach().clone()
    assert not restored.submit(1, work.epoch, torch.ones(6), 4, 0.1, 3.0)  # epoch 0: stale
    assert torch.equal(restored.theta, before) and restored.updates_rejected == 1


def test_grace_period_batches_arrivals_and_sync_waits_for_all() -> None:
    core = _core(grace_s=1.0)
    for w in (1, 2):
        core.join(w, 0.0)
    assert core.due(0.5) == [] and core.due(1.0) == [1, 2]
    for w in (1, 2):
        core.work_for(w, 1.0)
    core.submit(1, 0, torch.ones(6), 4, 0.1, 2.0)
    assert core.due(2.5) == []  # inside worker 1's grace period
    core.submit(2, 0, torch.ones(6), 4, 0.1, 2.9)
    assert core.due(3.0) == [1, 2]  # both restart from the same theta
    sync = _core(sync=True)
    for w in (1, 2):
        sync.join(w, 0.0)
    assert sync.due(0.0) == [1, 2]
    for w in (1, 2):
        sync.work_for(w, 0.0)
    sync.submit(1, 0, torch.ones(6), 4, 0.1, 1.0)
    assert sync.due(100.0) == []  # waits for worker 2
    sync.submit(2, 0, torch.ones(6), 4, 0.1, 5.0)
    assert sync.due(5.0) == [1, 2]


def test_dead_worker_round_is_handed_out_again() -> None:
    core = _core(total_steps=8)
    for w in (1, 2):
        core.join(w, 0.0)
    core.due(0.0)
    a, b = core.work_for(1, 0.0), core.work_for(2, 0.0)
    assert a.steps == b.steps == 4 and core.steps_assigned == 8
    core.submit(1, 0, torch.ones(6), 4, 0.1, 1.0)
    core.due(1.0)
    assert core.work_for(1, 1.0) is None  # budget handed out, worker 2 still busy: wait
    core.drop(2)
    assert core.opt.param_groups[0]["buffer_size"] == 1
    assert core.due(1.1) == [1]
    redo = core.work_for(1, 1.1)
    assert redo is not None and redo.steps == 4
    core.submit(1, 0, torch.ones(6), 4, 0.1, 2.0)
    assert core.due(2.0) == [1]
    stop = core.work_for(1, 2.0)
    assert stop is not None and stop.stop and core.finished and core.steps_applied == 8


def test_server_refuses_a_push_of_another_model_size() -> None:
    core = _core()
    core.join(1, 0.0)
    core.due(0.0)
    core.work_for(1, 0.0)
    theta = core.theta.detach().clone()
    assert not core.submit(1, 0, torch.ones(7), 4, 0.1, 1.0)
    assert core.guard.refused == {"shape": 1} and core.updates_applied == 0
    assert torch.equal(core.theta.detach(), theta)
    assert core.steps_assigned == 0  # the round is rewound, to be handed out again


def test_the_outer_momentum_warmup_reaches_the_servers_optimizer() -> None:
    cfg = AsyncConfig(steps=10, local_steps=5, outer_momentum_warmup=12)
    core = ServerCore.from_config(torch.zeros(4), cfg, workers=2, shard_sizes=[100, 100])
    assert core.opt.param_groups[0]["momentum_warmup"] == 12
    with pytest.raises(ConfigError, match="outer-momentum-warmup must be >= 0"):
        AsyncConfig(steps=10, local_steps=5, outer_momentum_warmup=-1).check_async(2)
