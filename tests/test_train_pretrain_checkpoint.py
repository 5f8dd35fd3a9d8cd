"""The trainer's pretraining (``--pretrain-steps``) kept as it goes: a run stopped in its
pretraining, or between its pretraining and its first checkpoint, goes on with
``--resume`` and ends bit for bit where an unstopped run ends; on one rank and on two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_config
from thinwire.cli.train import _interrupt_note
from thinwire.comm.launch import spawn
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import read_metrics
from thinwire.train.trainer import train

PRETRAIN = 8


class _Killed(Exception):
    """The process 'died' here."""


def _config(out: Path, **kw: Any) -> TrainConfig:
    # Saves every 3 pretraining steps (3, 6, then 8: the end) and at the run's step 3.
    kw = {"algo": "adamw", "steps": 4, "pretrain_steps": PRETRAIN, "checkpoint_interval": 3} | kw
    return tiny_config(out, **kw)


def _stopped(cfg: TrainConfig, at: int) -> None:
    """Run ``cfg`` until it reads training-stream step ``at`` (pretraining steps come
    first), as a process killed there would stop."""
    real = TextData.batch

    def batch(self: TextData, step: int, *args: Any) -> Any:
        if step == at:
            raise _Killed
        return real(self, step, *args)

    TextData.batch = batch  # type: ignore[method-assign]
    try:
        train(cfg)
    except _Killed:
        return
    finally:
        TextData.batch = real  # type: ignore[method-assign]
    raise AssertionError(f"the run never read step {at}")


def _saves(cfg: TrainConfig) -> list[str]:
    return sorted(p.name for p in (Path(cfg.out_dir) / "checkpoints").glob("pretrain-*.pt"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("stop_at", "saved"),
    [(5, "pretrain-00000003.pt"), (PRETRAIN + 1, "pretrain-00000008.pt")],
    ids=["in-the-pretraining", "before-the-first-checkpoint"],
)
def test_a_run_stopped_in_its_pretraining_goes_on_with_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stop_at: int, saved: str
) -> None:
    whole = train(_config(tmp_path / "whole"))
    cfg = _config(tmp_path / "stopped")
    _stopped(cfg, stop_at)
    assert _saves(cfg) == [saved]  # the one before is gone once the newer is in place
    note = _interrupt_note(Path(cfg.out_dir))
    assert f"the pretraining's save at step {int(saved[9:17])} is intact" in note
    capsys.readouterr()
    again = train(_config(tmp_path / "stopped", resume=True))
    err = capsys.readouterr().err
    step = int(saved[9:17])
    assert f"the pretraining goes on from {Path(cfg.out_dir) / 'checkpoints' / saved}" in err
    assert f"at step {step} of {PRETRAIN}" in err
    assert again["param_sha256"] == whole["param_sha256"]
    assert again["final_val_loss"] == whole["final_val_loss"]
    assert _saves(cfg) == []  # the run's own checkpoint superseded it
    # Its records read as one unstopped run's: what it wrote before the stop is dropped.
    assert _losses(cfg) == _losses(_config(tmp_path / "whole"))
    assert _recorded(cfg) == _recorded(_config(tmp_path / "whole")) == [1, 2, 3, 4]


def _recorded(cfg: TrainConfig) -> list[int]:
    lines = (Path(cfg.out_dir) / "record.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines[1:]]


def _losses(cfg: TrainConfig) -> list[tuple[int, float]]:
    records = read_metrics(Path(cfg.out_dir) / "metrics.jsonl")
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


@pytest.mark.timeout(120)
def test_a_pretraining_saved_at_its_end_only_and_a_failed_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = train(_config(tmp_path / "whole", checkpoint_interval=0))
    cfg = _config(tmp_path / "end", checkpoint_interval=0)  # the end alone, as the run's own
    _stopped(cfg, 7)
    assert _saves(cfg) == []
    _stopped(cfg := _config(tmp_path / "end2", checkpoint_interval=0), PRETRAIN + 1)
    assert _saves(cfg) == ["pretrain-00000008.pt"]
    again = train(_config(tmp_path / "end2", checkpoint_interval=0, resume=True))
    assert again["param_sha256"] == whole["param_sha256"]
    # A save that cannot be written (a full disk) is one line, and the run goes on.
    from thinwire.train import pretrain_checkpoint

    def full(obj: object, path: Path) -> None:
        raise OSError(28, "No space left on device")

    reference = train(_config(tmp_path / "whole3"))  # saving its pretraining as it goes
    monkeypatch.setattr(pretrain_checkpoint, "atomic_save", full)
    capsys.readouterr()
    assert train(_config(tmp_path / "full"))["param_sha256"] == reference["param_sha256"]
    err = capsys.readouterr().err
    assert "could not save the pretraining to" in err and "No space left on device" in err
    assert "there is no save yet" in err


@pytest.mark.timeout(180)
def test_a_save_that_cannot_be_used_is_one_line_and_the_pretraining_starts_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = train(_config(tmp_path / "whole"))
    cfg = _config(tmp_path / "stopped")
    _stopped(cfg, 7)
    path = Path(cfg.out_dir) / "checkpoints" / "pretrain-00000006.pt"
    blob = torch.load(path, weights_only=True)
    torch.save({**blob, "run_id": "another run"}, path)
    capsys.readouterr()
    again = train(_config(tmp_path / "stopped", resume=True))
    err = capsys.readouterr().err
    assert f"pretraining save {path} belongs to another run; the pretraining starts over" in err
    assert again["param_sha256"] == whole["param_sha256"]
    _stopped(_config(tmp_path / "torn"), 7)
    torn = Path(tmp_path / "torn" / "run" / "checkpoints" / "pretrain-00000006.pt")
    torn.write_bytes(torn.read_bytes()[:100])
    capsys.readouterr()
    assert train(_config(tmp_path / "torn", resume=True))["param_sha256"] == whole["param_sha256"]
    assert "the pretraining starts over" in capsys.readouterr().err
    # Resumed with another warmup: the save's steps were taken with the other one.
    _stopped(_config(tmp_path / "warm"), 7)
    train(_config(tmp_path / "warm", resume=True, warmup_steps=3))
    err = capsys.readouterr().err
    assert "was made with {'warmup_steps': 2" in err and "the pretraining starts over" in err


def _rank(rank: int, world: int, cfg: TrainConfig, stop_at: int | None) -> Any:
    if stop_at is None:
        return train(cfg)
    _stopped(cfg, stop_at)
    return None


@pytest.mark.timeout(300)
def test_two_ranks_go_on_from_rank_0s_save(tmp_path: Path) -> None:
    whole = spawn(_rank, 2, (_config(tmp_path / "whole"), None), timeout_s=240)
    cfg = _config(tmp_path / "stopped")
    spawn(_rank, 2, (cfg, 5), timeout_s=240)
    assert _saves(cfg) == ["pretrain-00000003.pt"]  # rank 0's: every rank holds the same
    again = spawn(_rank, 2, (_config(tmp_path / "stopped", resume=True), None), timeout_s=240)
    assert again[0]["param_sha256"] == again[1]["param_sha256"] == whole[0]["param_sha256"]
    assert again[0]["final_val_loss"] == whole[0]["final_val_loss"]


def test_compare_goes_on_from_a_run_stopped_in_its_pretraining(tmp_path: Path) -> None:
    from thinwire.train.compare import _continue_or_clear

    cfg = _config(tmp_path / "a")
    _stopped(cfg, 5)
    _continue_or_clear(cfg)
    assert cfg.resume and _saves(cfg) == ["pretrain-00000003.pt"]  # kept, to go on from
    fresh = _config(tmp_path / "b")
    (Path(fresh.out_dir) / "checkpoints").mkdir(parents=True)
    (Path(fresh.out_dir) / "run.json").write_text("{}")
    _continue_or_clear(fresh)  # nothing to go on from: cleared, started over
    assert not fresh.resume and not (Path(fresh.out_dir) / "run.json").exists()


@pytest.mark.parametrize("saved", ["localsgd_server.pt", "localsgd_pretrain.pt", None])
def test_compare_goes_on_from_an_asynchronous_run(tmp_path: Path, saved: str | None) -> None:
    """An asynchronous run that stopped with the server's checkpoint or its pretraining's
    save goes on from it; one that left neither starts over."""
    from thinwire.train.compare import _continue_or_clear

    cfg = tiny_config(tmp_path, algo="async-diloco", pretrain_steps=4)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "run.json").write_text("{}")
    if saved is not None:
        (out / saved).write_bytes(b"x")
    _continue_or_clear(cfg)
    assert cfg.resume == (saved is not None)
    assert (out / "run.json").exists() == (saved is not None)


@pytest.mark.timeout(240)
def test_an_asynchronous_run_goes_on_from_its_pretraining(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], cli_env: dict[str, str]
) -> None:
    """``thinwire train --algo async-diloco --resume`` on a run whose server stopped in
    its pretraining: on from the server's save (the library's part is
    tests/test_localsgd_async_pretrain.py); a fresh run there is refused."""
    from conftest import TINY_FLAGS
    from thinwire.cli.main import build_parser, main
    from thinwire.cli.train_config import config_from_args
    from thinwire.localsgd.runtime.pretraining import pretraining_checkpoint
    from thinwire.train.async_task import async_config, gpt_task

    args = ["train", "--algo", "async-diloco", "--workers", "3", *TINY_FLAGS, "--steps", "2"]
    args += ["--local-steps", "2", "--batch-size", "4", "--no-progress", "--sync"]
    args += ["--pretrain-steps", "4", "--checkpoint-interval", "2"]  # --sync: deterministic

    def cli(*more: str) -> subprocess.CompletedProcess:  # its ranks' lines read in full
        done = subprocess.run(
            [sys.executable, "-m", "thinwire", *args, *more],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert done.returncode == 0, done.stderr
        return done

    cli("--out", str(tmp_path / "whole"))
    out = tmp_path / "a"
    args += ["--out", str(out)]
    cfg = config_from_args(build_parser().parse_args(args))
    acfg = async_config(cfg)
    ckpt = pretraining_checkpoint(acfg)
    assert ckpt is not None

    def leave(steps: int) -> None:  # what a server stopped after ``steps`` steps leaves
        def stop(step: int, loss: float) -> None:
            if step == steps:
                raise _Killed

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the runs' ranks (OMP_NUM_THREADS=1): the same rounding
        try:
            with pytest.raises(_Killed):
                acfg.start().pretrained(gpt_task(cfg), acfg.resolved_shards(2), stop, ckpt, 2)
        finally:
            torch.set_num_threads(threads)

    leave(3)  # in step 4 of 4: saved at step 2
    assert main(args) == 2  # a fresh run does not overwrite it
    assert "already holds a run (localsgd_pretrain.pt)" in capfd.readouterr().err
    assert _interrupt_note(out) == "the pretraining's last save is intact: --resume goes on from it"
    err = cli("--resume").stderr
    assert f"the pretraining goes on from {ckpt.path} at step 2 of 4" in err
    assert (out / "localsgd_server.pt").is_file() and not ckpt.path.exists()
    summary = json.loads((out / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["start"] == "after 4 steps of ordinary training"
    assert summary["param_sha256"] == whole["param_sha256"]
    assert _interrupt_note(out).startswith("the server's last checkpoint is intact")
    # Stopped after its pretraining, before the server's first checkpoint: run.json,
    # config.json and the first records are there, and the pretraining's last save.
    for name in ("localsgd_server.pt", "localsgd_worker1.pt", "localsgd_worker2.pt"):
        (out / name).unlink(missing_ok=True)
    (out / "summary.json").unlink()
    leave(4)
    err = cli("--resume").stderr
    assert f"the pretraining was done: its weights come from {ckpt.path}" in err
    again = json.loads((out / "summary.json").read_text())
    assert again["param_sha256"] == whole["param_sha256"]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    # Other settings are refused before a pretraining is spent on them.
    (out / "localsgd_server.pt").unlink()
    leave(3)
    capfd.readouterr()
    assert main([*args, "--batch-size", "8", "--resume"]) == 2
    assert f"cannot resume the run in {out}: batch_size" in capfd.readouterr().err
    assert ckpt.path.exists()  # nothing lost
