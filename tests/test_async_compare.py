"""The end-to-end comparison of asynchronous methods on real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import main as thinwire


def main(args: list[str]) -> int:
    return thinwire(["compare", "--async", *args])


SMALL = TINY_FLAGS


@pytest.mark.timeout(300)
def test_compares_methods_on_real_processes_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "--methods",
        "sync,dn-dylu",
        "--steps",
        "6",
        "--local-steps",
        "3",
        "--slowdown",
        "1,2",
        "--batch-size",
        "4",
        "--eval-interval",
        "3",
        "--out",
        str(tmp_path),
        "--",
        *SMALL,
        "--eval-sequences",
        "8",
    ]
    assert main(args) == 0
    blob = json.loads((tmp_path / "results.json").read_text())
    runs, summary = blob["runs"], blob["summary"]
    assert runs["sync"]["sync"] and runs["dn-dylu"]["dylu"] and not runs["sync"]["dylu"]
    for m in ("sync", "dn-dylu"):
        assert runs[m]["inner_steps"] == 12 and runs[m]["parameters"] < 30_000  # --n-embd
        assert runs[m]["curve"][0]["steps"] == 0 and runs[m]["curve"][-1]["steps"] == 12
    assert summary["sync"]["loss_vs_sync"] == 1.0
    assert summary["sync"]["speedup_to_sync_loss"] == 1.0
    assert summary["dn-dylu"]["train_time_s"] > 0
    assert "| dn-dylu |" in (tmp_path / "table.md").read_text()
    # A second call reads the finished runs back instead of training again.
    before = (tmp_path / "sync" / "summary.json").stat().st_mtime
    assert main(args) == 0
    assert (tmp_path / "sync" / "summary.json").stat().st_mtime == before
    # The runs went through the one comparison driver: comparison.json as every compare.
    record = json.loads((tmp_path / "comparison.json").read_text())
    assert record["reference"] == "sync" and set(record["runs"]) == {"sync", "dn-dylu"}
    assert {r["algo"] for r in record["runs"].values()} == {"async-diloco"}
    assert record["runs"]["dn-dylu"]["config"]["dylu"] is True
    assert all(len(r["load_avg_1min"]) == 2 for r in record["runs"].values())
    # Other settings over finished runs are refused in one line, not silently mixed.
    other = [a if a != "6" else "8" for a in args]
    assert main(other) == 2
    assert "finished with other settings: steps 6 (asked 8)" in capsys.readouterr().err
    assert main(["--methods", "fedavg", "--out", str(tmp_path / "x")]) == 2
