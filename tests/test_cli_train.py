"""``thinwire train`` from the command line: torchrun vs own spawning, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_FLAGS, interruptible
from thinwire.cli.main import main
from thinwire.train import checkpoint as ckpt
from thinwire.train.metrics import read_metrics

SMALL = [
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--eval-sequences",
    "8",
    "--no-progress",
]


def _run(args: list[str], env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "thinwire", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(300)
def test_torchrun_and_own_spawning_agree(tmp_path: Path, cli_env: dict[str, str]) -> None:
    common = ["train", "--steps", "8", "--eval-interval", "4", *SMALL]
    own = _run([*common, "--workers", "2", "--out", str(tmp_path / "own")], cli_env)
    assert own.returncode == 0, own.stderr
    assert "final val loss" in own.stdout
    tr = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "thinwire",
            *common,
            "--out",
            str(tmp_path / "torchrun"),
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert tr.returncode == 0, tr.stderr[-3000:]
    a, b = _summary(tmp_path / "own"), _summary(tmp_path / "torchrun")
    assert a["world_size"] == b["world_size"] == 2
    assert a["param_sha256"] == b["param_sha256"]
    assert a["final_val_loss"] == b["final_val_loss"]
    assert a["comm_bytes"] == b["comm_bytes"] > 0
    assert tr.stdout.count("final val loss") == 1  # only rank 0 prints the summary


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


def test_unknown_algorithm_lists_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(["train", "--algo", "sgd-magic", "--workers", "1", *SMALL], capsys)
    assert "unknown algorithm 'sgd-magic'" in err and "adamw" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "looks binary"),
        (b"caf\xe9 au lait", "is not UTF-8"),
    ],
)
def test_bad_data_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    err = _error(["train", "--data", str(path), "--workers", "1", *SMALL], capsys)
    assert message in err and str(path) in err


def test_sequence_longer_than_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "short.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 3)
    args = ["train", "--data", str(path), "--workers", "1", *SMALL, "--seq-len", "512"]
    err = _error(args, capsys)
    assert "sequence length 512 is too long" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch-size", "0", "batch-size must be >= 1, got 0"),
        ("--steps", "0", "steps must be >= 1, got 0"),
        ("--workers", "0", "workers must be >= 1, got 0"),
        ("--n-head", "3", "must be divisible by n_head"),
        ("--model", "huge", "unknown model preset 'huge'"),
        ("--shards", "0", "--shards must be >= 1, got 0"),
    ],
)
def test_impossible_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    args = ["train", "--workers", "1", "--out", str(tmp_path / "o"), *SMALL, flag, value]
    assert message in _error(args, capsys)


def test_bad_inner_momentum_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for algo in ("async-diloco", "diloco"):
        args = [
            "train",
            "--algo",
            algo,
            "--workers",
            "3",
            "--out",
            str(tmp_path / algo),
            *SMALL,
            "--inner-momentum",
            "reset",
        ]
        assert (
            "unknown inner-state rule 'reset'; choose one of keep, round, restart, fresh"
            in _error(args, capsys)
        )
        assert not (tmp_path / algo).exists()  # refused before any process started


def _train_once(out: Path, *extra: str) -> int:
    return main(
        [
            "train",
            "--workers",
            "1",
            "--steps",
            "4",
            "--eval-interval",
            "2",
            "--out",
            str(out),
            *SMALL,
            *extra,
        ]
    )


def test_output_dir_of_another_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _train_once(out) == 0
    before = (out / "checkpoints" / "LATEST").read_text()
    capsys.readouterr()
    err = _error(["train", "--workers", "1", "--steps", "4", "--out", str(out), *SMALL], capsys)
    assert "already holds a run (run.json, metrics.jsonl, summary.json, checkpoints)" in err
    assert (out / "checkpoints" / "LATEST").read_text() == before  # nothing lost


def test_resume_from_corrupt_or_mismatched_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _train_once(out, "--stop-after", "2") == 0
    capsys.readouterr()
    err = _error(
        [
            "train",
            "--workers",
            "1",
            "--steps",
            "4",
            "--out",
            str(out),
            "--resume",
            *SMALL,
            "--n-embd",
            "64",
        ],
        capsys,
    )
    assert "cannot resume" in err and "n_embd: checkpoint has 32, this run has 64" in err
    rank_file = out / "checkpoints" / "step-00000002" / "rank0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])  # truncated, as by a dying disk
    err = _error(
        ["train", "--workers", "1", "--steps", "4", "--out", str(out), "--resume", *SMALL], capsys
    )
    assert "is corrupt or unreadable" in err and "rank0.pt" in err
    err = _error(
        [
            "train",
            "--workers",
            "1",
            "--steps",
            "4",
            "--out",
            str(tmp_path / "none"),
            "--resume",
            *SMALL,
        ],
        capsys,
    )
    assert "no checkpoint" in err


@pytest.mark.timeout(200)
def test_ctrl_c_keeps_last_checkpoint(tmp_path: Path, cli_env: dict[str, str]) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "thinwire",
            "train",
            "--workers",
            "1",
            "--steps",
            "100000",
            "--checkpoint-interval",
            "3",
            "--eval-interval",
            "1000",
            "--out",
            str(out),
            *SMALL,
        ],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    deadline = time.monotonic() + 150
    while ckpt_latest(out) is None or ckpt_latest(out) < 6:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    step = ckpt.latest_step(out)
    assert f"interrupted; the last checkpoint, step {step}, is intact" in err, err
    assert step is not None and step >= 6
    ckpt.load_model_state(out, step)  # loads: not half-written
    ckpt.load_rank_state(out, step, 0)
    assert not list(out.rglob(".*tmp*"))
    assert (
        main(
            [
                "train",
                "--workers",
                "1",
                "--steps",
                str(step + 2),
                "--eval-interval",
                "1000",
                "--out",
                str(out),
                "--resume",
                *SMALL,
            ]
        )
        == 0
    )


def ckpt_latest(out: Path) -> int | None:
    try:
        return ckpt.latest_step(out)
    except Exception:
        return None


def test_tensorboard_writes_events_or_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tb"
    args = [
        "train",
        "--workers",
        "1",
        "--steps",
        "2",
        "--eval-interval",
        "2",
        "--out",
        str(out),
        "--tensorboard",
        *SMALL,
    ]
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        err = _error(args, capsys)
        assert "--tensorboard needs the tensorboard package" in err
    else:
        assert main(args) == 0
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.timeout(120)
def test_onebit_flags_reach_the_run(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """--freeze-step auto (the default) with its cap, --grad-dtype, --precondition and the
    second bundled corpus, through the command line: the switch is announced, recorded
    and bounded by the cap, and the warmup's gradients travel as asked."""
    out = tmp_path / "run"
    flags = ["--algo", "onebit-adam", "--workers", "2", "--steps", "20", "--warmup-steps", "2"]
    flags += ["--freeze-cap", "0.25", "--grad-dtype", "fp16", "--no-precondition"]
    flags += ["--data", "moby-dick", "--log-interval", "1", "--out", str(out)]
    res = _run(["train", *SMALL, *flags], cli_env)
    assert res.returncode == 0, res.stderr
    assert "onebit-adam: warmup capped at step 5" in res.stderr
    assert "1-bit compression from step 6" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["freeze_step"] == 5 and summary["comm_by_op"]["ddp.fp16"]["calls"] > 0
    events = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "freeze"]
    assert [(e["step"], e["freeze_reason"]) for e in events] == [(5, "cap")]
    run = json.loads((out / "run.json").read_text())
    assert run["data"] == "moby-dick"
