"""LAMB, 1-bit Adam, 1-bit LAMB in one process, against plain re-implementations of the
update rules of spec/onebit.md (written here independently, loop by loop)."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.optim import Lamb, OneBitAdam, OneBitLamb


def _problem(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) * (1 + i) for i, p in enumerate(params)]


def _run(opt_params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, steps: int):
    for t in range(steps):
        for p, g in zip(opt_params, _grads(t, opt_params), strict=True):
            p.grad = g.to(device=p.device, dtype=p.dtype)
        opt.step()
        yield t


def _ref_lamb(params, steps, lr, b1, b2, eps, wd, bias_correction, lo, hi):
    ps = [p.detach().clone().double() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t - 1, ps)):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2**t) if bias_correction else vs[i]
            u = m_hat / (v_hat.sqrt() + eps) + wd * ps[i]
            pn, un = ps[i].norm().item(), u.norm().item()
            r = 1.0 if pn == 0 or un == 0 else min(max(pn / un, lo), hi)
            ps[i] = ps[i] - lr * r * u
    return ps


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_matches_reference(bias_correction: bool, wd: float) -> None:
    params = _problem()
    ref = _ref_lamb(params, 6, 0.01, 0.9, 0.999, 1e-8, wd, bias_correction, 0.01, 10.0)
    opt = Lamb(params, lr=0.01, weight_decay=wd, bias_correction=bias_correction)
    list(_run(params, opt, 6))
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    assert len(opt.get_lamb_coeffs()) == 3


def test_onebit_adam_warmup_is_adam_without_bias_correction() -> None:
    params = _problem()
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    opt = OneBitAdam(params, lr=0.01, freeze_step=100, bias_correction=False)
    for t in _run(params, opt, 5):
        for i, g in enumerate(_grads(t, ps)):
            ms[i] = 0.9 * ms[i] + 0.1 * g
            vs[i] = 0.999 * vs[i] + 0.001 * g * g
            ps[i] = ps[i] - 0.01 * ms[i] / (vs[i].sqrt() + 1e-8)
        for p, r in zip(params, ps, strict=True):
            torch.testing.assert_close(p.detach(), r)


def test_onebit_adam_freezes_variance() -> None:
    params = _problem()
    opt = OneBitAdam(params, lr=0.01, freeze_step=3)
    list(_run(params, opt, 3))
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    list(_run(params, opt, 4))
    assert opt.compressing
    for p, v in zip(params, frozen, strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)


def _ref_onebit_lamb(params, steps, freeze, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """spec/onebit.md section 5, one process (the compressed average of one rank is exact)."""
    ps = [p.detach().clone().double() for p in params]
    n = len(ps)
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    v_fresh: list[torch.Tensor] = [None] * n  # type: ignore[list-item]
    c_freeze = [0.0] * n
    last_f = [1.0] * n
    scaling: list[float] | None = None
    for t in range(1, steps + 1):
        grads = [g.double() for g in _grads(t - 1, ps)]
        if t <= freeze:
            for i in range(n):
                m[i] = b1 * m[i] + (1 - b1) * grads[i]
                v[i] = b2 * v[i] + (1 - b2) * grads[i] ** 2
                if t == freeze:
                    v_fresh[i] = v[i].clone()
                u = m[i] / (v[i].sqrt() + eps) + wd * ps[i]
                pn, un = ps[i].norm().item(), u.norm().item()
                c = 1.0 if pn == 0 or un == 0 else min(max(pn / un, 0.01), 10.0)
                c_freeze[i] = 0.9 * c_freeze[i] + 0.1 * c
                ps[i] = ps[i] - lr * c * u
            continue
        if scaling is None:
            s = [m[i].norm().item() / math.sqrt(m[i].numel()) for i in range(n)]
            scaling = [(sum(s) / n) / si for si in s]
        for i in range(n):
            m_prev = m[i].clone()
            m[i] = (b1 * m[i] + (1 - b1) * grads[i]) * scaling[i]
            m[i] = m[i] / scaling[i]
            g_rec = (m[i] - b1 * m_prev) / (1 - b1)
            v_fresh[i] = b2 * v_fresh[i] + (1 - b2) * g_rec**2
            denom = v[i].sqrt() + eps
            u = m[i] / denom + wd * ps[i]
            f = (denom / (v_fresh[i].sqrt() + eps)).max().item()
            if wd:
                rho = min(1.0, (m[i] / denom).norm().item() / u.norm().item())
                f = f * rho + (1 - rho)
            f = min(max(f, 0.5), 4.0)
            f = min(max(f, last_f[i] * 0.9), last_f[i] * 1.1)
            last_f[i] = f
            ps[i] = ps[i] - lr * c_freeze[i] * f * u
    return ps


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_onebit_lamb_matches_reference_across_freeze(wd: float) -> None:
    params = _problem(3)
    ref = _ref_onebit_lamb(params, 9, freeze=4, lr=0.01, wd=wd)
    opt = OneBitLamb(params, lr=0.01, freeze_step=4, weight_decay=wd, bias_correction=False)
    list(_run(params, opt, 9))
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    coeffs = opt.get_lamb_coeffs()
    assert len(coeffs) == 3 and all(0.5 * cf <= c <= 4.0 * cf for c, cf, _ in coeffs)


def test_onebit_lamb_reloading_into_a_used_instance_forgets_its_frozen_variance() -> None:
    """The compression stage caches sqrt(v) of the frozen variance; loading a state with
    another frozen variance into the same instance must use the loaded one."""
    params_a, params_b = _problem(), _problem()
    opt_a = OneBitLamb(params_a, lr=0.01, freeze_step=2, bias_correction=True)
    opt_b = OneBitLamb(params_b, lr=0.01, freeze_step=2, bias_correction=True)
    list(_run(params_b, opt_b, 4))  # b: frozen at step 2, compressing since
    saved = opt_b.state_dict()
    saved_params = [p.detach().clone() for p in params_b]
    for t in range(5):  # a freezes another variance (larger gradients) and caches it
        for p, g in zip(params_a, _grads(t, params_a), strict=True):
            p.grad = 3.0 * g
        opt_a.step()
    opt_a.load_state_dict(saved)
    with torch.no_grad():
        for pa, pb in zip(params_a, saved_params, strict=True):
            pa.copy_(pb)
    list(_run(params_a, opt_a, 3))
    list(_run(params_b, opt_b, 3))
    for pa, pb in zip(params_a, params_b, strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("cls", [Lamb, OneBitAdam, OneBitLamb])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state(cls, dtype: torch.dtype) -> None:
    params32 = _problem(5)
    params_lp = _problem(5, dtype)
    kw = {} if cls is Lamb else {"freeze_step": 3}
    opt32, opt_lp = cls(params32, lr=0.01, **kw), cls(params_lp, lr=0.01, **kw)
    list(_run(params32, opt32, 6))
    list(_run(params_lp, opt_lp, 6))
    for p32, plp in zip(params32, params_lp, strict=True):
        assert plp.dtype == dtype
        assert opt_lp.state[plp]["exp_avg"].dtype == torch.float32
        assert opt_lp.state[plp]["master"].dtype == torch.float32
        # only the rounding of the initial weights and gradients to 8-11 bits differs
        torch.testing.assert_close(plp.float(), p32.detach(), rtol=0.05, atol=0.05)
    sd = opt_lp.state_dict()
    again = cls(_problem(5, dtype), lr=0.01, **kw)
    again.load_state_dict(sd)
    for p in again._params():
        assert again.state[p]["exp_avg"].dtype == torch.float32  # not cast to the param's


def test_a_layer_that_begins_to_train_late_counts_its_own_adam_steps() -> None:
    """A group added at step 300 (progressive unfreezing): its bias corrections count its
    own steps, as torch's Adam counts per parameter; with the global count its first
    steps were 1.6x torch's (3-5x when added at step 2000)."""
    first, late = _problem(1), _problem(2)
    mine_first, mine_late = (
        [p.detach().clone().requires_grad_() for p in first],
        [p.detach().clone().requires_grad_() for p in late],
    )
    ours = OneBitAdam(mine_first, lr=1e-3, freeze_step=10_000)
    ref = torch.optim.Adam(first, lr=1e-3)
    for t in range(300):
        for p, q, g in zip(first, mine_first, _grads(t, first), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    ours.add_param_group({"params": mine_late})
    ref.add_param_group({"params": late})
    for t in range(300, 305):
        both = list(zip(first + late, mine_first + mine_late, strict=True))
        for (p, q), g in zip(both, _grads(t, first) + _grads(t + 7, late), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(first + late, mine_first + mine_late, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cls", [Lamb, OneBitAdam, OneBitLamb])
def test_weights_the_user_writes_are_not_overwritten_by_the_master(cls) -> None:
    """A bf16 model's weights reset mid-run (an EMA, a load_state_dict): the next step
    starts from them, as torch's optimizers do, not from the fp32 master of before."""
    params = _problem(5, torch.bfloat16)
    kw = {} if cls is Lamb else {"freeze_step": 3}
    opt = cls(params, lr=0.01, **kw)
    list(_run(params, opt, 6))  # across the freeze
    untouched = [opt.state[p]["master"].clone() for p in params]
    list(_run(params, opt, 1))
    moved = [opt.state[p]["master"] for p in params]
    # no write of the user's: the master keeps what bf16 rounds away
    assert any(not torch.equal(m, m.bfloat16().float()) for m in moved)
    assert any(not torch.equal(a, b) for a, b in zip(untouched, moved, strict=True))
    reset = [torch.randn_like(p) for p in params]
    with torch.no_grad():
        for p, r in zip(params, reset, strict=True):
            p.copy_(r)
    for group in opt.param_groups:
        group["lr"] = 0.0
    list(_run(params, opt, 1))
    for p, r in zip(params, reset, strict=True):
        assert torch.equal(p, r)  # the reset stands; lr 0 moves nothing
        assert torch.equal(opt.state[p]["master"], r.float())


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Lamb, {"lr": -1.0}, "lr must be in"),
        (Lamb, {"betas": (1.0, 0.999)}, r"betas\[0\] must be in \[0.0, 1.0\)"),
        (Lamb, {"eps": 0.0}, r"eps must be in \(0.0"),
        (Lamb, {"min_coeff": 1.0, "max_coeff": 0.5}, "max_coeff must be in"),
        (OneBitAdam, {"freeze_step": 0}, r"freeze_step must be in \[1"),
        (OneBitLamb, {"freeze_step": 5, "coeff_beta": 1.5}, "coeff_beta must be in"),
        (OneBitLamb, {"freeze_step": 5, "factor_min": 2.0, "factor_max": 1.0}, "factor_max"),
        (OneBitLamb, {"freeze_step": 5, "factor_threshold": -0.1}, "factor_threshold"),
        (OneBitLamb, {"freeze_step": 5, "weight_decay": -1.0}, "weight_decay must be in"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(cls, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        cls(_problem(), **kwargs)


@pytest.mark.parametrize("cls", [Lamb, OneBitAdam, OneBitLamb])
def test_complex_and_sparse_are_refused(cls) -> None:
    kw = {} if cls is Lamb else {"freeze_step": 2}
    with pytest.raises(ValueError, match="complex parameters"):
        cls([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], **kw)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = cls([p], **kw)
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


@pytest.mark.parametrize("cls", [Lamb, OneBitAdam, OneBitLamb])
def test_nan_gradient_skips_step_without_touching_state(cls) -> None:
    params = _problem()
    kw = {} if cls is Lamb else {"freeze_step": 2}
    opt = cls(params, lr=0.01, **kw)
    for stage_steps in (1, 3):  # warmup, then compression stage
        list(_run(params, opt, stage_steps))
        before = [p.detach().clone() for p in params]
        moments = [opt.state[p]["exp_avg"].clone() for p in params]
        for p, g in zip(params, _grads(99, params), strict=True):
            p.grad = g
        params[1].grad[0] = float("nan")
        skipped = opt.skipped_steps
        opt.step()
        assert opt.skipped_steps == skipped + 1
        for p, b, m in zip(params, before, moments, strict=True):
            assert torch.equal(p.detach(), b)
            assert torch.equal(opt.state[p]["exp_avg"], m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [Lamb, OneBitAdam, OneBitLamb])
def test_cuda_steps_match_cpu(cls) -> None:
    # Across the freeze, with the state on the device; only float rounding may differ.
    kw = {} if cls is Lamb else {"freeze_step": 3}
    cpu = _problem(6)
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in _problem(6)]
    opt_cpu, opt_gpu = cls(cpu, lr=0.01, **kw), cls(gpu, lr=0.01, **kw)
    list(_run(cpu, opt_cpu, 6))
    list(_run(gpu, opt_gpu, 6))
    for pc, pg in zip(cpu, gpu, strict=True):
        assert pg.is_cuda and opt_gpu.state[pg]["exp_avg"].is_cuda
        torch.testing.assert_close(pg.detach().cpu(), pc.detach(), rtol=1e-4, atol=1e-5)


def test_onebit_state_without_its_per_rank_part_is_refused_in_one_line() -> None:
    """torch.distributed.checkpoint.state_dict's API keeps only state and param_groups:
    loading that into a 1-bit optimizer would restart its warmup and drop its error
    feedback without a word."""
    from thinwire.optim import OneBitAdam

    p = torch.nn.Parameter(torch.ones(4))
    opt = OneBitAdam([p], lr=1e-2, freeze_step=1)
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    del sd["thinwire"]
    with pytest.raises(ValueError, match="without its per-rank part") as err:
        OneBitAdam([torch.nn.Parameter(torch.ones(4))], freeze_step=1).load_state_dict(sd)
    assert "\n" not in str(err.value)
