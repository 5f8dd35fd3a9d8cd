"""DyLU step counts, the shard book, and the server core's scheduling rules."""

from __future__ import annotations

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.dylu import SpeedTracker, dylu_steps
from thinwire.localsgd.server import ServerCore
from thinwire.localsgd.shards import ShardBook, inner_lr


def test_dylu_steps_for_the_papers_toy_speeds() -> None:
    seconds = {1: 0.58, 2: 0.75, 3: 1.51, 4: 3.33}
    steps = dylu_steps({w: 1 / s for w, s in seconds.items()}, 50)
    # H_w = floor(v_w / v_max * H): 50 * 0.58 / s_w
    assert steps == {1: 50, 2: 38, 3: 19, 4: 8}
    assert dylu_steps({1: 100.0, 2: 1.0}, 10) == {1: 10, 2: 1}  # floored at 1


def test_speed_tracker_ema_and_dead_worker_leaves_the_reference() -> None:
    t = SpeedTracker(local_steps=20, ema=0.5)
    assert t.steps(1) == 20  # unmeasured: H
    t.report(1, 0.1)
    t.report(2, 0.4)
    assert (t.steps(1), t.steps(2)) == (20, 5)
    t.report(2, 0.2)  # EMA: 0.5 * 0.4 + 0.5 * 0.2 = 0.3
    assert t.steps(2) == 6
    t.remove(1)  # the fast worker died: worker 2 is now the reference
    assert t.steps(2) == 20
    with pytest.raises(ConfigError, match="local steps H must be >= 1"):
        SpeedTracker(0)
    with pytest.raises(ConfigError, match="speed of worker 3"):
        dylu_steps({3: 0.0}, 5)


def test_least_progress_shard_and_lr_clock() -> None:
    book = ShardBook([100, 100, 200], total_steps=40)
    assert book.planned == [10, 10, 20]
    assert book.take(1, 5) == (0, 0)  # all at 0: lowest index
    assert book.take(2, 5) == (1, 0)
    assert book.take(3, 5) == (2, 0)  # progress 5/20 = 0.25 < 0.5
    book.release(1)
    assert book.take(1, 5) == (0, 5)  # only free shard; the clock continues
    book.release(2)
    book.release(3)
    assert book.take(2, 4) == (2, 5)  # 0.25 is the least progress
    book.release(2, completed=False)  # died: the round is rewound
    assert book.clock[2] == 5


def test_inner_lr_warmup_cosine_floor() -> None:
    assert inner_lr(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert inner_lr(9, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert inner_lr(55, 100, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert inner_lr(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert inner_lr(500, 100, 1.0, 10, 0.1) == pytest.approx(0.1)  # past the plan: floor


def _core(**kw: object) -> ServerCore:
    args: dict = dict(workers=2, local_steps=4, total_steps=32, shard_sizes=[50, 50])
    args.update(kw)
    return ServerCore(torch.zeros(6), **args)


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
