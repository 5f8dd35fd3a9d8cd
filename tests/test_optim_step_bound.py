"""The step bound: a variance frozen before the gradients grew does not scale every later
step up with them (thinwire.optim.step_bound), on one process and over the real 1-bit
exchange of two gloo ranks."""

from __future__ import annotations

import logging

import pytest
import torch

from thinwire.comm.launch import spawn
from thinwire.optim import OneBitAdam, OneBitLamb

FREEZE = 6
GROWTH_STEP = 10
GROWTH = 30.0


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(512)), torch.nn.Parameter(torch.randn(64, 8))]


def _grads(params: list[torch.nn.Parameter], t: int, rank: int, growth: float = GROWTH) -> None:
    """Gradients of a steady scale, ``growth`` times larger from GROWTH_STEP on: a plateau
    that ends after the freeze."""
    g = torch.Generator().manual_seed(100 * t + rank)
    scale = growth if t >= GROWTH_STEP else 1.0
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale


def _steps(
    name: str, bound: float | None, rank: int = 0, steps: int = 24, growth: float = GROWTH
) -> dict:
    """Run ``steps`` steps; per step after the freeze, every layer's step length against
    the uncompressed optimizer's (LAMB: lr * ||w||; Adam: the warmup's update norm)."""
    params = _params()
    cls = OneBitLamb if name == "lamb" else OneBitAdam
    lr = 1e-2 if name == "lamb" else 1e-3
    opt = cls(params, lr=lr, freeze_step=FREEZE, step_bound=bound)
    ratios = []
    warm = [0.0] * len(params)  # Adam: the warmup's step lengths, averaged as the bound does
    for t in range(1, steps + 1):
        _grads(params, t, rank, growth)
        before = [p.detach().clone() for p in params]
        opt.step()
        for i, (p, b) in enumerate(zip(params, before, strict=True)):
            step = float((p.detach() - b).norm())
            if t <= FREEZE:
                warm[i] = step if t == 1 else 0.9 * warm[i] + 0.1 * step
                continue
            ratios.append(step / (lr * float(b.norm()) if name == "lamb" else warm[i]))
    return {"max_ratio": max(ratios), "bounded": opt.bounded_steps}


@pytest.mark.parametrize("name", ["lamb", "adam"])
def test_one_process_steps_stay_bounded_when_the_gradients_grow(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="thinwire"):
        bounded = _steps(name, 1.0)
    free = _steps(name, None)
    # Without the bound the steps grow with the gradients (30x); 1-bit LAMB's drift
    # factor takes back at most 2x of it.
    assert free["max_ratio"] > 5.0, free
    assert free["bounded"] == 0
    assert bounded["max_ratio"] <= 1.0 + 1e-3, bounded
    assert bounded["bounded"] > 0
    said = [r.getMessage() for r in caplog.records if "step bound" in r.getMessage()]
    assert len(said) == 1 and "counted in bounded_steps" in said[0], said


def test_a_looser_bound_allows_longer_steps() -> None:
    loose = _steps("lamb", 3.0)
    assert 1.5 < loose["max_ratio"] <= 3.0 + 1e-3, loose


def test_steady_gradients_leave_lamb_unbounded() -> None:
    """Before the gradients grow, 1-bit LAMB's steps are no longer than LAMB's: the bound
    changes nothing while the frozen variance fits."""
    res = _steps("lamb", 1.0, steps=GROWTH_STEP - 1)
    assert res["bounded"] == 0 and res["max_ratio"] <= 1.0 + 1e-3, res


def _drift_run(cls: type, growth: float) -> int:
    """Gradients of a steady direction (plus a little noise), ``growth`` times larger
    from step 45 on, after a freeze at 40 (the momentum has reached its steady size),
    under a tight bound (0.5); returns the bounded steps."""
    params = _params()
    opt = cls(params, lr=1e-3, freeze_step=40, step_bound=0.5)
    direction = [torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) for p in params]
    for t in range(1, 70):
        g = torch.Generator().manual_seed(t)
        scale = growth if t >= 45 else 1.0
        for p, d in zip(params, direction, strict=True):
            p.grad = (d + 0.1 * torch.randn(p.shape, generator=g)) * scale
        opt.step()
    return opt.bounded_steps


@pytest.mark.parametrize("cls", [OneBitLamb, OneBitAdam])
def test_growth_within_the_onset_is_not_bounded(cls: type) -> None:
    """Gradients 1.5x larger after the freeze stay under ONSET (2x), by either onset (the
    gradients' growth or the momentum's): even a tight bound leaves those steps alone.
    30x opens it."""
    assert _drift_run(cls, 1.5) == 0
    assert _drift_run(cls, GROWTH) > 0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1"])
@pytest.mark.parametrize("cls", [OneBitLamb, OneBitAdam])
def test_a_bad_bound_is_refused_in_one_line(cls: type, bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="step_bound") as err:
        cls(_params(), step_bound=bad)
    assert "\n" not in str(err.value)


def test_the_reference_and_the_count_survive_a_state_dict_round_trip() -> None:
    params = _params()
    opt = OneBitAdam(params, lr=1e-3, freeze_step=FREEZE)
    for t in range(1, 16):
        _grads(params, t, 0)
        opt.step()
    assert opt.bounded_steps > 0
    copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = OneBitAdam(copy, lr=1e-3, freeze_step=FREEZE)
    again.load_state_dict(opt.state_dict())
    assert again.bounded_steps == opt.bounded_steps
    for p, q in zip(params, copy, strict=True):
        assert torch.equal(opt.state[p]["step_norm_ref"], again.state[q]["step_norm_ref"])
    for t in range(16, 20):
        _grads(params, t, 0)
        opt.step()
        _grads(copy, t, 0)
        again.step()
    for p, q in zip(params, copy, strict=True):
        assert torch.equal(p, q)


def _two_ranks(rank: int, world: int, name: str, bound: float | None) -> dict:
    del world
    return _steps(name, bound, rank=rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["lamb", "adam"])
def test_two_ranks_over_the_1bit_exchange(name: str) -> None:
    """The same over gloo: the 1-bit exchange's error rides in the momentum, and the
    bound still holds every rank's steps to the uncompressed length."""
    bounded = spawn(_two_ranks, 2, (name, 1.0), timeout_s=100)
    free = spawn(_two_ranks, 2, (name, None), timeout_s=100)
    assert all(r["max_ratio"] <= 1.0 + 1e-3 and r["bounded"] > 0 for r in bounded), bounded
    assert all(r["max_ratio"] > 5.0 for r in free), free


def _dead_units_body(rank: int, world: int, kind: str) -> dict:
    """A ReLU MLP half of whose hidden units never fire, 60 steps, frozen at step 20: the
    1-bit exchange's noise piles up in the momentum of such a model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thinwire.optim import Lamb

    del world
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    with torch.no_grad():
        net[0].bias[:128] = -50.0
    ddp = DDP(net)
    opt = (
        Lamb(net.parameters(), lr=1e-2)
        if kind == "lamb"
        else OneBitLamb(net.parameters(), lr=1e-2, freeze_step=20)
    )
    opt.register_ddp(ddp)
    losses, energy = [], []
    for step in range(60):
        g = torch.Generator().manual_seed(7919 * (rank + 1) + step)
        x = torch.randn(64, 32, generator=g)
        y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        energy.append(getattr(opt, "exchanged_energy", 0.0))
    return {
        "loss": sum(losses[-10:]) / 10,
        "bounded": getattr(opt, "bounded_steps", 0),
        "momentum_growth": (energy[-1] / energy[20]) ** 0.5 if energy[20] else 0.0,
    }


@pytest.mark.timeout(150)
def test_the_exchanges_own_noise_does_not_switch_the_bound_on() -> None:
    """The bound's onset reads the gradients, not the exchanged momentum: on a model with
    dead units the momentum's norm grows past ONSET from the 1-bit code's noise alone,
    while the gradients barely grow. Read as staleness, that cut 1-bit LAMB's steps and
    left it 50% above LAMB's loss."""
    lamb = spawn(_dead_units_body, 2, ("lamb",), timeout_s=60)[0]
    onebit = spawn(_dead_units_body, 2, ("onebit",), timeout_s=60)[0]
    assert onebit["momentum_growth"] > 2.0, onebit  # the old gauge would have fired
    assert onebit["bounded"] == 0, onebit
    # The mean of the last 10 batches: 1-bit LAMB 0.58, LAMB 0.55 (0.79 with the old gauge).
    assert onebit["loss"] < 1.1 * lamb["loss"], (onebit, lamb)


def test_the_gradient_gauge_follows_the_norm_not_single_batches() -> None:
    from thinwire.optim.step_bound import GradientGauge

    gauge = GradientGauge()
    assert gauge.growth_with(100.0) == 1.0  # not armed
    gauge.observe(1.0)  # the first compressed step arms it
    assert gauge.reference == 1.0
    # One batch 31x larger moves the EMA (0.9, of the norm) by 3x, not 9x.
    assert gauge.growth_with(31.0**2) == pytest.approx(4.0)
    gauge.observe(31.0**2)
    gauge.observe(0.0)
    assert gauge.growth_with(0.0) == pytest.approx(3.24)  # and it fades
    gauge.arm()  # a new freeze waits for its first compressed step again
    assert gauge.reference == 0.0 and gauge.growth_with(5.0) == 1.0
    again = GradientGauge()
    gauge.observe(4.0)
    again.load_state_dict(gauge.state_dict())
    assert again == gauge
