"""ResumableDDP: a rehearsal sends nothing, changes nothing, and leaves DDP in the bucket
layout of a DDP that has trained one step, so the next averaged gradients are the
uninterrupted run's bit for bit, at 3 ranks, where the layout changes the rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm.accounting import COUNTER
from thinwire.comm.allreduce import allreduce_hook
from thinwire.comm.launch import spawn
from thinwire.comm.resumable_ddp import ResumableDDP

WORLD = 3


def _model() -> nn.Module:
    # Several layers, so the gradient-ready order (last layer first) differs from the
    # model order DDP's first iteration uses; ~3K elements, so a ring allreduce's
    # segments split the bucket at many places.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Linear(48, 8))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


class _Recorder:
    """Hook state: the parameter order of each reduced bucket, per call."""

    def __init__(self, model: nn.Module) -> None:
        self.index = {p.data_ptr(): i for i, p in enumerate(model.parameters())}
        self.calls: list[list[int]] = []


def _recording_hook(
    state: _Recorder, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.calls.append([state.index[p.data_ptr()] for p in bucket.parameters()])
    return allreduce_hook(None, bucket)


def _step(ddp: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """One backward pass; the averaged gradients, then cleared."""
    ddp(_batch(rank, step)).square().sum().backward()
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    ddp.module.zero_grad(set_to_none=True)
    return grads


def _ddp(model: nn.Module) -> tuple[ResumableDDP, _Recorder]:
    ddp = ResumableDDP(model)
    state = _Recorder(model)
    ddp.register_comm_hook(state, _recording_hook)
    return ddp, state


def _run(rank: int, world: int) -> dict[str, Any]:
    # The uninterrupted run: steps 0 and 1 (DDP rebuilds its buckets in between).
    straight, seen = _ddp(_model())
    _step(straight, rank, 0)
    step1 = _step(straight, rank, 1)
    # A resumed run at step 1, with the rehearsal: same weights (no optimizer here).
    resumed, heard = _ddp(_model())
    COUNTER.reset()
    rng = torch.get_rng_state()
    resumed.rehearse(lambda: resumed(_batch(rank, 1)[:1]).sum().backward())
    quiet = {
        "calls": len(heard.calls),
        "ops": COUNTER.snapshot(),
        "rng": torch.equal(rng, torch.get_rng_state()),
        "grads": [p.grad for p in resumed.module.parameters()] == [None] * 6,
    }
    after = _step(resumed, rank, 1)
    # A resumed run without the rehearsal: DDP's initial layout.
    fresh, _ = _ddp(_model())
    unrehearsed = _step(fresh, rank, 1)
    return {
        "quiet": quiet,
        "layouts": (seen.calls[-1], heard.calls[-1]),
        "rehearsed_equal": all(torch.equal(a, b) for a, b in zip(step1, after, strict=True)),
        "fresh_equal": all(torch.equal(a, b) for a, b in zip(step1, unrehearsed, strict=True)),
    }


@pytest.mark.timeout(120)
def test_rehearsal_reduces_like_the_uninterrupted_run() -> None:
    for r in spawn(_run, WORLD, timeout_s=100):
        assert r["quiet"] == {"calls": 0, "ops": {}, "rng": True, "grads": True}
        straight, resumed = r["layouts"]
        assert straight == resumed and straight != sorted(straight)  # the rebuilt order
        assert r["rehearsed_equal"]
        # the control: without the rehearsal the same sums round differently
        assert not r["fresh_equal"]


def test_rehearsal_needs_a_hook() -> None:
    # No process group is needed to reach the check.
    ddp = ResumableDDP.__new__(ResumableDDP)
    with pytest.raises(RuntimeError, match="comm hook"):
        ddp.rehearse(lambda: None)
