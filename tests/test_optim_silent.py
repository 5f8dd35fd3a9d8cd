"""Nothing fails silently in a user's own loop: skipped steps warn, a run that skips most
steps stops with DivergedError, the freeze says when and why (with total_steps it
happens in a run of any length; without, the warmup says why it has not ended)."""

from __future__ import annotations

import logging

import pytest
import torch

from thinwire.errors import DivergedError
from thinwire.optim import AutoFreeze, Lamb, OneBitAdam, OneBitLamb


def _params(n: int = 64, seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n, 4))]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], t: int, bad: bool) -> None:
    g = torch.Generator().manual_seed(t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
        if bad:
            p.grad[0] = float("nan")
    opt.step()


def test_skipped_steps_warn_first_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    params = _params()
    opt = Lamb(params, lr=1e-3)
    bad = {3, 7, 8, 12}
    with caplog.at_level(logging.WARNING, logger="thinwire"):
        for t in range(1, 30):
            _step(opt, params, t, t in bad)
    lines = [r.getMessage() for r in caplog.records]
    assert opt.skipped_steps == 4
    assert lines == [
        "Lamb: step 3 skipped: the averaged gradients held NaN or Inf; parameters and "
        "optimizer state are unchanged",
        "Lamb: 2 of 7 steps skipped so far (NaN/Inf gradients)",
        "Lamb: 4 of 12 steps skipped so far (NaN/Inf gradients)",
    ]


@pytest.mark.parametrize("cls", [Lamb, OneBitLamb, OneBitAdam])
def test_most_recent_steps_skipped_is_divergence(cls: type) -> None:
    params = _params()
    opt = cls(params, lr=1e-3)
    for t in range(1, 20):  # healthy steps, then every step NaN
        _step(opt, params, t, False)
    with pytest.raises(DivergedError, match=r"diverged at step 30: 11 of the last 20 steps"):
        for t in range(20, 40):
            _step(opt, params, t, True)
    # The skipped steps left the parameters as they were before them.
    assert all(torch.isfinite(p).all() for p in params)


def test_divergence_check_can_be_turned_off() -> None:
    params = _params()
    opt = Lamb(params, lr=1e-3)
    opt.max_skipped_fraction = 1.0
    for t in range(1, 40):
        _step(opt, params, t, True)
    assert opt.skipped_steps == 39 and opt.global_step == 0


def test_total_steps_caps_the_automatic_freeze(caplog: pytest.LogCaptureFixture) -> None:
    """Gradients whose scale never settles (2% larger every step): without total_steps
    the warmup says why it has not ended at step 100; with total_steps=60 it freezes at
    30% of it and says so."""

    def run(opt: OneBitLamb, params: list[torch.nn.Parameter], steps: int) -> None:
        for t in range(1, steps + 1):
            g = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1.02**t
            opt.step()

    params = _params()
    with caplog.at_level(logging.INFO, logger="thinwire"):
        capped = OneBitLamb(params, lr=1e-3, total_steps=60)
        run(capped, params, 60)
    assert capped.freeze_step == 18 and capped.auto_freeze.reason == "cap"
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    # The gradients keep growing after the freeze: the step bound may say so too, once.
    assert info[0].startswith("OneBitLamb: warmup capped at step 18"), info
    assert len(info) <= 2 and all("the step bound shortened" in x for x in info[1:]), info
    assert info[0].endswith("1-bit compression from step 19")

    caplog.clear()
    params = _params()
    with caplog.at_level(logging.WARNING, logger="thinwire"):
        waiting = OneBitLamb(params, lr=1e-3)
        run(waiting, params, 120)
    assert waiting.freeze_step is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("OneBitLamb: no compression yet at step 100: the statistics it ")
    assert "at step 10,000 at the latest" in line
    assert line.endswith(
        "pass total_steps=<your run's steps> to cap the warmup at 30% of it, or freeze_step=N"
    )


def test_fixed_freeze_and_the_floor_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    params = _params()
    with caplog.at_level(logging.INFO, logger="thinwire"):
        opt = OneBitAdam(params, lr=1e-3, freeze_step=5)
        for t in range(1, 8):
            g = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
                p.grad.view(-1)[:10] = 0.0  # weights whose unit never fired
            opt.step()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("OneBitAdam: warmup ended at step 5 (freeze_step=5); 1-bit ")
    assert "compression from step 6; 20 second moments were 0" in line
    assert opt.floor_report is not None and opt.floor_report.zeros == 20
    assert opt.floor_report.raised >= 20


def test_freeze_step_past_the_run_and_conflicting_caps(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="thinwire"):
        OneBitLamb(_params(), freeze_step=100, total_steps=100)
    assert "freeze_step=100 is not before total_steps=100: this run will never compress" in (
        caplog.text
    )
    with pytest.raises(ValueError, match="total_steps with freeze_step='auto', or an AutoFreeze"):
        OneBitLamb(_params(), freeze_step=AutoFreeze(max_step=5), total_steps=100)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="total_steps must be an integer >= 1"):
            OneBitLamb(_params(), total_steps=bad)


def test_for_run_is_thinwire_trains_rule() -> None:
    rule = AutoFreeze.for_run(300, min_step=30)
    assert (rule.max_step, rule.min_step, rule.tolerance) == (90, 30, 0.05)
    assert AutoFreeze.for_run(10, min_step=20).max_step == 20  # never inside the lr warmup


def _jump_run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    """Small gradients until step 30, then 30x larger ones (a plateau's end)."""
    for t in steps:
        g = torch.Generator().manual_seed(t)
        scale = 0.01 if t <= 30 else 0.3
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * scale
        opt.step()


def test_stale_guard_counts_growth_in_a_row() -> None:
    from thinwire.optim.stale import StaleGuard

    guard = StaleGuard(growth=4.0, patience=2)
    assert guard.observe(100.0) is None  # not armed
    guard.arm(1.0)
    assert guard.observe(20.0) is None  # 4.5x, once
    assert guard.observe(1.0) is None  # back: the count restarts
    assert guard.observe(17.0) is None
    assert guard.observe(25.0) == pytest.approx(5.0)  # 4.1x then 5x: stale


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_a_stale_automatic_freeze_goes_back_to_the_warmup(
    cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    params = _params()
    opt = cls(params, lr=1e-3, freeze_step=AutoFreeze(max_step=25))
    with caplog.at_level(logging.WARNING, logger="thinwire"):
        _jump_run(opt, params, range(1, 41))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{cls.__name__}: the frozen variance went stale at step 3")
    assert "since the freeze at step 25" in line and "back to the full-precision warmup" in line
    assert opt.freeze_step is None and not opt.compressing and opt.stale.rewarmups == 1
    assert all(torch.isfinite(p).all() for p in params)
    assert all(float(opt.state[p]["exp_avg"].abs().max()) < 1.0 for p in params)
    # Saved after the return to the warmup, loaded into a fresh optimizer: the same run.
    saved = opt.state_dict()
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = cls(twin_params, lr=1e-3, freeze_step=AutoFreeze(max_step=25))
    twin.load_state_dict(saved)
    assert twin.auto_freeze.max_step == opt.auto_freeze.max_step > 40
    _jump_run(opt, params, range(41, 80))
    _jump_run(twin, twin_params, range(41, 80))
    assert opt.freeze_step == twin.freeze_step is not None  # frozen again, alike
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))


def test_the_first_warmup_step_after_a_stale_freeze_lifts_the_variance() -> None:
    """v was frozen while the gradients grew 30x; the first warmup step after the return
    lifts it to cover that step's gradients, so the step is Adam-sized
    (at most ~lr per element), not 30x lr while v catches up at beta2=0.999."""
    params = _params()
    opt = OneBitAdam(params, lr=1e-3, freeze_step=AutoFreeze(max_step=25))
    _jump_run(opt, params, range(1, 31))
    t = 31
    while opt.stale.rewarmups == 0 and t < 60:
        _jump_run(opt, params, range(t, t + 1))
        t += 1
    assert opt.stale.rewarmups == 1 and not opt.compressing
    before = [p.detach().clone() for p in params]
    _jump_run(opt, params, range(t, t + 1))
    b2 = opt.param_groups[0]["betas"][1]
    for p, b in zip(params, before, strict=True):
        v_hat = opt.state[p]["exp_avg_sq"] / (1 - b2**opt.global_step)
        assert bool((v_hat >= p.grad.float() ** 2 * (1 - 1e-5)).all())
        assert float((p.detach() - b).abs().max()) <= 1e-3 * 1.01
    assert not opt._lift_variance  # once


def test_a_stale_fixed_freeze_is_kept_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    params = _params()
    opt = OneBitAdam(params, lr=1e-3, freeze_step=25)
    with caplog.at_level(logging.WARNING, logger="thinwire"):
        _jump_run(opt, params, range(1, 60))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the frozen variance went stale" in line
    assert line.endswith("freeze_step=25 is kept; a later one, or 'auto', would re-estimate it")
    assert opt.compressing and opt.freeze_step == 25
