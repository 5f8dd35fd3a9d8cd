"""Streaming DiLoCo: DiLoCo when whole, the staggered schedule, overlap and mixing, quantized
fragments on 2 ranks, peak bytes per sync, resume with a fragment in flight, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm import COUNTER, quantized_wire_bytes
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.localsgd import DiLoCo, StreamingDiLoCo
from thinwire.localsgd.algorithm.streaming_fragments import split_fragments, sync_offsets


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_one_fragment_without_overlap_is_diloco() -> None:
    a, b = _model(), _model()
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    with (
        DiLoCo(a, opt_a, 3, outer_lr=0.7, inner_momentum="keep") as d,
        StreamingDiLoCo(b, opt_b, 3, fragments=1, outer_lr=0.7) as s,
    ):
        for i in range(10):
            _step(a, opt_a, i)
            _step(b, opt_b, i)
            torch.testing.assert_close(_flat(a), _flat(b), rtol=0, atol=0)
    assert d.outer_steps == s.syncs == 3


def test_fragments_take_turns_and_overlap_defers_the_average() -> None:
    model = _model()
    params = list(model.parameters())
    frags = split_fragments(model, params, 3)
    assert [i for f in frags for i in f] == list(range(len(params)))  # consecutive, all
    assert sync_offsets(6, 3) == [2, 4, 0]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(model, opt, 6, fragments=3, overlap=1, outer_lr=1.0, outer_momentum=0.0)
    sent_at: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for i in range(1, 13):
        before = [g.clone() for g in s.global_params]
        _step(model, opt, i)
        s.after_inner_step()
        for f, idx in enumerate(frags):
            if any(not torch.equal(before[k], s.global_params[k]) for k in idx):
                sent_at[f].append(i)
    # Each fragment's global weights move one step after its turn (t mod 6 = 2, 4, 0).
    assert sent_at == {0: [3, 9], 1: [5, 11], 2: [7]}
    assert s.syncs == 5 and list(s._pending) == [2]
    s.flush()
    assert s.syncs == 6 and not s._pending
    s.close()


def test_alpha_mixes_the_local_weights_back_in() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(
        model, opt, 4, fragments=1, overlap=2, alpha=0.5, outer_lr=1.0, outer_momentum=0.0
    )
    for i in range(1, 7):
        _step(model, opt, i)
        if i == 4:
            sent = _flat(model).clone()  # one worker, lr 1, no momentum: the new theta
        if i == 6:
            local = _flat(model).clone()
        s.after_inner_step()
    # Sent at step 4, applied at step 6: half the step-6 weights, half the new theta.
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in s.global_params]), sent)
    torch.testing.assert_close(_flat(model), 0.5 * local + 0.5 * sent)
    s.close()


def test_finish_takes_no_outer_step_for_a_fragment_that_just_synced() -> None:
    """A fragment synced at the last step (without mixing) is already on every replica;
    a sync of its zero pseudo-gradient would still move it by the outer momentum, a step
    DiLoCo does not take. The other fragment syncs its last step. A resumed run knows
    which fragment synced when, and finishes alike."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(model, opt, 2, fragments=2, outer_lr=0.7, outer_momentum=0.9)
    for i in range(1, 5):  # fragment 0 syncs at odd steps, fragment 1 at even ones
        _step(model, opt, i)
        s.after_inner_step()
    frags, before = s.fragments, [g.clone() for g in s.global_params]
    saved = copy.deepcopy(s.state_dict())
    s.finish()
    moved = [any(not torch.equal(before[k], s.global_params[k]) for k in f) for f in frags]
    assert moved == [True, False] and s.syncs == 5
    torch.testing.assert_close(_flat(model), torch.cat([g.reshape(-1) for g in s.global_params]))
    twin_model = _model(seed=1)
    twin = StreamingDiLoCo(
        twin_model,
        torch.optim.SGD(twin_model.parameters(), lr=0.05),
        2,
        fragments=2,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    twin.load_state_dict(saved)
    twin.finish()
    torch.testing.assert_close(_flat(twin_model), _flat(model), rtol=0, atol=0)
    # A checkpoint from before the step of each fragment's last sync was kept: finish()
    # syncs every fragment, as it did when that checkpoint was written.
    older_model = _model(seed=2)
    older = StreamingDiLoCo(
        older_model,
        torch.optim.SGD(older_model.parameters(), lr=0.05),
        2,
        fragments=2,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    older.load_state_dict({k: v for k, v in saved.items() if k != "applied_at"})
    older.finish()
    assert older.syncs == 4 + 2


def test_finish_leaves_a_fragment_the_flush_landed() -> None:
    """With an overlap, the fragment still in flight at the end lands in finish()'s flush
    and replaces the local weights (alpha 0): it is not synced again."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(model, opt, 4, fragments=2, overlap=1, outer_lr=0.7)
    for i in range(1, 5):  # fragment 0 sends at step 2 and lands at 3; fragment 1 at 4
        _step(model, opt, i)
        s.after_inner_step()
    assert list(s._pending) == [1] and s.syncs == 1
    assert s.finishing() == [0, 1]  # before the flush, fragment 1 is still in flight
    s.finish()
    assert s.syncs == 1 + 1 + 1  # the landed one, then fragment 0 once more
    assert s.finishing() == []  # both synced at this step: nothing left to finish
    torch.testing.assert_close(_flat(model), torch.cat([g.reshape(-1) for g in s.global_params]))


def test_refusals_are_one_line() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"fragments": 2, "overlap": 5}, r"= \[0, 5\), got 5"),
        ({"fragments": 7}, "cannot cut 6 trainable parameter"),
        ({"fragments": 2, "inner_momentum": "restart"}, "per fragment"),
        ({"fragments": 2, "alpha": 1.0}, "alpha must be in"),
        ({"fragments": 2, "compress": "int2"}, "compression must be one of"),
        ({"fragments": [model[0], model[2]]}, "leave 2 trainable parameter"),
        ({"fragments": [model[0], model[0], model[2], model[4]]}, "shares parameters"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            StreamingDiLoCo(model, opt, 10, **kwargs)
    with pytest.raises(ConfigError, match="do not fit a round"):
        StreamingDiLoCo(model, opt, 2, fragments=3)
    saved = StreamingDiLoCo(model, opt, 10, fragments=2).state_dict()
    with pytest.raises(ConfigError, match="saved with 2 fragments, this run has 3"):
        StreamingDiLoCo(model, opt, 10, fragments=3).load_state_dict(saved)


def _fragment_sizes() -> list[int]:
    model = _model()
    params = list(model.parameters())
    return [sum(params[i].numel() for i in f) for f in split_fragments(model, params, 2)]


def _ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for compress in ("none", "int4", "onebit"):
        model = _model(seed=rank)  # different inits: rank 0's is broadcast
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kwargs: dict[str, Any] = {"fragments": 2, "overlap": 1, "alpha": 0.5, "compress": compress}
        COUNTER.reset()
        s = StreamingDiLoCo(model, opt, 6, **kwargs)
        for i in range(9):  # sends at steps 3, 6 and 9: the last is in flight at the save
            _step(model, opt, i, rank)
            s.after_inner_step()
        saved = copy.deepcopy((s.state_dict(), opt.state_dict(), model.state_dict()))
        sent = COUNTER.snapshot()
        twin_model = _model(seed=7)
        twin_opt = torch.optim.AdamW(twin_model.parameters(), lr=1e-2)
        twin = StreamingDiLoCo(twin_model, twin_opt, 6, sync_initial=False, **kwargs)
        twin_model.load_state_dict(saved[2])
        twin_opt.load_state_dict(saved[1])
        twin.load_state_dict(saved[0])
        for i in range(9, 14):  # sends at step 12, applied at 13
            for m, o, d in ((model, opt, s), (twin_model, twin_opt, twin)):
                _step(m, o, i, rank)
                d.after_inner_step()
        for d in (s, twin):
            d.flush()
            d.close()
        out[compress] = {
            "global": torch.cat([g.reshape(-1) for g in s.global_params]),
            "resumed": (_flat(model), _flat(twin_model)),
            "bytes": sent,
            "syncs": (s.syncs, twin.syncs),
        }
    # The end of a run: one more sync of every fragment leaves one model everywhere.
    model = _model(seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with StreamingDiLoCo(model, opt, 6, fragments=3, overlap=1, alpha=0.5) as s:
        for i in range(8):
            _step(model, opt, i, rank)
        s.finish()
    out["finished"] = _flat(model)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_ranks, 2, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compress", ["none", "int4", "onebit"])
def test_two_ranks_agree_send_a_fragment_per_sync_and_resume(
    compress: str, two_ranks: list
) -> None:
    a, b = (r[compress] for r in two_ranks)
    torch.testing.assert_close(a["global"], b["global"], rtol=0, atol=0)  # one theta
    assert a["syncs"] == b["syncs"] == (4, 4)
    for r in (a, b):
        torch.testing.assert_close(r["resumed"][0], r["resumed"][1], rtol=0, atol=0)
    # Bytes at the save: of the three sends (fragment 0, 1, 0), the last is still in
    # flight and is counted when it is applied (the same step on every run), W = 2.
    f0, f1 = _fragment_sizes()
    assert min(f0, f1) > 0 and max(f0, f1) < 0.7 * (f0 + f1)  # a sync's peak: a fragment
    ops = a["bytes"]
    if compress == "none":
        assert ops["streaming.allreduce"]["calls"] == 2
        assert ops["streaming.allreduce"]["wire_bytes"] == 4 * (f0 + f1)
    else:
        expected = sum(quantized_wire_bytes(n, 2, compress) for n in (f0, f1))
        sent = sum(ops[f"streaming.{compress}.phase{k}"]["wire_bytes"] for k in (1, 2))
        assert sent == expected


@pytest.mark.timeout(120)
def test_finish_ends_on_one_model(two_ranks: list) -> None:
    torch.testing.assert_close(two_ranks[0]["finished"], two_ranks[1]["finished"], rtol=0, atol=0)
