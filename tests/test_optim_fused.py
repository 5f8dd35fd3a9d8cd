"""The optimizers' step on many layers: LAMB in batches of layers (torch's foreach
kernels), and reads back to the host that do not grow with the number of layers (on a
GPU each read waits for the stream: one per layer made LAMB 8x slower than AdamW)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import thinwire.optim.base as base_module
from thinwire.optim import Lamb, OneBitAdam, OneBitLamb


def _layers(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (16,)]
    return [
        torch.nn.Parameter(torch.randn(shapes[i % len(shapes)], generator=g).to(dtype))
        for i in range(n)
    ]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (1 + i % 3) for i, p in enumerate(params)]


def _feed(params: list[torch.nn.Parameter], step: int) -> None:
    for p, g in zip(params, _grads(params, step), strict=True):
        p.grad = g.to(p.dtype)


def _per_layer_lamb(
    params: list[torch.Tensor], steps: int, settings: list[tuple[float, float]]
) -> list[torch.Tensor]:
    """LAMB one layer at a time in float64, with thinwire's defaults; ``settings`` holds
    each layer's (lr, weight decay)."""
    b1, b2, eps = 0.9, 0.999, 1e-6
    ps = [p.detach().clone().double() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        grads = _grads(ps, t - 1)
        for i, ((lr, wd), p) in enumerate(zip(settings, ps, strict=True)):
            g = grads[i].double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = (ms[i] / (1 - b1**t)) / ((vs[i] / (1 - b2**t)).sqrt() + eps) + wd * p
            pn, un = p.norm().item(), u.norm().item()
            r = 1.0 if pn == 0 or un == 0 else min(max(pn / un, 0.01), 10.0)
            ps[i] = p - lr * r * u
    return ps


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [1 << 26, 20])
def test_lamb_in_batches_of_layers_matches_a_layer_at_a_time(monkeypatch, chunk: int) -> None:
    # chunk=20 elements: a batch per layer or two, and a layer (7x5) larger than a batch;
    # two groups, so that no batch mixes their settings.
    monkeypatch.setattr(base_module, "FUSED_CHUNK", chunk)
    params = _layers(8)
    ref = _per_layer_lamb(params, 5, [(0.01, 0.01)] * 5 + [(0.002, 0.0)] * 3)
    opt = Lamb(
        [
            {"params": params[:5], "lr": 0.01, "weight_decay": 0.01},
            {"params": params[5:], "lr": 0.002},
        ],
        eps=1e-6,
    )
    for t in range(5):
        _feed(params, t)
        opt.step()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    assert len(opt.get_lamb_coeffs()) == 8 and all(c > 0 for c in opt.get_lamb_coeffs())


def test_layers_without_a_gradient_are_left_alone() -> None:
    params = _layers(6)
    opt = Lamb(params, lr=0.01)
    frozen = params[2].detach().clone()
    for t in range(3):
        _feed(params, t)
        params[2].grad = None
        opt.step()
    assert torch.equal(params[2].detach(), frozen)
    assert "exp_avg" not in opt.state[params[2]]
    assert len(opt.get_lamb_coeffs()) == 5


class _Dispatched(TorchDispatchMode):
    """Counts the operators a step dispatches (on a GPU, about a kernel launch each) and
    the reads of values into Python: ``float()``, ``bool()``, ``.item()`` (one operator)
    and ``.tolist()`` (none on the CPU, counted by the test), each a wait for the stream
    on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _per_step(
    make: Callable[[list[Any]], torch.optim.Optimizer],
    layers: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, int]]:
    """(operators, host reads) of each of 8 steps, the freeze's (step 3) left out: the
    freeze reads every layer's statistics once a run (the floor, the 1-bit scales)."""
    params = _layers(layers, dtype=dtype)
    opt = make(params)
    counts = []
    tolist = torch.Tensor.tolist
    for t in range(1, 9):
        _feed(params, t)
        seen = _Dispatched()

        def counted(x: torch.Tensor, seen: _Dispatched = seen) -> Any:
            seen.reads += 1
            return tolist(x)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        with seen:
            opt.step()
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        if t != 3:
            counts.append((seen.ops, seen.reads))
    return counts


MAKERS = {
    "Lamb": lambda ps: Lamb(ps, lr=0.01),
    "OneBitLamb": lambda ps: OneBitLamb(ps, lr=0.01, freeze_step=3),
    "OneBitAdam": lambda ps: OneBitAdam(ps, lr=0.01, freeze_step=3),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_a_step_costs_few_operators_per_layer_and_no_host_read(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Warmup and compressed steps, 4 layers against 16: the host reads do not grow at
    # all, the operators by a few per layer (a layer at a time took 21 to 43, and each
    # is a kernel launch on a GPU; torch's foreach AdamW takes 2).
    shallow = _per_step(MAKERS[name], 4, dtype, monkeypatch)
    deep = _per_step(MAKERS[name], 16, dtype, monkeypatch)
    assert [r for _, r in deep] == [r for _, r in shallow]
    assert all(r <= 6 for _, r in deep), deep
    per_layer = [(d - s) / 12 for (d, _), (s, _) in zip(deep, shallow, strict=True)]
    assert max(per_layer) <= 8, per_layer


def test_all_finite_reads_mixed_dtypes_by_kind() -> None:
    from thinwire.optim.base import all_finite

    fp32, bf16 = torch.ones(5), torch.ones(3, dtype=torch.bfloat16)
    assert all_finite([fp32, bf16, torch.empty(0)])
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = bf16.clone()
        poisoned[1] = bad
        assert not all_finite([fp32, poisoned])
        poisoned32 = fp32.clone()
        poisoned32[4] = bad
        assert not all_finite([poisoned32, bf16])
    assert all_finite([])
