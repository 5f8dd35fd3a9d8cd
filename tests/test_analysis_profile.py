"""Profiling a real model on one worker, and bucketing that matches a real DDP."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire.analysis import (
    ddp_buckets,
    horovod_buckets,
    observe_ddp_buckets,
    observed_buckets,
    profile_gpt,
    profile_model,
)
from thinwire.errors import ConfigError


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


@pytest.mark.timeout(60)
def test_profile_small_model_sizes_order_and_frozen() -> None:
    torch.manual_seed(0)
    model = _Mlp()
    model.a.bias.requires_grad_(False)
    prof = profile_model(model, _batch(), _mse, warmup=1, steps=3)
    by_name = {p.name: p for p in prof.params}
    # Frozen (requires_grad False) and unused parameters are reported, never ready.
    assert {p.name for p in prof.frozen} == {"a.bias", "unused.weight", "unused.bias"}
    assert by_name["b.weight"].nbytes == 64 * 64 * 4
    # Ready times increase in backward order: the last layer's gradient comes first.
    assert by_name["c.weight"].ready_s < by_name["b.weight"].ready_s < by_name["a.weight"].ready_s
    assert all(0 <= p.ready_s <= prof.backward_s * 1.5 for p in prof.ready)
    assert prof.iteration_s >= prof.forward_s + prof.backward_s
    trainable_bytes = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if n not in {"a.bias"} and not n.startswith("unused")
    )
    assert prof.grad_bytes == trainable_bytes
    for buckets in (
        ddp_buckets(prof),
        ddp_buckets(prof, bucket_cap_mb=0.01),
        horovod_buckets(prof, cycle_ms=0.001),
    ):
        assert sum(b.nbytes for b in buckets) == prof.grad_bytes
        ready = [b.ready_s for b in buckets]
        assert ready == sorted(ready)


def test_profile_rejects_bad_loss_and_empty_model() -> None:
    with pytest.raises(ConfigError, match="scalar"):
        profile_model(_Mlp(), _batch(), lambda m, b: m(b[0]), warmup=0, steps=1)
    with pytest.raises(ConfigError, match="no parameters"):
        profile_model(nn.ReLU(), _batch(), _mse, steps=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap_mb", [None, 0.25])
def test_simulated_ddp_buckets_match_a_real_ddp(cap_mb: float | None) -> None:
    prof = profile_gpt("tiny", 4, warmup=1, steps=3, observe_ddp=True, bucket_cap_mb=cap_mb)
    assert prof.observed_buckets
    real = [frozenset(b.params) for b in observed_buckets(prof)]
    model = [frozenset(b.params) for b in ddp_buckets(prof, bucket_cap_mb=cap_mb)]
    assert model == real
    assert sum(b.nbytes for b in observed_buckets(prof)) == prof.grad_bytes
    assert len(real) > 1  # both caps split the tiny GPT (1 MiB first bucket, or 0.25 MiB)


@pytest.mark.timeout(60)
def test_observe_ddp_needs_its_own_group() -> None:
    with pytest.raises(ConfigError, match="iterations"):
        observe_ddp_buckets(_Mlp(), _batch(), _mse, iterations=1)
