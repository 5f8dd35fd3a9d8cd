"""The paper's setting on the server: its baselines (staleness discounts, the async buffer),
DyLU from the first round, deterministic sync rounds and their shard schedule, methods.
(Eq. 2 shard sampling on its own: ``test_localsgd_shards.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, ServerCore
from thinwire.localsgd.algorithm.methods import METHODS, TUNED, for_method, method_of
from thinwire.localsgd.algorithm.outer import AsyncBuffer, DelayedNesterov
from thinwire.localsgd.algorithm.shards import SyncSchedule


def _core(**kw: Any) -> ServerCore:
    args = dict(workers=2, local_steps=4, total_steps=1000, shard_sizes=[10, 10])
    core = ServerCore.of(torch.zeros(3), **(args | kw))
    for w in range(1, core.workers + 1):
        core.join(w, 0.0)
    return core


def _round(core: ServerCore, w: int, grad: float, now: float, version: int | None = None) -> bool:
    work = core.work_for(w, now)
    assert work is not None and not work.stop
    v = work.version if version is None else version
    return core.submit(w, work.epoch, torch.full((3,), grad), work.steps, 0.1, now, v)


def test_staleness_is_counted_from_the_pulled_version_and_poly_discounts_it() -> None:
    core = _core(outer="nesterov", outer_lr=1.0, outer_momentum=0.0, staleness="poly")
    a, b = core.work_for(1, 0.0), core.work_for(2, 0.0)
    assert a is not None and b is not None and a.version == b.version == 0
    core.submit(1, 0, torch.ones(3), 4, 0.1, 1.0, a.version)  # fresh: applied in full
    torch.testing.assert_close(core.theta.detach(), -torch.ones(3))
    core.submit(2, 0, torch.ones(3), 4, 0.1, 2.0, b.version)  # one update stale
    torch.testing.assert_close(core.theta.detach(), -(1 + 2**-0.5) * torch.ones(3))
    assert core.staleness_seen == {0: 1, 1: 1} and core.version == 2


def test_polythres_drops_stale_updates_but_counts_their_steps() -> None:
    core = _core(outer="nesterov", outer_lr=1.0, outer_momentum=0.0, max_staleness=0)
    a, b = core.work_for(1, 0.0), core.work_for(2, 0.0)
    assert a is not None and b is not None
    assert core.submit(1, 0, torch.ones(3), 4, 0.1, 1.0, a.version)
    assert not core.submit(2, 0, torch.ones(3), 4, 0.1, 2.0, b.version)  # tau = 1 > 0
    assert core.updates_dropped == 1 and core.updates_applied == 1
    assert core.steps_applied == 8  # the dropped round's steps are spent
    torch.testing.assert_close(core.theta.detach(), -torch.ones(3))


def test_async_buffer_is_one_nesterov_step_per_n_arrivals_and_stands_still_between() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(6)]
    p_buf = torch.nn.Parameter(torch.zeros(5))
    p_sgd = torch.nn.Parameter(torch.zeros(5))
    buf = AsyncBuffer([p_buf], lr=0.3, momentum=0.9, buffer_size=3)
    sgd = torch.optim.SGD([p_sgd], lr=0.3, momentum=0.9, nesterov=True)
    for k in range(2):
        for i in range(3):
            before = p_buf.detach().clone()
            p_buf.grad = grads[3 * k + i]
            buf.step()
            if i < 2:
                assert torch.equal(p_buf.detach(), before)  # theta waits for the N-th
        p_sgd.grad = torch.stack(grads[3 * k : 3 * k + 3]).mean(0)
        sgd.step()
        torch.testing.assert_close(p_buf.detach(), p_sgd.detach())
    # DN with c = 0 ends a cycle at the same place, but moves at every arrival.
    p_dn = torch.nn.Parameter(torch.zeros(5))
    dn = DelayedNesterov([p_dn], lr=0.3, momentum=0.9, buffer_size=3)
    for g in grads:
        p_dn.grad = g
        dn.step()
    torch.testing.assert_close(p_dn.detach(), p_sgd.detach())


def test_outer_momentum_zero_works_for_every_outer_optimizer() -> None:
    for outer in ("dn", "nesterov", "buffer"):
        core = _core(outer=outer, outer_lr=1.0, outer_momentum=0.0)
        _round(core, 1, 1.0, 1.0)
        _round(core, 2, 3.0, 2.0)
        # two arrivals of 1 and 3: plain SGD moves by their mean (dn, buffer) or sum (naive)
        moved = -core.theta.detach()
        torch.testing.assert_close(moved, torch.full((3,), 4.0 if outer == "nesterov" else 2.0))
    AsyncConfig(outer_momentum=0.0).validate(2)


def test_sync_rounds_apply_in_worker_order_and_answer_in_worker_order() -> None:
    def run(order: list[int]) -> tuple[torch.Tensor, list[int]]:
        core = _core(workers=3, sync=True, shard_sizes=[10, 10, 10])
        works = {w: core.work_for(w, 0.0) for w in core.due(0.0)}
        for i, w in enumerate(order):
            g = torch.tensor([1e8, 1.0, -1e8]) * (w + 0.1)  # float sums depend on order
            work = works[w]
            assert work is not None
            core.submit(w, 0, g, work.steps, 0.1, 1.0 + i, work.version)
            if i < 2:
                assert core.updates_applied == 0  # held until the round is complete
        due = core.due(5.0)
        return core.theta.detach().clone(), due

    a, due_a = run([3, 1, 2])
    b, due_b = run([2, 3, 1])
    assert torch.equal(a, b) and due_a == due_b == [1, 2, 3]


def test_dylu_sizes_the_first_round_from_declared_speeds_or_a_calibration() -> None:
    declared = _core(dylu=True, local_steps=10, speeds={1: 1.0, 2: 4.0})
    assert [declared.work_for(w, 0.0).steps for w in (1, 2)] == [10, 2]  # type: ignore[union-attr]
    calibrating = _core(dylu=True, local_steps=10, calibration_steps=3)
    first = calibrating.work_for(1, 0.0)
    assert first is not None and first.steps == 3  # speed unknown: a short timing round
    calibrating.submit(1, 0, torch.zeros(3), 3, 1.0, 3.0, 0)
    second = calibrating.work_for(2, 0.0)
    assert second is not None  # handed out after worker 1's push: version 1
    calibrating.submit(2, 0, torch.zeros(3), 3, 4.0, 12.0, second.version)
    assert calibrating.work_for(2, 12.0).steps == 2  # type: ignore[union-attr]
    floored = _core(dylu=True, local_steps=10, speeds={1: 1.0, 2: 100.0}, min_local_steps=5)
    assert floored.work_for(2, 0.0).steps == 5  # type: ignore[union-attr]
    full = _core(dylu=True, local_steps=10)  # no calibration, no declaration: H
    assert full.work_for(2, 0.0).steps == 10  # type: ignore[union-attr]


def test_sync_schedule_replays_the_sync_servers_shards_and_clocks() -> None:
    for sampling in ("least-progress", "paper"):
        core = _core(
            workers=3,
            sync=True,
            shard_sizes=[5, 5, 5],
            total_steps=36,
            shard_sampling=sampling,
            seed=4,
        )
        plan = SyncSchedule([5, 5, 5], 3, 4, 12, sampling, 4)
        now = 0.0
        for k in range(3):
            works = {w: core.work_for(w, now) for w in core.due(now)}
            for w, work in works.items():
                assert work is not None
                assert plan.at(w, 4 * k + 1) == (work.shard, work.lr_clock + 1), (sampling, k, w)
                now += 1.0
                core.submit(w, 0, torch.zeros(3), work.steps, 0.1, now, work.version)


def test_methods_are_settings_and_get_their_tuned_outer_optimizer() -> None:
    base = AsyncConfig()
    for m in METHODS:
        cfg = for_method(base, m)
        assert method_of(cfg) == m
        assert cfg.resolved_outer_lr() == TUNED[m].outer_lr
        assert cfg.resolved_outer_momentum() == TUNED[m].outer_momentum
        cfg.validate(4)
    assert for_method(AsyncConfig(outer_lr=0.11), "naive").resolved_outer_lr() == 0.11
    assert for_method(base, "polythres").max_staleness == 10
    with pytest.raises(ConfigError, match="unknown method"):
        for_method(base, "fedavg")
