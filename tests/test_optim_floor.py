"""The floor under the frozen denominators: dead units raised, healthy rows left alone."""

from __future__ import annotations

import torch

from thinwire.optim.floor import floor_denominators, layer_reference

EPS = 1e-8


def _denom(v: torch.Tensor) -> torch.Tensor:
    return v.sqrt() + EPS


def test_fused_query_key_value_rows_are_not_floored() -> None:
    """A fused q/k/v projection whose value rows carry 20x larger gradients: the query
    and key rows are two thirds of the tensor and sit far below its mean, but none of them
    is dead. A floor relative to the mean raised all of them (the 300-step regression)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(3 * 32, 16, generator=g) + 0.1
    rows[64:] *= 30.0  # the value rows
    d = _denom(rows**2)
    before = d.clone()
    report = floor_denominators([d], [0.1], [EPS])
    # A floor at a tenth of the mean would raise most query and key elements.
    assert int((before[:64] < 0.1 * before.mean()).sum()) > 64 * 16 // 2
    assert report.raised == 0
    assert torch.equal(d, before)


def test_dead_units_are_raised_to_a_share_of_the_live_median() -> None:
    d = _denom(torch.full((100,), 4.0))
    d[:7] = EPS  # v = 0: units that never fired
    d[7] = 2.0 * 0.05  # near-dead: a twentieth of its neighbours
    report = floor_denominators([d], [0.1], [EPS])
    assert report.zeros == 7 and report.raised == 8
    assert torch.allclose(d[:8], torch.full((8,), 0.2))
    assert torch.all(d[8:] == 2.0 + EPS)


def test_a_mostly_dead_layer_is_still_protected() -> None:
    """More than half the layer never saw a gradient: the median of all elements is eps,
    so the reference is taken over the live ones."""
    d = _denom(torch.ones(10))
    d[:7] = EPS
    assert layer_reference(d, EPS) == float(d[9])
    report = floor_denominators([d], [0.1], [EPS])
    assert report.raised == 7 and float(d.min()) > 0.09


def test_an_all_dead_layer_and_a_zero_floor_change_nothing() -> None:
    dead = torch.full((5,), EPS)
    live = _denom(torch.tensor([0.0, 1.0, 4.0]))
    report = floor_denominators([dead, live], [0.1, 0.0], [EPS, EPS])
    assert layer_reference(dead, EPS) is None
    assert report.raised == 0 and report.zeros == 6
    assert torch.all(dead == EPS) and float(live[0]) == float(torch.tensor(EPS))


def test_near_dead_rows_do_not_set_the_reference() -> None:
    """A tied byte embedding after pretraining: three quarters of its rows are bytes the
    text never uses, with ``v`` around 1e-16 (not 0). Counted as live they made the
    median, and the floor left them at 1e-4 of the used rows' ``d``: the first
    compressed step moved them by 15x the embedding's norm."""
    g = torch.Generator().manual_seed(0)
    used = torch.rand(64, 32, generator=g) * 1e-6 + 1e-7
    unused = torch.rand(192, 32, generator=g) * 1e-15 + 1e-16
    d = _denom(torch.cat([used, unused]))
    reference = layer_reference(d, EPS)
    assert reference is not None
    assert float(d[:64].min()) <= reference <= float(d[:64].max())
    report = floor_denominators([d], [0.1], [EPS])
    assert report.raised >= 192 * 32
    assert float(d[64:].min()) >= 0.1 * reference * (1 - 1e-6)
    assert float(d[:64].min()) > 0.1 * reference  # the used rows keep their own d
