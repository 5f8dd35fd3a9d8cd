"""The step recorder: a user's DDP loop recorded in one line, on 2 gloo ranks, and the
same loop's results unchanged by it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm import spawn
from thinwire.comm.step_record import RECORD_FORMAT, StepRecorder, record_run


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _loop(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation pass between steps is not a step
            net(x)


def _body(rank: int, world: int, path: str) -> dict[str, Any]:
    plain = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    _loop(plain, opt, rank, 12)
    recorded = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    opt2 = torch.optim.AdamW(recorded.parameters(), lr=0.01)
    rec = record_run(recorded, opt2, path, dense_steps=4, every=3)
    _loop(recorded, opt2, rank, 12)
    rec.close()
    same = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(plain.parameters(), recorded.parameters(), strict=True)
    )
    return {"same": same, "steps": rec.step, "kept": len(rec.steps)}


@pytest.mark.timeout(120)
def test_a_ddp_loop_is_recorded_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "record.jsonl"
    results = spawn(_body, 2, (str(path),), timeout_s=100)
    assert all(r["same"] for r in results)  # the recorder changes nothing trained
    assert results[0]["steps"] == 12
    # the file is rank 0's; no rank keeps the steps in memory besides
    assert [r["kept"] for r in results] == [0, 0]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head, steps = lines[0], lines[1:]
    assert head["format"] == RECORD_FORMAT and head["world_size"] == 2
    assert head["backend"] == "gloo" and head["optimizer"] == "AdamW"
    assert [p["name"] for p in head["params"]][:2] == ["0.weight", "0.bias"]
    assert head["params"][2]["nbytes"] == 64 * 64 * 4
    # steps 1-4 dense, then one in 3: 5, 8, 11 (steps counted from 1)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 8, 11]
    for s in steps:
        assert s["step_s"] >= s["forward_s"] + s["backward_s"] > 0
        assert all(r is not None and 0 <= r <= s["backward_s"] for r in s["ready_s"])
        # the last layer's gradients are ready first (backward runs in reverse)
        assert s["ready_s"][-1] <= s["ready_s"][0]
        assert s["wire_bytes"] > 0
    # From the second step on DDP uses its rebuilt buckets: several, all parameters once.
    buckets = steps[-1]["buckets"]
    assert len(buckets) >= 2
    assert sorted(i for b in buckets for i in b["params"]) == list(range(6))
    assert sum(b["bytes"] for b in buckets) == sum(p["nbytes"] for p in head["params"])
    for b in buckets:
        assert 0 <= b["launch_s"] <= b["done_s"] and b["hook_s"] >= 0


@pytest.mark.timeout(30)
def test_a_plain_model_records_in_memory_and_a_bad_cadence_is_refused() -> None:
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with StepRecorder(net, opt) as rec:
        _loop(net, opt, 0, 3)
    assert [s["step"] for s in rec.steps] == [1, 2, 3]
    assert all(s["buckets"] == [] for s in rec.steps)
    _loop(net, opt, 0, 1)  # closed: nothing more is recorded
    assert len(rec.steps) == 3
    with pytest.raises(ValueError, match="every >= 1"):
        StepRecorder(net, opt, every=0)
    with pytest.raises(ValueError, match="needs a DistributedDataParallel"):
        record_run(net, opt, hook=(None, lambda s, b: b))


def test_a_resumed_run_drops_the_steps_recorded_after_its_checkpoint(tmp_path: Path) -> None:
    """Stopped at step 6 with its last checkpoint at 4: the resumed run records 5 and 6
    again, and the file holds each step once (a line cut by the stop is dropped)."""
    path = tmp_path / "record.jsonl"
    net = _model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    rec = StepRecorder(net, opt, path, write=True)
    _loop(net, opt, 0, 6)
    rec.close()
    path.write_text(path.read_text() + '{"step": 7, "step_s')  # the stop, mid-line
    again = StepRecorder(net, opt, path, write=True, start_step=4)
    _loop(net, opt, 0, 2)
    again.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["format"] == RECORD_FORMAT  # the header, once
    assert [r["step"] for r in lines[1:]] == [1, 2, 3, 4, 5, 6]
