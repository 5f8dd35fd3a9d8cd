"""The server refuses bad pushes: NaN, inf, absurd norms, wrong shapes or step counts.

A refused push must leave the model exactly as it was (theta and the outer optimizer's
state bit-identical), rewind its round so the budget is still met, and be counted.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.push_guard import PushGuard
from thinwire.localsgd.algorithm.server_core import ServerCore


def _core(guard: PushGuard | None = None, **kw: object) -> ServerCore:
    args: dict = dict(workers=2, local_steps=4, total_steps=64, shard_sizes=[50, 50])
    args.update(kw)
    return ServerCore.of(torch.linspace(-1, 1, 6), guard=guard, **args)


def _round(core: ServerCore, worker: int, now: float = 0.0) -> int:
    """Hand ``worker`` a round; its steps."""
    core.join(worker, now)
    assert worker in core.due(now)
    work = core.work_for(worker, now)
    assert work is not None and not work.stop
    return work.steps


def _snapshot(core: ServerCore) -> tuple[torch.Tensor, dict]:
    return core.theta.detach().clone(), copy.deepcopy(core.opt.state_dict())


def _same(core: ServerCore, snap: tuple[torch.Tensor, dict]) -> bool:
    theta, opt = snap
    now = core.opt.state_dict()
    same_state = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for s1, s2 in zip(now["state"].values(), opt["state"].values(), strict=True)
        for a, b in zip(s1.values(), s2.values(), strict=True)
    )
    return torch.equal(core.theta.detach(), theta) and same_state


def _warm(core: ServerCore, worker: int = 1, pushes: int = 3, scale: float = 0.01) -> None:
    for i in range(pushes):
        steps = _round(core, worker, float(i))
        core.submit(worker, core.epoch, torch.full((6,), scale), steps, 0.1, float(i))


@pytest.mark.parametrize(
    ("grad", "reason"),
    [
        (torch.tensor([0.1, math.nan, 0, 0, 0, 0]), "non-finite"),
        (torch.tensor([0.1, math.inf, 0, 0, 0, 0]), "non-finite"),
        (torch.full((6,), 3e38), "non-finite"),  # finite values whose norm overflows
        (torch.full((6,), 50.0), "norm"),  # 5000x the recent pushes
        (torch.ones(7), "shape"),
    ],
    ids=["nan", "inf", "overflow", "absurd-norm", "shape"],
)
def test_a_refused_push_changes_nothing(grad: torch.Tensor, reason: str) -> None:
    core = _core()
    _warm(core)
    applied, steps_done = core.updates_applied, core.steps_applied
    steps = _round(core, 1, 10.0)
    snap = _snapshot(core)
    assert not core.submit(1, core.epoch, grad, steps, 0.1, 10.0)
    assert _same(core, snap), "a refused push moved theta or the outer optimizer"
    assert core.guard.refused == {reason: 1} and core.pushes_refused == 1
    assert (core.updates_applied, core.steps_applied) == (applied, steps_done)
    # The round is rewound: it is handed out again and the budget is met exactly.
    assert core.steps_assigned == core.steps_applied
    assert 1 in core.due(10.0) and core.work_for(1, 10.0).steps == steps


def test_a_push_that_claims_other_steps_or_timing_is_refused() -> None:
    core = _core(PushGuard(max_strikes=10))
    steps = _round(core, 1, 0.0)
    assert not core.submit(1, 0, torch.zeros(6), steps + 1, 0.1, 1.0)  # claims more steps
    steps = _round(core, 1, 1.0)
    assert not core.submit(1, 0, torch.zeros(6), steps, math.nan, 2.0)
    steps = _round(core, 1, 2.0)
    assert not core.submit(1, 0, torch.zeros(6), steps, -1.0, 3.0)
    assert core.guard.refused == {"steps": 1, "timing": 2}
    assert core.steps_applied == 0
    # A worker the server had presumed dead comes back: its steps must still be in 1..H.
    core.drop(2)
    assert not core.submit(2, 0, torch.zeros(6), 1000, 0.1, 4.0)
    assert core.guard.refused["steps"] == 2


def test_healthy_pushes_pass_and_the_bound_follows_the_median() -> None:
    core = _core()
    _warm(core, pushes=3, scale=0.01)
    steps = _round(core, 1, 5.0)
    # 19x the recent norm per step: under the default bound of 20x.
    assert core.submit(1, core.epoch, torch.full((6,), 0.19), steps, 0.1, 5.0)
    steps = _round(core, 1, 6.0)
    assert not core.submit(1, core.epoch, torch.full((6,), 0.3), steps, 0.1, 6.0)
    assert core.guard.last_refusal == "norm" and 29 < core.guard.last_ratio < 31
    # Compared per inner step: after 1-step rounds (DyLU's slow workers), a 4-step round
    # with 4x their norm is in line; 160x is not.
    guard = PushGuard()
    for _ in range(3):
        guard.accepted(1.0)
    four_x = torch.full((4,), 2.0)  # norm 4
    assert guard.check(four_x, 4, 0.1, numel=4, expected_steps=4, max_steps=4)[0] is None
    assert guard.check(40 * four_x, 4, 0.1, numel=4, expected_steps=4, max_steps=4)[0] == "norm"


def test_pushes_are_compared_at_full_learning_rate() -> None:
    # A 10-step warmup: the first step runs at a tenth of the peak lr and moves a tenth as
    # far. After such steps, a full-lr step 10x longer is in line, and one 300x is not.
    guard = PushGuard(lr_warmup=10, min_lr_ratio=0.1)
    one = torch.tensor([0.1])
    for _ in range(3):
        why, per = guard.check(
            one, 1, 0.1, numel=1, expected_steps=1, max_steps=4, lr_clock=0, planned=100
        )
        assert why is None and per == pytest.approx(1.0)
        guard.accepted(per)
    kw = {"numel": 1, "expected_steps": 1, "max_steps": 4, "lr_clock": 10, "planned": 100}
    assert guard.check(10 * one, 1, 0.1, **kw) == (None, pytest.approx(1.0))
    assert guard.check(300 * one, 1, 0.1, **kw)[0] == "norm"
    # Without the schedule the same full-lr step would look 10x too long.
    plain = PushGuard()
    for _ in range(3):
        plain.accepted(0.1)
    assert plain.check(10 * one, 1, 0.1, numel=1, expected_steps=1, max_steps=4)[
        1
    ] == pytest.approx(1.0)


def test_no_norm_bound_before_warmup_or_when_off() -> None:
    # Before the first `warmup` accepted pushes there is no median to compare with: only
    # the other checks apply (documented; the token is what keeps strangers out).
    core = _core()
    steps = _round(core, 1)
    assert core.submit(1, 0, torch.full((6,), 50.0), steps, 0.1, 1.0)
    off = _core(PushGuard(max_ratio=0))
    _warm(off)
    steps = _round(off, 1, 5.0)
    assert off.submit(1, 0, torch.full((6,), 50.0), steps, 0.1, 5.0)
    steps = _round(off, 1, 6.0)
    assert not off.submit(1, 0, torch.full((6,), math.nan), steps, 0.1, 6.0)  # NaN still


def test_a_worker_is_evicted_after_refusals_in_a_row() -> None:
    core = _core(PushGuard(max_strikes=3))
    _warm(core, worker=2)
    snap = _snapshot(core)
    for i in range(3):
        steps = _round(core, 1, 10.0 + i)
        assert not core.submit(1, core.epoch, torch.full((6,), math.nan), steps, 0.1, 10.0 + i)
    assert core.evicted == {1} and 1 in core.dead and 1 not in core.live
    assert _same(core, snap)
    # An evicted worker's leftovers are ignored; it gets no more work.
    assert not core.submit(1, core.epoch, torch.zeros(6), 4, 0.1, 20.0)
    assert 1 not in core.due(20.0)
    # Its dead slot leaves Delayed Nesterov's N, as a dead worker's does.
    assert core.opt.param_groups[0]["buffer_size"] == 1
    # An accepted push between refusals resets the count.
    core2 = _core(PushGuard(max_strikes=2))
    _warm(core2)
    for grad in (math.nan, 0.01, math.nan):
        steps = _round(core2, 1, 30.0)
        core2.submit(1, core2.epoch, torch.full((6,), grad), steps, 0.1, 30.0)
    assert core2.evicted == set()


def test_the_norm_history_is_checkpointed() -> None:
    core = _core()
    _warm(core)
    steps = _round(core, 1, 5.0)
    core.submit(1, core.epoch, torch.full((6,), math.nan), steps, 0.1, 5.0)
    restored = _core()
    restored.load_state_dict(core.state_dict())
    assert list(restored.guard.norms) == list(core.guard.norms)
    assert restored.pushes_refused == 1
    steps = _round(restored, 1, 6.0)  # the bound holds at once after a resume
    assert not restored.submit(1, restored.epoch, torch.full((6,), 50.0), steps, 0.1, 6.0)
    # A checkpoint of an earlier release (no guard state) loads, with no history.
    state = core.state_dict()
    del state["guard"]
    old = _core()
    old.load_state_dict(state)
    assert len(old.guard.norms) == 0


def test_guard_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"max push ratio must be 0 \(off\) or a number > 1"):
        PushGuard(max_ratio=1.0)
    with pytest.raises(ConfigError, match="warmup <= history"):
        PushGuard(history=2, warmup=3)
