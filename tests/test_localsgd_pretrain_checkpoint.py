"""A pretraining of hours survives a stop: stopped at any step and started again with
its checkpoint, it returns the very weights of a pretraining never stopped; a sweep and
``thinwire simulate`` keep it beside their runs and say where it resumed."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.cli import simulate as cli_simulate
from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimCheckpoint, SimClock, Task, run_sweep
from thinwire.localsgd.algorithm.pretrain import Start, pretrain


class _Killed(Exception):
    """The process 'died' here."""


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # Draws from torch's generator, as dropout would, and from Python's and NumPy's, as
    # a user's data pipeline might: the save must carry all three.
    noise = 0.1 * float(torch.rand(())) + 0.05 * random.random() + 0.05 * np.random.rand()
    return F.mse_loss(model(batch[0]), batch[1]) * (1.0 + noise)


def _task(width: int = 8) -> Task:
    return Task(
        model=lambda: nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)),
        # AdamW: its moments and step counts are state a resume must carry too.
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
        shards=lambda n: [lambda step, i=i: _batch(1000 * i + step) for i in range(n)],
        loss=_loss,
        evaluate=lambda model: float(F.mse_loss(model(_batch(7)[0]), _batch(7)[1])),
    )


def _pretrain(
    ckpt: SimCheckpoint | None, kill_at: int | None = None, steps: int = 12, width: int = 8
) -> dict[str, torch.Tensor]:
    """A pretraining from the same generator state; ``kill_at``: stop after that step
    (after its save), as a process killed there would."""
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    seen: list[int] = []

    def progress(step: int, loss: float) -> None:
        seen.append(step)
        if step == kill_at:
            raise _Killed

    weights = pretrain(
        _task(width), steps, 2, warmup_steps=3, grad_clip=1.0, progress=progress, checkpoint=ckpt
    )
    first = ckpt.resumed_at if ckpt is not None and ckpt.resumed_at is not None else 0
    assert seen == list(range(first + 1, steps + 1))  # every step after the save, once
    return weights


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kill_at", [1, 5, 11])
def test_a_pretraining_stopped_and_started_again_returns_the_same_weights(
    tmp_path: Path, kill_at: int
) -> None:
    reference = _pretrain(None)
    ckpt = SimCheckpoint(tmp_path / "pre.partial.pt", every_s=0, tag="seed 0")
    with pytest.raises(_Killed):
        _pretrain(ckpt, kill_at)
    assert ckpt.resumed_at is None and ckpt.path.exists()
    again = SimCheckpoint(tmp_path / "pre.partial.pt", every_s=0, tag="seed 0")
    weights = _pretrain(again)
    assert again.resumed_at == kill_at
    assert _equal(weights, reference)
    assert ckpt.path.exists()  # the caller discards it once the weights are kept
    # The last step is never saved: the weights are the caller's to keep.
    assert torch.load(ckpt.path, weights_only=True)["state"]["step"] < 12


@pytest.mark.timeout(60)
def test_a_save_of_other_settings_or_unreadable_is_not_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pre.partial.pt"
    with pytest.raises(_Killed):
        _pretrain(SimCheckpoint(path, 0, "seed 0"), kill_at=6)
    for ckpt, steps in ((SimCheckpoint(path, 0, "seed 1"), 12), (SimCheckpoint(path, 0), 12)):
        with pytest.raises(_Killed):
            _pretrain(ckpt, kill_at=6, steps=steps)
        assert ckpt.resumed_at is None  # another tag: started over (and replaced the file)
    other = SimCheckpoint(path, 0, "")
    assert _equal(_pretrain(other, steps=20), _pretrain(None, steps=20))
    assert other.resumed_at is None  # same tag, another length: started over
    path.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        assert _equal(_pretrain(SimCheckpoint(path, 0, "x")), _pretrain(None))
    assert "starts from its start" in caplog.text
    # Same settings and tag, another model: refused in one line, the file left alone.
    path.unlink()
    with pytest.raises(_Killed):
        _pretrain(SimCheckpoint(path, 0, "x"), kill_at=4)
    size = path.stat().st_size
    with pytest.raises(ConfigError, match=r"does not fit this run.*delete it"):
        _pretrain(SimCheckpoint(path, 0, "x"), width=16)
    assert path.stat().st_size == size


@pytest.mark.timeout(120)
def test_a_sweep_stopped_mid_pretraining_goes_on_from_its_save(tmp_path: Path) -> None:
    base = AsyncConfig(steps=6, local_steps=3, warmup_steps=1, pretrain_steps=10)
    clock = SimClock(seconds_per_step=(1.0, 2.0), eval_points=2)
    grid = {"dn": {"outer_lr": (0.3,)}}
    seen: list[list[int]] = []  # each sweep's pretraining steps

    def sweep(out: Path, kill_at: int | None) -> list[dict[str, Any]]:
        seen.append([])

        def on_pretrain(seed: int, start: Start, ckpt: SimCheckpoint | None) -> Any:
            assert ckpt is not None and ckpt.path.name.startswith("pretrained-seed0-")

            def step(done: int, loss: float) -> None:
                seen[-1].append(done)
                if done == kill_at:
                    raise _Killed

            return step

        # No seeding here: the sweep seeds each run and pretraining from its seed.
        return run_sweep(
            lambda seed: _task(),
            base,
            clock,
            grid,
            (0,),
            out,
            on_pretrain=on_pretrain,
            checkpoint_every=0,
        )

    reference = sweep(tmp_path / "whole", None)
    out = tmp_path / "stopped"
    with pytest.raises(_Killed):
        sweep(out, 7)
    (partial,) = (out / "runs").glob("pretrained-seed0-*.partial.pt")
    runs = sweep(out, None)
    assert seen[1] == list(range(1, 8)) and seen[2] == list(range(8, 11))  # on from the save
    assert runs[0]["curve"] == reference[0]["curve"]
    assert not partial.exists()  # the weights are kept whole: the save is done with
    assert (out / "runs" / partial.name.replace(".partial.pt", ".pt")).exists()
    # Stopped between keeping the weights and removing the save: the rerun removes it.
    partial.write_bytes(b"left over")
    for kept in (out / "runs").glob("dn__*.json"):
        kept.unlink()
    assert sweep(out, None)[0]["curve"] == reference[0]["curve"]
    assert not partial.exists() and seen[-1] == []  # read back, not pretrained again


@pytest.mark.timeout(240)
def test_the_cli_says_where_a_stopped_pretraining_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["simulate", "--methods", "dn", "--seconds-per-step", "1,3", "--model", "tiny"]
    args += ["--local-steps", "2", "--steps", "4", "--batch-size", "2", "--eval-points", "2"]
    args += ["--pretrain-steps", "10", "--checkpoint-every", "1e-9"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    pretraining = cli_simulate._pretraining

    def stopped_at_step_6(*a: Any) -> Any:
        step = pretraining(*a)

        def progress(done: int, loss: float) -> None:
            step(done, loss)
            if done == 6:
                raise KeyboardInterrupt

        return progress

    monkeypatch.setattr(cli_simulate, "_pretraining", stopped_at_step_6)
    stopped = [*args, "--out", str(tmp_path / "stopped")]
    # A newer save of other settings (another digest) beside it is not the one named.
    other = tmp_path / "stopped" / "runs" / "pretrained-seed0-0123456789abcdef.partial.pt"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"another pretraining's")
    os.utime(other, (time.time() + 3600, time.time() + 3600))  # and the newest file there
    assert main(stopped) == 130
    err = capsys.readouterr().err
    named = re.search(r"the pretraining of seed 0 in progress goes on from its save in (\S+):", err)
    assert named is not None and named.group(1) != str(other) and Path(named.group(1)).exists()
    monkeypatch.undo()
    assert main(stopped) == 0
    out = capsys.readouterr().out
    assert f"pretraining seed 0: resumed from {named.group(1)} at 6 of 10 steps" in out
    assert re.search(r"pretraining seed 0: 10 of 10 steps \(100%\) in \d+ min", out)
    whole, again = (
        json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "stopped")
    )
    assert again["runs"][0]["curve"] == whole["runs"][0]["curve"]
    assert list((tmp_path / "stopped" / "runs").glob("*.partial.pt")) == [other]
