"""register_comm_hook: plain DDP with its bytes counted, the 1-bit hook with the
optimizer's pairing checked."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm import COUNTER, spawn
from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.register import adaptive_optimizer, register_comm_hook


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


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
    records = _Records()
    logging.getLogger("thinwire").addHandler(records)
    for opt_cls in (torch.optim.SGD, torch.optim.AdamW):
        net = nn.parallel.DistributedDataParallel(_model())
        opt = opt_cls(net.parameters(), lr=0.1)
        state = register_comm_hook(net, "onebit", optimizer=opt, warmup_steps=0, block=64)
        _grads(net, rank)
        state.close()
    logging.getLogger("thinwire").removeHandler(records)
    out["warnings"] = records.lines
    out["onebit_bytes"] = COUNTER.snapshot()["onebit.phase1"]["calls"]
    return out


@pytest.mark.timeout(120)
def test_fp32_counts_plain_ddp_and_onebit_checks_the_optimizer() -> None:
    for out in spawn(_body, 2, timeout_s=100):
        assert out["same"]  # DDP's own average, bit for bit
        assert out["bytes"] == ring_allreduce_bytes(4 * out["numel"], 2)
        assert out["onebit_bytes"] == 2  # one bucket per model, both compressed
        (line,) = out["warnings"]  # SGD: nothing to say; AdamW: one line
        assert line.startswith("thinwire: AdamW behind the 1-bit comm hook: its second moment")
        assert line.endswith(
            "use thinwire.optim.OneBitAdam, which freezes the second moment "
            "and compresses the momentum"
        )


def test_adaptive_optimizers_are_recognised() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    assert adaptive_optimizer(torch.optim.Adam(p)) and adaptive_optimizer(torch.optim.RMSprop(p))
    assert not adaptive_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9))

    class MyLAMB(torch.optim.SGD):
        pass

    assert adaptive_optimizer(MyLAMB(p, lr=0.1))


def test_bad_methods_and_models_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown comm hook method 'int8'"):
        register_comm_hook(nn.Linear(2, 2), "int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        register_comm_hook(nn.Linear(2, 2), "fp32")  # type: ignore[arg-type]
