"""``thinwire compare --resume``: runs that finished are read back, a run that stopped
continues from its checkpoint, and a run with other settings is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import main


@pytest.mark.timeout(180)
def test_resume_keeps_finished_runs_and_continues_a_stopped_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--algos", "adamw", "lamb", "--workers", "1", "--steps", "6"]
    argv += ["--batch-size", "2", "--eval-interval", "3", "--eval-sequences", "4"]
    argv += ["--checkpoint-interval", "3", "--log-interval", "1", *TINY_FLAGS, "--out", str(out)]
    assert main(argv) == 0
    first = json.loads((out / "comparison.json").read_text())["runs"]
    finished = {p: p.stat().st_mtime_ns for p in (out / "adamw").iterdir() if p.is_file()}
    # lamb was stopped after its last checkpoint, before it wrote its summary.
    (out / "lamb" / "summary.json").unlink()
    last = max((out / "lamb" / "checkpoints").iterdir()) / "model.pt"
    written = last.stat().st_mtime_ns
    (out / "comparison.json").unlink()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    again = json.loads((out / "comparison.json").read_text())["runs"]
    # adamw was read back, not trained again: none of its files was written.
    assert {p: p.stat().st_mtime_ns for p in finished} == finished
    assert again["adamw"]["final_val_loss"] == first["adamw"]["final_val_loss"]
    assert again["lamb"]["final_val_loss"] == pytest.approx(first["lamb"]["final_val_loss"])
    # ...and lamb continued from its checkpoint instead of starting over.
    assert last.stat().st_mtime_ns == written
    assert again["lamb"]["config"]["lr"] == first["lamb"]["config"]["lr"]
    # Without --resume the runs are refused, and the line says how to keep them.
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err
    # A finished run with other settings is not mixed into the comparison.
    assert main([*argv, "--resume", "--lr", "0.005"]) == 2
    err = capsys.readouterr().err.strip()
    assert "finished with other settings" in err and "lr" in err and "--overwrite" in err
    assert "\n" not in err
