"""Where a 1-bit optimizer's step goes: the recorder splits it (update, codec, waiting),
and ``thinwire bench optimizer`` times it on a recorded job's layout, every rank at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS
from thinwire.analysis.job_passes import trained_weights
from thinwire.analysis.optimizer_step import (
    TUNING_STEPS,
    layout_of_record,
    summarize,
    timed_steps,
)
from thinwire.analysis.recorded import load_record
from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.train.config import TrainConfig
from thinwire.train.model import GPT


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

    # the timing starts from the run's newest checkpoint, the job as it was trained
    model = GPT(TrainConfig.from_dict(json.loads((out / "config.json").read_text())).gpt_config())
    assert trained_weights(model, out) == 8
    saved = torch.load(out / "checkpoints" / "step-00000008" / "model.pt", weights_only=True)
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    assert trained_weights(model, tmp_path) == 0  # no checkpoint: the seed's weights

    numels = layout_of_record(rec.header)
    assert sum(numels) * 4 == sum(p["nbytes"] for p in rec.header["params"])
    bench = tmp_path / "bench"
    argv = ["bench", "optimizer", "--record", str(out), "--workers", "2", "--iters", "3"]
    assert main([*argv, "--out", str(bench)]) == 0
    assert "the job's own passes before each" in capsys.readouterr().out  # a train run
    blob = json.loads((bench / "optimizer.json").read_text())
    assert blob["numels"] == numels and len(blob["ranks"]) == 2
    s = blob["summary"]
    assert s["ranks"] == 2 and 0 < s["exchange_s"] <= s["step_s"]
    assert 0 <= s["wait_s"] <= s["exchange_s"]
    assert s["update_s"] + s["exchange_s"] == pytest.approx(s["step_s"], rel=0.5)
    assert s["passes_s"] > 0 and f"--record {out}" in blob["command"]

    # A loop of the user's own has no config to rebuild: arithmetic stands in for the
    # record's passes; --compute-ms sets it for any record.
    user = tmp_path / "user"
    user.mkdir()
    (user / "record.jsonl").write_text((out / "record.jsonl").read_text())
    argv[3] = str(user / "record.jsonl")
    assert main([*argv, "--out", str(tmp_path / "stand-in")]) == 0
    assert "ms of stand-in compute before each" in capsys.readouterr().out
    stand_in = json.loads((tmp_path / "stand-in" / "optimizer.json").read_text())
    assert float(stand_in["command"].split("--compute-ms ")[1]) > 0  # the record's compute
    assert main([*argv, "--compute-ms", "0", "--out", str(tmp_path / "aligned")]) == 0
    assert " 0 ms of stand-in compute before each" in capsys.readouterr().out
    aligned = json.loads((tmp_path / "aligned" / "optimizer.json").read_text())
    assert "--compute-ms 0.0" in aligned["command"]  # what stood in for the passes
    assert "passes_s" in aligned["summary"]  # the stand-in's own time, on record too


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


class _Tuning:
    """An optimizer whose 1-bit collective is tuned after ``tuned_after`` steps."""

    def __init__(self, tuned_after: int | None) -> None:
        self.tuned_after, self.steps = tuned_after, 0
        self.exchange_s = self.exchange_wait_s = 0.0
        self.compressing = True

    @property
    def onebit_tuned(self) -> bool | None:
        if self.steps < 2:
            return None  # not compressing yet
        return self.tuned_after is not None and self.steps >= self.tuned_after

    def step(self) -> None:
        self.steps += 1
        self.exchange_s += 0.002
        self.exchange_wait_s += 0.001

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def test_timed_steps_wait_for_the_collective_to_be_tuned() -> None:
    seen: list[int] = []
    opt = _Tuning(tuned_after=17)
    steps = timed_steps("onebit-lamb", opt, seen.append, warmup=3, iters=4)
    # the tuner's calls stay untimed: 17 steps, then 4 timed ones
    assert opt.steps == 21 and seen == list(range(21)) and len(steps) == 4
    assert all(s["exchange_s"] == pytest.approx(0.002) for s in steps)
    assert all(s["wait_s"] == pytest.approx(0.001) and s["passes_s"] >= 0 for s in steps)
    # an optimizer without a tuner: the warmup only
    assert len(timed_steps("x", _Tuning(tuned_after=0), lambda k: None, 3, 2)) == 2
    # a tuner that never settles is waited for TUNING_STEPS more, not forever
    never = _Tuning(tuned_after=None)
    timed_steps("x", never, lambda k: None, 3, 2)
    assert never.steps == 3 + TUNING_STEPS + 2
