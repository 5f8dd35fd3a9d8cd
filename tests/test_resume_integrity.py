"""Resume continues exactly the run that was saved, or refuses in one line.

PowerSGD's state is part of the checkpoint; files of another step or run are refused; a
finished run is left alone; a full disk keeps the previous checkpoint; a diverged run
stops before saving, with exit status 3.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    kw = {"algo": "adamw-powersgd", "powersgd_start": 2}
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


# --- damaged files of a run: one line each, nothing lost ---------------------------------
def _tamper_pt(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    blob = torch.load(path, weights_only=True)
    change(blob)
    torch.save(blob, path)


def _model(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda blob: change(blob["model"])


def _first_state(blob: dict[str, Any]) -> dict[str, Any]:
    return blob["optimizer"]["state"][0]


_DAMAGED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "model.pt",
        _model(lambda m: m.update({"tok_emb.weight": m["tok_emb.weight"].reshape(-1)})),
        "weight 'tok_emb.weight' has shape [8192], the model's is [256, 32]",
    ),
    ("model.pt", _model(lambda m: m.pop("pos_emb.weight")), "weight 'pos_emb.weight' is missing"),
    ("model.pt", _model(lambda m: m.update({"x.weight": torch.ones(1)})), "it holds 'x.weight'"),
    (
        "model.pt",
        _model(lambda m: m.update({"pos_emb.weight": "w"})),
        "weight 'pos_emb.weight' is a str, not a tensor",
    ),
    (
        "model.pt",
        _model(lambda m: m.update({"pos_emb.weight": m["pos_emb.weight"].long()})),
        "weight 'pos_emb.weight' is torch.int64, the model's is torch.float32",
    ),
    (
        "model.pt",
        _model(lambda m: m["pos_emb.weight"].view(-1)[3].fill_(float("nan"))),
        "weight 'pos_emb.weight' holds nan or inf",
    ),
    (
        "model.pt",
        lambda b: b.update({"step": "4"}),
        "holds step '4' (a str), not the whole number 4",
    ),
    ("rank0.pt", lambda b: b.update({"step": 4.0}), "holds step 4.0 (a float)"),
    ("rank0.pt", lambda b: b.pop("optimizer"), "'optimizer' is missing"),
    (
        "rank0.pt",
        lambda b: b.update({"rng": torch.zeros(10, dtype=torch.uint8)}),
        "its random-number state is unusable (Expected a CPUGeneratorImplState of size 5056",
    ),
    (
        "rank0.pt",
        lambda b: b.update({"rng": torch.zeros(5056, dtype=torch.uint8)}),
        "its random-number state is unusable (Invalid mt19937 state)",
    ),
    ("rank0.pt", lambda b: b.update({"rng": "seed"}), "its random-number state is unusable"),
    (
        "rank0.pt",
        lambda b: _first_state(b).update({"exp_avg": _first_state(b)["exp_avg"].reshape(-1)}),
        "the optimizer's 'exp_avg' of parameter 0 has shape [8192], the parameter's is [256, 32]",
    ),
    (
        "rank0.pt",
        lambda b: _first_state(b).update({"exp_avg_sq": [1.0, 2.0]}),
        "the optimizer's 'exp_avg_sq' of parameter 0 is a list",
    ),
    (
        "rank0.pt",
        lambda b: b["optimizer"]["param_groups"][0].update({"lr": "fast"}),
        "the optimizer's lr is 'fast', not a number",
    ),
    (
        "rank0.pt",
        lambda b: b["optimizer"]["param_groups"][0]["params"].pop(),
        "the optimizer holds 15 parameters, the model has 16",
    ),
    ("rank0.pt", lambda b: b.update({"optimizer": None}), "the optimizer state is not a table"),
    ("rank0.pt", lambda b: b.update({"elapsed_s": None}), "its training time is None"),
    ("rank0.pt", lambda b: b.update({"bytes": [1]}), "its byte counters are not counts"),
    ("rank0.pt", lambda b: b.update({"rank": "0"}), "does not hold rank 0's state"),
]


@pytest.mark.timeout(120)
def test_damaged_checkpoints_are_one_line_and_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files that are still plain data but not what thinwire wrote (a tensor of another
    shape, a missing entry, an unusable random-number state, a bad optimizer state):
    each resume is refused in one line that names the file and what is wrong with it."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "4", "--out", str(out)]) == 0
    capsys.readouterr()
    resume = ["train", *SMALL, "--steps", "6", "--out", str(out), "--resume"]
    latest = out / "checkpoints" / "step-00000004"
    saved = _tree(out)
    for name, change, message in _DAMAGED:
        shutil.copy(latest / name, tmp_path / "keep.pt")
        _tamper_pt(latest / name, change)
        assert main(resume) == 2, message
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(latest / name) in err, err
        assert message in err, err
        shutil.copy(tmp_path / "keep.pt", latest / name)
    assert _tree(out) == saved  # a refused resume writes nothing
    assert main(resume) == 0  # the intact checkpoint still resumes


def _write(text: bytes) -> Callable[[Path], object]:
    return lambda p: p.write_bytes(text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("checkpoints/LATEST", _write(b"step-\xff\n"), "is not UTF-8 text (byte 0xff at offset 5)"),
        ("checkpoints/LATEST", _write(b"step-+0004\n"), "is corrupt (holds 'step-+0004'"),
        ("checkpoints/LATEST", _write(b"\x00" * 5000), "more than the 4096 allowed"),
        ("checkpoints/LATEST", lambda p: p.mkdir(), "is a directory, not a regular file"),
        ("checkpoints/LATEST", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
        ("run.json", _write(b"[1, 2]"), "holds a JSON list, not an object"),
        ("run.json", _write(b'{"model": "\xfe"}'), "is not UTF-8 text"),
        ("run.json", _write(b"{"), "is corrupt"),
        ("run.json", lambda p: p.symlink_to("/dev/zero"), "is a character device"),
        ("run.json", lambda p: p.symlink_to("/proc/self"), "is a directory, not a regular file"),
        (
            "checkpoints/step-00000002/model.pt",
            lambda p: os.mkfifo(p),
            "is a FIFO, not a regular file",  # never opened: the resume does not hang
        ),
        ("checkpoints/step-00000002/rank0.pt", lambda p: p.mkdir(), "is a directory"),
    ],
)
def test_damaged_run_records_are_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    make: Callable[[Path], object],
    message: str,
) -> None:
    out = tmp_path / "run"
    cfg = tiny_config(tmp_path, steps=2, checkpoint_interval=2, eval_sequences=4)
    train(cfg)
    path = out / name
    path.unlink()
    make(path)
    assert main(["train", *SMALL, "--steps", "4", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and message in err, err
    assert "missing" not in err, err  # it is there, and the line says what it is


@pytest.mark.timeout(120)
def test_a_damaged_metrics_log_never_blocks_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "4", "--out", str(out)]) == 0
    log = out / "metrics.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    garbage = [b"{not json\n", b"\xff\xfe\n", b"[1, 2]\n", b'{"step": "3"}\n']
    log.write_bytes(b"".join(lines[:2] + garbage + lines[2:]) + b'{"step": 4, "lo')
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", "6", "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    warning = [e for e in err if "unreadable" in e]
    assert warning == [
        f"thinwire: warning: {log}: 5 unreadable lines (the first is line 3) set aside in "
        "metrics.jsonl.unreadable; the run resumes without them"
    ]
    # Nothing is lost: the good records are kept, the bad lines are set aside verbatim.
    records = read_metrics(log)
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6]
    aside = (out / "metrics.jsonl.unreadable").read_bytes()
    assert aside == b"".join(garbage) + b'{"step": 4, "lo\n'
    # A reader of the log (thinwire compare, a user's script) skips and counts them too.
    log.write_bytes(log.read_bytes() + b"oops\n")
    assert len(read_metrics(log)) == len(records)
    assert capsys.readouterr().err.strip() == (
        f"thinwire: warning: {log}: 1 unreadable line (the first is line "
        f"{len(records) + 1}) skipped"
    )


@pytest.mark.timeout(120)
def test_a_finished_run_that_moved_reports_where_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    assert main(["train", *SMALL, "--steps", "2", "--out", str(old)]) == 0
    shutil.move(old, new)
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", "2", "--out", str(new), "--resume"]) == 0
    captured = capsys.readouterr()
    assert "already reached step 2" in captured.err
    assert ["output", str(new)] in [line.split() for line in captured.out.splitlines()]
    assert str(old) not in captured.out + captured.err
