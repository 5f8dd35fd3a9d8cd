"""Delayed Nesterov and naive Nesterov against torch.optim.SGD(nesterov=True)."""

from __future__ import annotations

import copy

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.outer import AsyncBuffer, DelayedNesterov, Nesterov


def _apply(opt: torch.optim.Optimizer, p: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("n", [1, 3, 4])
def test_dn_with_c0_equals_sgd_nesterov_on_the_mean(n: int) -> None:
    torch.manual_seed(0)
    theta0 = torch.randn(257)
    rounds = [[torch.randn(257) for _ in range(n)] for _ in range(5)]
    p_dn = torch.nn.Parameter(theta0.clone())
    p_sgd = torch.nn.Parameter(theta0.clone())
    dn = DelayedNesterov([p_dn], lr=0.7, momentum=0.9, buffer_size=n, c=0.0)
    sgd = torch.optim.SGD([p_sgd], lr=0.7, momentum=0.9, nesterov=True)
    for grads in rounds:
        _apply(dn, p_dn, grads)
        _apply(sgd, p_sgd, [torch.stack(grads).mean(0)])
        torch.testing.assert_close(p_dn.data, p_sgd.data)
        torch.testing.assert_close(
            dn.state[p_dn]["momentum_buffer"], sgd.state[p_sgd]["momentum_buffer"]
        )
    assert dn.state[p_dn]["step"] == 5 * n


def test_dn_with_n1_is_naive_nesterov() -> None:
    torch.manual_seed(1)
    theta0, grads = torch.randn(100), [torch.randn(100) for _ in range(7)]
    params = [torch.nn.Parameter(theta0.clone()) for _ in range(3)]
    opts = [
        DelayedNesterov([params[0]], lr=0.3, momentum=0.8, buffer_size=1),
        Nesterov([params[1]], lr=0.3, momentum=0.8),
        torch.optim.SGD([params[2]], lr=0.3, momentum=0.8, nesterov=True),
    ]
    for g in grads:
        for p, o in zip(params, opts, strict=True):
            _apply(o, p, [g])
        torch.testing.assert_close(params[0].data, params[1].data)
        torch.testing.assert_close(params[1].data, params[2].data)


def test_dn_intermediate_arrivals_apply_g_over_n_and_c_share() -> None:
    # With c > 0, each non-final arrival also applies c * beta * m (Algorithm 3).
    p = torch.nn.Parameter(torch.zeros(4))
    dn = DelayedNesterov([p], lr=1.0, momentum=0.5, buffer_size=2, c=0.5)
    _apply(dn, p, [torch.ones(4), torch.ones(4)])  # m = 1 after the first round
    m = dn.state[p]["momentum_buffer"].clone()
    before = p.detach().clone()
    _apply(dn, p, [torch.full((4,), 2.0)])
    expected = before - (0.5 * 0.5 * m + torch.full((4,), 2.0) / 2)
    torch.testing.assert_close(p.data, expected)


def test_dn_state_dict_resumes_exactly() -> None:
    torch.manual_seed(2)
    grads = [torch.randn(30) for _ in range(9)]
    p1 = torch.nn.Parameter(torch.zeros(30))
    o1 = DelayedNesterov([p1], lr=0.5, momentum=0.9, buffer_size=4, c=0.1)
    _apply(o1, p1, grads[:5])  # stop mid-buffer: Delta and the pending count matter
    p2 = torch.nn.Parameter(p1.detach().clone())
    o2 = DelayedNesterov([p2], lr=0.5, momentum=0.9, buffer_size=4, c=0.1)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # as if through torch.save
    _apply(o1, p1, grads[5:])
    _apply(o2, p2, grads[5:])
    assert torch.equal(p1.data, p2.data)


def test_buffer_shrinks_when_a_worker_dies() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    dn = DelayedNesterov([p], lr=1.0, momentum=0.9, buffer_size=4, c=0.25)
    dn.set_buffer_size(2)
    assert dn.param_groups[0]["buffer_size"] == 2
    _apply(dn, p, [torch.ones(3), torch.ones(3)])
    assert dn.state[p]["pending"] == 0  # two arrivals now complete a buffer


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"buffer_size": 0}, "buffer size N must be an integer >= 1"),
        ({"buffer_size": 2.5}, "buffer size N must be an integer >= 1"),
        ({"buffer_size": 4, "c": 0.3}, r"c must be in \[0, 1/N\] = \[0, 0.25\]"),
        ({"c": -0.1}, "c must be in"),
        ({"lr": 0.0}, "outer lr must be > 0"),
        ({"momentum": 1.0}, r"outer momentum must be in \[0, 1\)"),
    ],
)
def test_bad_outer_settings(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DelayedNesterov([torch.nn.Parameter(torch.zeros(1))], **kw)


@pytest.mark.parametrize("cls", [DelayedNesterov, Nesterov, AsyncBuffer])
def test_the_momentum_warmup_ramps_beta_from_zero_and_resumes_exactly(cls) -> None:
    # Against a hand-written Nesterov whose beta at arrival k is 0.9 * min(1, k / 6):
    # with N = 1 every form of the outer step is that Nesterov.
    torch.manual_seed(3)
    theta0, grads = torch.randn(33), [torch.randn(33) for _ in range(10)]
    p = torch.nn.Parameter(theta0.clone())
    kw = {} if cls is Nesterov else {"buffer_size": 1}
    opt = cls([p], lr=0.5, momentum=0.9, momentum_warmup=6, **kw)
    ref, m = theta0.clone().double(), torch.zeros(33, dtype=torch.float64)
    for k, g in enumerate(grads):
        beta = 0.9 * min(1.0, k / 6)
        m = beta * m + g.double()
        ref -= 0.5 * (g.double() + beta * m)
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.data.double(), ref, rtol=1e-5, atol=1e-6)
        if k == 3:  # mid-ramp: a copy from the state dict goes on exactly as the original
            q = torch.nn.Parameter(p.data.clone())
            twin = cls([q], lr=0.5, momentum=0.9, **kw)
            twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for g in grads[4:]:
        q.grad = g.clone()
        twin.step()
    assert torch.equal(q.data, p.data)


def test_the_momentum_warmup_must_count_arrivals() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    for bad in (-1, 2.5):
        with pytest.raises(ConfigError, match="momentum warmup must be an integer") as err:
            DelayedNesterov([p], momentum_warmup=bad)
        assert "\n" not in str(err.value)
