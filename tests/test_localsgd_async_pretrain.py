"""An asynchronous run's pretraining survives a stop: the server keeps it as it goes, a
resume goes on from its last save (the workers train only the steps left), and the run
ends with the very weights of one never stopped; a fresh run does not overwrite it, and a
save of other settings is said in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.comm.launch import DistributedError, spawn
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimCheckpoint, Task, run_async
from thinwire.localsgd.algorithm.pretrain import Start
from thinwire.localsgd.runtime import pretraining
from thinwire.localsgd.runtime.pretraining import pretraining_checkpoint

_SHARDS = 2


class _Killed(Exception):
    """The server 'died' here."""


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def _task(kill_after: int | None = None) -> Task:
    """A small MLP; with ``kill_after``, its loss raises on that many calls plus one."""
    calls = [0]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if kill_after is not None and calls[0] > kill_after:
            raise _Killed(f"loss call {calls[0]}")
        return F.mse_loss(m(batch[0]), batch[1])

    return Task(
        model=model,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        shards=lambda n: [lambda step, i=i: _batch(1000 * i + step) for i in range(n)],
        loss=loss,
        evaluate=lambda m: float(F.mse_loss(m(_batch(-1)[0]), _batch(-1)[1])),
    )


def _cfg(out: Path, **kw: Any) -> AsyncConfig:
    base: dict[str, Any] = {
        "steps": 6,
        "local_steps": 3,
        "sync": True,  # deterministic, so a resumed run can be compared bit for bit
        "pretrain_steps": 8,
        "warmup_steps": 2,
        "checkpoint_dir": str(out),
        "checkpoint_interval": 3,
    }
    return AsyncConfig(**(base | kw))


def _rank(rank: int, world: int, cfg: AsyncConfig, kill_after: int | None) -> Any:
    del world
    out = run_async(_task(kill_after if rank == 0 else None), cfg)
    return {"theta": out["theta"], "start": out["start"]} if rank == 0 else None


def _saved_step(cfg: AsyncConfig) -> int:
    ckpt = pretraining_checkpoint(cfg)
    assert ckpt is not None
    return cfg.start().saved_step(ckpt, _SHARDS, _task().model())


@pytest.mark.timeout(240)
def test_a_run_stopped_in_its_pretraining_goes_on_from_its_save(tmp_path: Path) -> None:
    whole = spawn(_rank, 3, (_cfg(tmp_path / "whole"), None), timeout_s=100)[0]
    assert not (tmp_path / "whole" / "localsgd_pretrain.pt").exists()  # gone with the run's
    cfg = _cfg(tmp_path / "stopped")
    with pytest.raises(DistributedError):  # the server dies in step 7 of 8 (2 shards a step)
        spawn(_rank, 3, (cfg, 6 * _SHARDS + 1), timeout_s=100)
    assert _saved_step(cfg) == 6
    assert not (tmp_path / "stopped" / "localsgd_server.pt").exists()
    # Rank 0's loss may be called for the 2 steps left only: one started over dies.
    again = spawn(_rank, 3, (replace(cfg, resume=True), 2 * _SHARDS), timeout_s=100)[0]
    assert again["start"] == whole["start"] == "after 8 steps of ordinary training"
    assert torch.equal(again["theta"], whole["theta"])
    assert (tmp_path / "stopped" / "localsgd_server.pt").exists()
    assert not (tmp_path / "stopped" / "localsgd_pretrain.pt").exists()


def _leave_pretraining(cfg: AsyncConfig, steps: int) -> None:
    """What a server that stopped after ``steps`` pretraining steps leaves."""

    def stop(step: int, loss: float) -> None:
        if step == steps:
            raise _Killed(f"after step {step}")

    ckpt = pretraining_checkpoint(cfg)
    with pytest.raises(_Killed):
        cfg.start().pretrained(_task(), _SHARDS, stop, ckpt, save_every=cfg.checkpoint_interval)


def test_the_server_decides_where_a_run_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    ckpt = pretraining_checkpoint(cfg)
    assert ckpt is not None and ckpt.path == tmp_path / "localsgd_pretrain.pt"
    start = cfg.start()

    def decide(cfg: AsyncConfig, ckpt: SimCheckpoint, start: Start, shards: int) -> Any:
        return pretraining._decide(cfg, ckpt, start, shards, _task())

    assert decide(cfg, ckpt, start, _SHARDS) == (False, 0)  # fresh, nothing there
    _leave_pretraining(cfg, 4)  # saved at step 3
    with pytest.raises(ConfigError, match=r"already holds an asynchronous run's pretraining"):
        decide(cfg, ckpt, start, _SHARDS)  # a fresh run does not overwrite it
    resume = replace(cfg, resume=True)
    assert decide(resume, ckpt, start, _SHARDS) == (False, 3)
    err = capsys.readouterr().err
    assert f"the pretraining goes on from {ckpt.path} at step 3 of 8" in err
    assert decide(resume, ckpt, start, 4) == (False, 0)  # other shards: started over,
    assert "is not this run's pretraining" in capsys.readouterr().err  # in one line,
    assert not ckpt.path.exists()  # and not read again
    _leave_pretraining(cfg, 4)
    other = replace(resume, warmup_steps=1)  # other settings
    assert decide(other, ckpt, other.start(), _SHARDS) == (False, 0)
    _leave_pretraining(cfg, 4)
    wider = replace(_task(), model=lambda: nn.Sequential(nn.Linear(4, 9), nn.Tanh()))
    assert pretraining._decide(resume, ckpt, start, _SHARDS, wider) == (False, 0)  # other model
    ckpt.path.write_bytes(b"torn")  # a torn file: one line each, started over
    assert decide(resume, ckpt, start, _SHARDS) == (False, 0)
    assert not ckpt.path.exists()
    with pytest.raises(ConfigError, match="save_every must be an integer >= 0"):
        start.pretrained(_task(), _SHARDS, save_every=-1)
    (tmp_path / "localsgd_server.pt").write_bytes(b"")
    assert decide(resume, ckpt, start, _SHARDS) == (True, 0)  # the server's checkpoint first
    with pytest.raises(ConfigError, match=r"already holds an asynchronous run \(localsgd_se"):
        decide(cfg, ckpt, start, _SHARDS)  # a fresh run: before its pretraining, not after
    assert pretraining_checkpoint(replace(cfg, checkpoint_dir=None)) is None
    assert pretraining_checkpoint(replace(cfg, pretrain_steps=0)) is None


def test_a_finished_pretraining_is_read_not_trained_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, checkpoint_interval=0)  # saved after its last step only
    ckpt = pretraining_checkpoint(cfg)
    assert ckpt is not None
    weights = cfg.start().pretrained(_task(), _SHARDS, None, ckpt, save_every=8)
    assert _saved_step(cfg) == 8
    resume = replace(cfg, resume=True)
    assert pretraining._decide(resume, ckpt, cfg.start(), _SHARDS, _task()) == (False, 8)
    assert "the pretraining was done" in capsys.readouterr().err
    steps: list[int] = []
    again = cfg.start().pretrained(
        _task(kill_after=0), _SHARDS, lambda s, _: steps.append(s), ckpt, save_every=8
    )
    assert steps == [] and all(torch.equal(again[k], v) for k, v in weights.items())


def _agree_rank(rank: int, world: int) -> tuple[str, str]:
    del world

    def decide() -> tuple[bool, int]:
        raise OSError("disk gone")

    try:
        pretraining._agree(rank, decide)
    except Exception as exc:  # what each rank raises
        return type(exc).__name__, str(exc)
    return "", ""


@pytest.mark.timeout(60)
def test_a_failed_decision_is_raised_on_every_rank() -> None:
    """Any failure of rank 0's decision, not only a bad setting, reaches every rank: no
    worker is left waiting in the broadcast."""
    out = spawn(_agree_rank, 2, (), timeout_s=40)
    assert out[0] == ("OSError", "disk gone")
    assert out[1] == ("ConfigError", "rank 0 could not start the run (see its error)")
