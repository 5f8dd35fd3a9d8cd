"""Resume continues exactly the run that was saved, or refuses in one line.

PowerSGD's state is part of the checkpoint; files of another step or run are refused; a
finished run is left alone; a full disk keeps the previous checkpoint; a diverged run
stops before saving, with exit status 3.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS, tiny_config
from thinwire.cli.main import main
from thinwire.comm.launch import spawn
from thinwire.errors import DivergedError
from thinwire.train import checkpoint as ckpt
from thinwire.train.config import TrainConfig
from thinwire.train.guard import DivergenceGuard
from thinwire.train.metrics import read_metrics
from thinwire.train.trainer import train

SMALL = [
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--eval-sequences",
    "4",
    "--no-progress",
    "--workers",
    "1",
    "--log-interval",
    "2",
    "--checkpoint-interval",
    "2",
]


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _straight_then_split(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict]:
    """Each run in turn on the same ranks; every train() builds its DDP and PowerSGD
    state anew, as a new process would (one spawn saves two start-ups)."""
    return [train(cfg) for cfg in cfgs]


@pytest.mark.timeout(300)
def test_powersgd_resumes_bit_identically(tmp_path: Path) -> None:
    kw = {"algo": "adamw-powersgd", "extra": {"powersgd_start": 2}}
    straight = tiny_config(tmp_path / "straight", **kw)
    half = tiny_config(tmp_path / "resumed", stop_after=6, **kw)
    rest = tiny_config(tmp_path / "resumed", resume=True, **kw)
    per_rank = spawn(_straight_then_split, 2, ([straight, half, rest],), timeout_s=250)
    for s_straight, _, s_resumed in per_rank:
        assert s_resumed["param_sha256"] == s_straight["param_sha256"]
        assert s_resumed["comm_bytes"] == s_straight["comm_bytes"]
    per_step = [
        [
            (m["step"], m["comm_bytes_per_step"])
            for m in read_metrics(Path(c.out_dir) / "metrics.jsonl")
            if "comm_bytes_per_step" in m
        ]
        for c in (straight, rest)
    ]
    assert per_step[0] == per_step[1]  # compressed right after the resume, as before it


@pytest.mark.timeout(120)
def test_files_of_another_step_or_run_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, other = tmp_path / "run", tmp_path / "other"
    for d in (out, other):
        assert main(["train", *SMALL, "--steps", "4", "--out", str(d)]) == 0
    capsys.readouterr()
    resume = ["train", *SMALL, "--steps", "6", "--out", str(out), "--resume"]
    latest, older = out / "checkpoints" / "step-00000004", out / "checkpoints" / "step-00000002"
    saved = _tree(latest)
    for name, source, message in [
        ("rank0.pt", older, "holds step 2, not 4"),
        ("model.pt", older, "holds step 2, not 4"),
        ("rank0.pt", other / "checkpoints" / "step-00000004", "belongs to run"),
        ("model.pt", other / "checkpoints" / "step-00000004", "belongs to run"),
    ]:
        shutil.copy(latest / name, tmp_path / "keep.pt")
        shutil.copy(source / name, latest / name)
        assert main(resume) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and name in err and message in err, err
        shutil.copy(tmp_path / "keep.pt", latest / name)
    assert _tree(latest) == saved
    assert main(resume) == 0  # the intact checkpoint still resumes


@pytest.mark.timeout(120)
def test_resuming_a_finished_run_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["train", *SMALL, "--steps", "4", "--out", str(out)]
    assert main(args) == 0
    before = _tree(out)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    captured = capsys.readouterr()
    assert "already reached step 4; nothing was changed" in captured.err
    assert "final val loss" in captured.out and "nan" not in captured.out.lower()
    assert _tree(out) == before
    # Stopped after its last checkpoint but before its summary: the summary is rebuilt
    # from the checkpoint, with a real loss and throughput, and nothing else changes.
    (out / "summary.json").unlink()
    assert main([*args, "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] < 6
    assert summary["samples_per_s"] > 0
    assert {k: v for k, v in _tree(out).items() if k != "summary.json"} == {
        k: v for k, v in before.items() if k != "summary.json"
    }


@pytest.mark.timeout(120)
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    real_save = torch.save
    calls = {"n": 0}

    def filling_save(obj: object, f: object, *a: object, **k: object) -> None:
        calls["n"] += 1
        if calls["n"] > 2:  # step 2 (rank0.pt, model.pt) fits, step 4 does not
            f.write(b"partial")  # type: ignore[attr-defined]
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", filling_save)
    err = ""
    assert main(["train", *SMALL, "--steps", "6", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err, err
    assert "step 2 is still the latest" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert ckpt.latest_step(out) == 2
    assert ckpt.load_rank_state(out, 2, 0, ckpt.read_run_id(out))["step"] == 2
    assert not list(out.rglob(".*tmp*"))  # no half-written file left behind
    assert not (out / "summary.json").exists()  # not reported as done


@pytest.mark.timeout(120)
def test_a_diverged_run_stops_with_status_3_and_keeps_its_last_good_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = [
        "train",
        *SMALL,
        "--steps",
        "20",
        "--checkpoint-interval",
        "4",
        "--lr",
        "3",
        "--warmup-steps",
        "12",
        "--out",
        str(out),
    ]
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the run diverged at step" in err, err
    assert "the last good checkpoint, step 4, is kept" in err
    assert ckpt.latest_step(out) == 4
    assert not (out / "summary.json").exists()
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert losses[-1] > 4 * 5.545  # the record that tripped the guard is kept


def test_the_guard_rules() -> None:
    guard = DivergenceGuard(5.0, last_checkpoint=10)
    guard.check_train(12, 19.9, skipped_steps=6)  # under the bound, half skipped: fine
    guard.check_val(12, 6.0)
    for args, what in [
        ((14, float("nan")), "training loss is nan"),
        ((14, float("inf")), "training loss is inf"),
        ((14, 20.5), "past 20"),
        ((20, 3.0, 11), "11 of 20 steps were skipped"),
    ]:
        with pytest.raises(DivergedError, match=what) as err:
            guard.check_train(*args)
        assert "step 10, is kept" in str(err.value)
    guard.check_train(8, 3.0, skipped_steps=7)  # too early to judge the skipped share
    with pytest.raises(DivergedError, match="validation loss is nan"):
        guard.check_val(20, float("nan"))
