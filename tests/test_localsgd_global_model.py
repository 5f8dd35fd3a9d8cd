"""The global model: theta, the outer optimizer, staleness rules, the sync hold, state."""

from __future__ import annotations

import copy

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.global_model import GlobalModel


def _model(**kw: object) -> GlobalModel:
    args: dict = dict(buffer_size=2, outer="nesterov", outer_lr=1.0, outer_momentum=0.0)
    args.update(kw)
    return GlobalModel(torch.zeros(4), **args)


def test_poly_discounts_by_staleness_and_max_staleness_drops() -> None:
    poly = _model(staleness="poly", max_staleness=5)
    g = torch.full((4,), 2.0)
    assert poly.staleness_of(None) == 0 and poly.staleness_of(7) == 0  # never negative
    assert poly.apply(g, 3, tau=3)  # scaled by (1 + 3)^-1/2 = 0.5; SGD with lr 1
    assert torch.equal(poly.theta.detach(), torch.full((4,), -1.0))
    assert poly.version == 1 and poly.staleness_of(0) == 1
    before = poly.theta.detach().clone()
    assert not poly.apply(g, 2, tau=6)  # staler than 5: dropped, its steps still spent
    assert torch.equal(poly.theta.detach(), before) and poly.version == 1
    assert (poly.updates_applied, poly.updates_dropped, poly.steps_applied) == (1, 1, 5)
    assert poly.staleness_seen == {3: 1, 6: 1}


def test_held_arrivals_are_applied_in_worker_order() -> None:
    # With momentum the order of two updates matters, so worker order is observable.
    held, direct = _model(outer_momentum=0.9), _model(outer_momentum=0.9)
    g1, g2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 5.0, 0, 0])
    held.hold(2, g2, 1, 0)
    held.hold(1, g1, 1, 0)
    assert held.holding and held.version == 0
    held.flush()
    direct.apply(g1, 1, 0)
    direct.apply(g2, 1, 0)
    assert not held.holding and torch.equal(held.theta, direct.theta)
    backwards = _model(outer_momentum=0.9)
    backwards.apply(g2, 1, 0)
    backwards.apply(g1, 1, 0)
    assert not torch.equal(backwards.theta, direct.theta)


def test_resize_follows_dead_workers_and_never_goes_below_one() -> None:
    dn = _model(outer="dn", buffer_size=3)
    dn.resize(1)
    assert dn.opt.param_groups[0]["buffer_size"] == 2
    dn.resize(5)
    assert dn.opt.param_groups[0]["buffer_size"] == 1
    _model().resize(1)  # naive Nesterov has no buffer: nothing to do


def test_state_round_trip_and_refusals() -> None:
    a = _model(outer="dn", outer_momentum=0.9)
    for i in range(3):
        a.apply(torch.randn(4, generator=torch.Generator().manual_seed(i)), 2, i)
    b = _model(outer="dn", outer_momentum=0.9)
    # As through a checkpoint file: torch's optimizer state_dict holds live tensors.
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    g = torch.ones(4)
    a.apply(g, 1, 0)
    b.apply(g, 1, 0)
    assert torch.equal(a.theta, b.theta) and (b.version, b.steps_applied) == (4, 7)
    with pytest.raises(ConfigError, match="checkpoint holds 4 parameters, the model has 5"):
        GlobalModel(torch.zeros(5), buffer_size=2).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="outer optimizer DelayedNesterov"):
        _model().load_state_dict(a.state_dict())


def test_unknown_outer_or_staleness_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^unknown outer optimizer 'adam'; choose one of"):
        _model(outer="adam")
    with pytest.raises(ConfigError, match=r"^unknown staleness rule 'exp'; choose one of"):
        _model(staleness="exp")
