"""Compressed pushes and pulls of asynchronous Local-SGD: formats, error feedback, exact
views, and a real run with 1-bit pushes and compressed pulls."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_async_config
from thinwire.comm.launch import spawn
from thinwire.compress import OneBitCompressor, packed_numel
from thinwire.localsgd.algorithm.compression import PullDecoder, PullEncoder, PushEncoder, decode
from thinwire.train.async_task import run
from thinwire.train.config import TrainConfig


def test_onebit_push_is_signs_and_a_scale_from_thinwire_compressor() -> None:
    torch.manual_seed(0)
    x = torch.randn(1001)
    payload = PushEncoder("onebit").encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == packed_numel(1001) + 4
    ref = OneBitCompressor()
    torch.testing.assert_close(decode(payload, 1001), ref.decompress(ref.compress(x)))
    got = decode(payload, 1001)
    assert torch.equal(got.sign(), torch.where(x >= 0, 1.0, -1.0))
    assert got.abs().max() == got.abs().min() == pytest.approx(x.norm() / math.sqrt(1001))
    for codec, dtype in (("none", torch.float32), ("bf16", torch.bfloat16)):
        p = PushEncoder(codec).encode(x)
        assert p.dtype == dtype and torch.equal(decode(p, 1001), x.to(dtype).float())


def test_error_feedback_keeps_the_sum_of_pushes_on_track() -> None:
    torch.manual_seed(1)
    push = PushEncoder("onebit")
    sent = torch.zeros(500)
    total = torch.zeros(500)
    for _ in range(50):
        g = torch.randn(500) * 0.1 + 0.02  # a small consistent drift under noise
        total += g
        sent += decode(push.encode(g), 500)
    # What has not arrived yet is exactly the residual the worker still holds: bounded.
    assert push.feedback is not None and push.feedback.residual is not None
    torch.testing.assert_close(total - sent, push.feedback.residual, rtol=0, atol=1e-4)
    assert (total - sent).norm() < 0.2 * total.norm()


@pytest.mark.parametrize("codec", ["fp16", "bf16", "onebit"])
def test_compressed_pulls_keep_the_workers_view_exact(codec: str) -> None:
    torch.manual_seed(2)
    server, worker = PullEncoder(codec), PullDecoder()
    theta = torch.randn(300)
    delta, payload = server.encode(7, theta)
    assert not delta and payload.dtype == torch.float32  # the first pull is whole
    view = worker.whole(payload)
    errors = []
    for _ in range(20):
        theta = theta - 0.01 * torch.randn(300)  # the server moves on
        delta, payload = server.encode(7, theta)
        assert delta and payload.dtype != torch.float32
        view = worker.delta(payload)
        assert torch.equal(view, server.views[7])  # bit-identical copies on both sides
        errors.append(float((theta - view).norm() / theta.norm()))
    assert max(errors) < (0.5 if codec == "onebit" else 1e-2)  # the lag stays bounded
    server.forget(7)
    assert not server.encode(7, theta)[0]  # a new incarnation gets theta whole


def _rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    return run(cfg)


@pytest.mark.timeout(150)
def test_real_run_with_onebit_pushes_and_compressed_pulls(tmp_path: Path) -> None:
    cfg = tiny_async_config(
        tmp_path, local_steps=3, checkpoint_interval=0, compress="onebit", compress_pull="bf16"
    )
    summary = spawn(_rank, 3, (cfg,), timeout_s=120)[0]
    assert summary["inner_steps"] == 24 and summary["updates_applied"] == 8
    numel = summary["parameters"]
    assert summary["push_bytes"] == 8 * (packed_numel(numel) + 4)  # 1 bit per parameter
    pull = summary["comm_by_op"]["localsgd.pull"]
    # One whole fp32 pull per worker that ran (a worker slow to start may find the tiny
    # budget spent by the other), then bf16 deltas.
    ran = len({u["worker"] for u in summary["updates_by_incarnation"] if u["updates"]})
    whole, halves = ran * 4 * numel, (pull["calls"] - ran) * 2 * numel
    assert pull["payload_bytes"] == whole + halves, (pull, summary["updates_applied"])
    assert pull["calls"] == summary["updates_applied"]  # one pull per round
    assert summary["final_val_loss"] < 5.0 and math.isfinite(summary["final_val_loss"])
