"""Where a 1-bit optimizer's step goes: the recorder splits it (update, codec, waiting),
and ``thinwire bench optimizer`` times it on a recorded job's layout, every rank at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.analysis.optimizer_step import layout_of_record, summarize
from thinwire.analysis.recorded import load_record
from thinwire.cli.main import main
from thinwire.errors import ConfigError


@pytest.mark.timeout(240)
def test_a_recorded_onebit_run_and_its_step_timed_on_its_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "onebit"
    flags = ["--algo", "onebit-lamb", "--workers", "2", "--batch-size", "4", *TINY_FLAGS]
    flags += ["--steps", "8", "--freeze-step", "3", "--eval-interval", "50", "--no-progress"]
    assert main(["train", *flags, "--out", str(out)]) == 0
    rec = load_record(out)
    warm = [s for s in rec.steps if s["step"] <= 3]
    comp = [s for s in rec.steps if s["step"] > 4]
    assert all(s["exchange_s"] == 0 for s in warm)  # LAMB's warmup exchanges nothing
    for s in comp:
        assert 0 < s["exchange_s"] <= s["optimizer_s"]
        assert 0 <= s["exchange_wait_s"] <= s["exchange_s"]
    capsys.readouterr()
    assert main(["analyze", "run", str(out), "--out", str(tmp_path / "study.json")]) == 0
    text = capsys.readouterr().out
    assert "the 1-bit exchange (5 compressing steps): update" in text
    assert "no self-check: DDP's buckets carried nothing" in text

    numels = layout_of_record(rec.header)
    assert sum(numels) * 4 == sum(p["nbytes"] for p in rec.header["params"])
    bench = tmp_path / "bench"
    argv = ["bench", "optimizer", "--record", str(out), "--workers", "2", "--iters", "3"]
    assert main([*argv, "--out", str(bench)]) == 0
    assert "ms of compute before each" in capsys.readouterr().out  # the record's own
    assert main([*argv, "--compute-ms", "0", "--out", str(tmp_path / "aligned")]) == 0
    blob = json.loads((bench / "optimizer.json").read_text())
    assert blob["numels"] == numels and len(blob["ranks"]) == 2
    s = blob["summary"]
    assert s["ranks"] == 2 and 0 < s["exchange_s"] <= s["step_s"]
    assert 0 <= s["wait_s"] <= s["exchange_s"]
    assert s["update_s"] + s["exchange_s"] == pytest.approx(s["step_s"], rel=0.5)
    assert "0 ms of compute before each" in capsys.readouterr().out
    assert "--compute-ms" in blob["command"]  # what stood in for the passes is on record


def test_summaries_take_medians_per_rank_then_over_ranks() -> None:
    rank = [{"step_s": t, "exchange_s": t / 2, "wait_s": t / 4} for t in (1.0, 2.0, 9.0)]
    slow = [{"step_s": 4.0, "exchange_s": 3.0, "wait_s": 0.0}] * 3
    s = summarize([rank, rank, slow])
    assert s["step_s"] == 2.0 and s["exchange_s"] == 1.0 and s["wait_s"] == 0.5
    assert s["update_s"] == 1.0 and s["codec_s"] == 0.5 and s["ranks"] == 3


def test_a_record_without_float_parameters_and_bad_counts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no trainable floating-point"):
        layout_of_record({"params": [{"name": "ids", "nbytes": 8, "dtype": "int64"}]})
    with pytest.raises(SystemExit):
        main(["bench", "optimizer", "--algo", "sgd", "--record", str(tmp_path)])
    assert main(["bench", "optimizer", "--record", str(tmp_path)]) == 2  # holds no record
