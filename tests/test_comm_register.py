"""register_comm_hook: plain DDP with its bytes counted, the 1-bit hook with the
optimizer's pairing checked: one warning line on rank 0 for an adaptive optimizer, a
refusal on every rank for thinwire's own optimizers (they communicate themselves)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from conftest import WarningLines
from thinwire.comm import COUNTER, spawn
from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.register import adaptive_optimizer, onebit_counterpart, register_comm_hook
from thinwire.optim import Lamb, OneBitAdam, OneBitLamb


class MyLAMB(torch.optim.SGD):
    """A third-party LAMB-like optimizer, as far as its name tells."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _grads(net: nn.Module, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
    nn.functional.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def _body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = nn.parallel.DistributedDataParallel(_model())
    counted = nn.parallel.DistributedDataParallel(_model())
    register_comm_hook(counted, "fp32")
    reference = _grads(plain, rank)
    COUNTER.reset()
    out["same"] = torch.equal(_grads(counted, rank), reference)
    out["bytes"] = COUNTER.snapshot()["ddp.allreduce"]["wire_bytes"]
    out["numel"] = sum(p.numel() for p in counted.parameters())
    records = WarningLines()
    logging.getLogger("thinwire").addHandler(records)
    for opt_cls in (torch.optim.SGD, torch.optim.AdamW, MyLAMB):
        net = nn.parallel.DistributedDataParallel(_model())
        opt = opt_cls(net.parameters(), lr=0.1)
        state = register_comm_hook(net, "onebit", optimizer=opt, warmup_steps=0, block=64)
        _grads(net, rank)
        state.close()
    logging.getLogger("thinwire").removeHandler(records)
    # Only the pairing advice: other thinwire warnings (e.g. no native packing) may come.
    out["warnings"] = [line for line in records.lines if "comm hook" in line]
    out["onebit_bytes"] = COUNTER.snapshot()["onebit.phase1"]["calls"]
    return out


@pytest.mark.timeout(120)
def test_fp32_counts_plain_ddp_and_onebit_checks_the_optimizer() -> None:
    reports = spawn(_body, 2, timeout_s=100)
    for out in reports:
        assert out["same"]  # DDP's own average, bit for bit
        assert out["bytes"] == ring_allreduce_bytes(4 * out["numel"], 2)
        assert out["onebit_bytes"] == 3  # one bucket per model, all compressed
    # SGD: nothing to say; AdamW and the LAMB-like one: a line each, once (rank 0).
    first, second = (rep["warnings"] for rep in reports)
    assert second == []
    adamw, lamb = first
    assert adamw.startswith("thinwire: AdamW behind the 1-bit comm hook: its second moment")
    assert "use thinwire.optim.OneBitAdam instead, which freezes the second moment" in adamw
    assert adamw.endswith("(register it with opt.register_ddp(ddp_model), no comm hook)")
    assert lamb.startswith("thinwire: MyLAMB behind the 1-bit comm hook")
    assert "use thinwire.optim.OneBitLamb instead" in lamb


def test_adaptive_optimizers_are_recognised() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    assert adaptive_optimizer(torch.optim.Adam(p)) and adaptive_optimizer(torch.optim.RMSprop(p))
    assert not adaptive_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9))

    assert adaptive_optimizer(MyLAMB(p, lr=0.1))
    assert onebit_counterpart(MyLAMB(p, lr=0.1)) == "thinwire.optim.OneBitLamb"
    assert onebit_counterpart(torch.optim.AdamW(p)) == "thinwire.optim.OneBitAdam"


def _refusal_body(rank: int, world: int) -> dict[str, Any]:
    refused: list[tuple[str, str]] = []
    for method in ("onebit", "fp16"):
        for make in (
            lambda ps: Lamb(ps, lr=1e-2),
            lambda ps: OneBitAdam(ps, lr=1e-3, freeze_step=5),
            lambda ps: OneBitLamb(ps, lr=1e-2, freeze_step=5),
        ):
            net = nn.parallel.DistributedDataParallel(_model())
            try:
                register_comm_hook(net, method, optimizer=make(net.parameters()))
            except TypeError as exc:
                refused.append((method, str(exc)))
    # Every rank raised before sending anything: the next collectives line up, and the
    # fix the message names works.
    net = nn.parallel.DistributedDataParallel(_model())
    opt = OneBitLamb(net.parameters(), lr=1e-2, freeze_step=5)
    opt.register_ddp(net)
    return {"refused": refused, "grads": _grads(net, rank)}


@pytest.mark.timeout(120)
def test_thinwire_optimizers_are_refused_on_every_rank_with_the_fix() -> None:
    reports = spawn(_refusal_body, 2, timeout_s=100)
    names = ["Lamb", "OneBitAdam", "OneBitLamb"]
    for rep in reports:
        assert [m for m, _ in rep["refused"]] == ["onebit"] * 3 + ["fp16"] * 3
        for name, (_, line) in zip(names * 2, rep["refused"], strict=True):
            assert line == (
                f"thinwire: {name} does its own communication and takes no comm hook: "
                "call opt.register_ddp(ddp_model) instead of register_comm_hook"
            )
    assert torch.equal(reports[0]["grads"], reports[1]["grads"])


def test_bad_methods_and_models_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown comm hook method 'int8'"):
        register_comm_hook(nn.Linear(2, 2), "int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        register_comm_hook(nn.Linear(2, 2), "fp32")  # type: ignore[arg-type]
