"""When the 1-bit optimizers switch to compression (AutoFreeze), and what they compress
(the preconditioned momentum): decisions, agreement across ranks, exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from thinwire.comm import spawn
from thinwire.optim import AutoFreeze, OneBitAdam, OneBitLamb
from thinwire.optim.freeze import relative_change

# ----------------------------------------------------------------------------- the rule


def _decide_all(rule: AutoFreeze, changes: dict[int, float], steps: int) -> int | None:
    for t in range(1, steps + 1):
        reason = rule.decide(t, changes.get(t))
        if reason is not None:
            rule.commit(t, reason)
            return t
    return None


def test_freezes_after_patience_calm_checks() -> None:
    rule = AutoFreeze(tolerance=0.05, window=10, patience=2)
    changes = {10: 0.5, 20: 0.2, 30: 0.04, 40: 0.06, 50: 0.03, 60: 0.02, 70: 0.01}
    assert _decide_all(rule, changes, 100) == 60
    assert rule.reason == "settled"
    assert rule.history[:3] == [(10, 0.5), (20, 0.2), (30, 0.04)]
    assert "settled at step 60" in rule.describe() and "2.0%" in rule.describe()


def test_waits_for_min_step_and_stops_at_the_cap() -> None:
    rule = AutoFreeze(tolerance=0.05, window=10, patience=1, min_step=25)
    assert _decide_all(rule, {10: 0.01, 20: 0.01, 30: 0.01}, 100) == 25
    restless = AutoFreeze(tolerance=0.05, window=10, max_step=45)
    assert _decide_all(restless, {t: 0.3 for t in range(10, 100, 10)}, 100) == 45
    assert restless.reason == "cap" and "capped at step 45" in restless.describe()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, "window"),
        ({"patience": 0}, "patience"),
        ({"tolerance": 0.0}, "tolerance"),
        ({"tolerance": float("nan")}, "tolerance"),
        ({"min_step": -1}, "min_step"),
        ({"min_step": 50, "max_step": 40}, "max_step"),
    ],
)
def test_bad_settings_name_the_knob(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AutoFreeze(**kwargs)


def test_relative_change_is_l1_over_all_tensors() -> None:
    ref = [torch.ones(3), torch.full((2,), 2.0)]
    cur = [torch.tensor([1.0, 1.5, 1.0]), torch.full((2,), 2.0)]
    assert relative_change(cur, ref) == pytest.approx(0.5 / 7)


def test_freeze_step_must_be_auto_or_a_count() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    for bad in ("soon", 0, True):
        with pytest.raises(ValueError, match="freeze_step"):
            OneBitLamb(p, freeze_step=bad)


# ----------------------------------------------------------------------------- in use


def _steps(opt: torch.optim.Optimizer, params: list, steps: range, growth: float = 1.0) -> None:
    """Gradients of a fixed distribution (growth 1: the second moment settles) or growing
    by ``growth`` per step (it never does)."""
    for t in steps:
        g = torch.Generator().manual_seed(t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * growth**t
        opt.step()


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_settled_variance_freezes_before_the_cap_and_growing_one_at_it(cls) -> None:
    def make() -> tuple[list, torch.optim.Optimizer]:
        params = [torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(8))]
        rule = AutoFreeze(tolerance=0.05, window=5, max_step=200)
        return params, cls(params, lr=1e-3, freeze_step=rule, bias_correction=True)

    params, opt = make()
    _steps(opt, params, range(200))
    assert opt.auto_freeze.reason == "settled"
    assert 20 <= opt.freeze_step < 200 and opt.compressing
    assert all("freeze_ref" not in opt.state[p] for p in params)  # freed at the switch
    params, opt = make()
    _steps(opt, params, range(200), growth=1.05)
    assert opt.auto_freeze.reason == "cap" and opt.freeze_step == 200


def _auto_run(rank: int, world: int, path: str) -> tuple:
    """Straight, and stopped mid-warmup (after a check, before the decision) and resumed
    from a saved state: same freeze step, same parameters to the bit, on every rank."""

    def make() -> tuple[torch.nn.Module, OneBitLamb]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
        )
        rule = AutoFreeze(tolerance=0.2, window=3, patience=2, max_step=40)
        return model, OneBitLamb(
            model.parameters(), lr=0.01, freeze_step=rule, bias_correction=True
        )

    def run(model: torch.nn.Module, opt: OneBitLamb, steps: range) -> None:
        for t in steps:
            g = torch.Generator().manual_seed(100 * t + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, opt = make()
    run(model, opt, range(30))
    straight = (opt.freeze_step, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    stop = 4  # one check done (step 3), the reference for the next one saved with the state
    model, opt = make()
    run(model, opt, range(stop))
    torch.save({"m": model.state_dict(), "o": opt.state_dict()}, f"{path}/r{rank}.pt")
    model, opt = make()
    blob = torch.load(f"{path}/r{rank}.pt", weights_only=False)
    model.load_state_dict(blob["m"])
    opt.load_state_dict(blob["o"])
    run(model, opt, range(stop, 30))
    resumed = (opt.freeze_step, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return straight, resumed, opt.auto_freeze.history


@pytest.mark.timeout(120)
def test_ranks_agree_on_the_switch_and_resume_exactly(tmp_path: Path) -> None:
    results = spawn(_auto_run, 2, (str(tmp_path),), timeout_s=100)
    (f0, p0), (rf0, rp0), history = results[0]
    assert f0 is not None and f0 < 30, history  # it settled inside the run
    assert f0 == rf0 and torch.equal(p0, rp0)
    (f1, p1), (rf1, rp1), _ = results[1]
    assert (f1, rf1) == (f0, f0)
    assert torch.equal(p0, p1) and torch.equal(rp0, rp1)


# ----------------------------------------------------------------------------- what travels


def _one_compressed_step(rank: int, world: int, precondition: bool, floor: float) -> float:
    """Largest step of a coordinate whose gradients are 1000x smaller than the others',
    in units of lr, in the first compressed step."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(256))
    opt = OneBitAdam(
        [p],
        lr=1.0,
        freeze_step=4,
        bias_correction=True,
        precondition=precondition,
        denom_floor=floor,
        step_bound=None,  # the layer-wide bound would hide the per-element effect
    )
    scale = torch.ones(256)
    scale[:8] = 1e-3  # e.g. the embedding rows of rare tokens
    for t in range(5):
        g = torch.Generator().manual_seed(10 * t + rank)
        p.grad = torch.randn(256, generator=g) * scale
        before = p.detach().clone()
        opt.step()
    return float((p.detach() - before)[:8].abs().max())


@pytest.mark.timeout(120)
def test_preconditioned_compression_bounds_the_step_of_small_coordinates() -> None:
    """Compressing the raw momentum gives each element an error on the scale of its
    block's RMS |m|; divided by a small sqrt(v) that is a step far above lr (the papers'
    rule, no floor). The floor under the frozen denominator bounds it by 1/denom_floor
    steps; the preconditioned momentum keeps every element's step on Adam's scale."""
    raw = spawn(_one_compressed_step, 2, (False, 0.0), timeout_s=100)
    floored = spawn(_one_compressed_step, 2, (False, 0.1), timeout_s=100)
    pre = spawn(_one_compressed_step, 2, (True, 0.1), timeout_s=100)
    assert max(raw) > 20.0, raw
    assert 1.0 < max(floored) < 10.0, floored
    assert max(pre) < 3.0, pre


# ----------------------------------------------------------------------------- edges


def test_library_defaults_freeze_a_settled_variance_not_the_bias_ramp() -> None:
    """OneBitAdam() as a user gets it (auto, bias correction on): stationary gradients
    settle long before the raw v (which grows as 1 - 0.999^t) would."""
    p = [torch.nn.Parameter(torch.zeros(512))]
    opt = OneBitAdam(p, lr=1e-3)
    _steps(opt, p, range(300))
    assert opt.auto_freeze.reason == "settled" and opt.freeze_step <= 120, opt.auto_freeze
    v_hat = opt.state[p[0]]["exp_avg_sq"] / (1 - 0.999**opt.freeze_step)
    assert 0.8 < float(v_hat.mean()) < 1.2  # N(0, 1) gradients: v_hat ~ 1 when frozen


def test_one_rule_object_serves_two_optimizers() -> None:
    rule = AutoFreeze(tolerance=0.05, window=5, max_step=100)
    pairs = []
    for _ in range(2):
        p = [torch.nn.Parameter(torch.zeros(64))]
        pairs.append((p, OneBitLamb(p, lr=1e-3, freeze_step=rule)))
    for p, opt in pairs:
        _steps(opt, p, range(120))
        assert opt.compressing
    assert rule.decided_at is None  # the caller's object is left as it was


def test_resume_with_a_fixed_step_already_passed_switches_at_once() -> None:
    """Saved in warmup at step 20, resumed with freeze_step 10: compression starts now,
    with everything it needs (1-bit LAMB's fresh variance), instead of a KeyError."""
    p = [torch.nn.Parameter(torch.randn(32))]
    opt = OneBitLamb(p, lr=1e-3, freeze_step=40)
    _steps(opt, p, range(20))
    saved = opt.state_dict()
    q = [torch.nn.Parameter(p[0].detach().clone())]
    resumed = OneBitLamb(q, lr=1e-3, freeze_step=10)
    resumed.load_state_dict(saved)
    assert resumed.compressing and resumed.freeze_step == 20
    _steps(resumed, q, range(20, 25))
    assert "exp_avg_sq_fresh" in resumed.state[q[0]]


def test_state_saved_before_the_automatic_freeze_is_refused_clearly() -> None:
    p = [torch.nn.Parameter(torch.randn(16))]
    opt = OneBitLamb(p, lr=1e-3, freeze_step=5)
    _steps(opt, p, range(8))
    saved = opt.state_dict()
    for key in [k for k in saved["thinwire"]["rank0"] if k.startswith("freeze")]:
        del saved["thinwire"]["rank0"][key]  # what an older version wrote
    with pytest.raises(ValueError, match="pass that step as freeze_step"):
        OneBitLamb([torch.nn.Parameter(torch.randn(16))], freeze_step="auto").load_state_dict(saved)
    fixed = OneBitLamb([torch.nn.Parameter(torch.randn(16))], freeze_step=5)
    fixed.load_state_dict(saved)  # a fixed step is what such a run was configured with
    assert fixed.compressing


def test_state_dict_leaves_the_live_state_untouched() -> None:
    """Saving must not turn the running optimizer's float state into tensors (which then
    crashed the first metrics record after a checkpoint)."""
    p = [torch.nn.Parameter(torch.randn(16))]
    opt = OneBitLamb(p, lr=1e-3, freeze_step=2)
    _steps(opt, p, range(4))
    opt.state_dict()
    state = opt.state[p[0]]
    assert isinstance(state["lamb_coeff_freeze"], float)
    assert isinstance(state["last_factor"], float)
    assert isinstance(state["scaling_coeff"], float)


def _disagreeing(rank: int, world: int) -> tuple[int | None, int]:
    """Each rank measures a slightly different change around the tolerance: the rule
    must still decide alike everywhere (and nothing may hang)."""
    torch.manual_seed(0)
    p = [torch.nn.Parameter(torch.randn(64))]
    opt = OneBitLamb(p, lr=1e-3, freeze_step=AutoFreeze(tolerance=0.05, window=2, max_step=50))
    opt._measure_change = lambda: 0.0499999 if rank == 1 else 0.0500001  # type: ignore[method-assign]
    _steps(opt, p, range(60))
    return opt.freeze_step, opt.auto_freeze.decided_at


@pytest.mark.timeout(120)
def test_ranks_that_measure_differently_still_switch_together() -> None:
    results = spawn(_disagreeing, 2, timeout_s=100)
    assert results[0] == results[1] == (50, 50)  # rank 0's measurements rule: the cap
