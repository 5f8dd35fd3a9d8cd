"""Convergence of 1-bit LAMB against LAMB on real text, and the comparison tool that shows it.

The distributed test is the CI-sized version of the evidence in ``docs/results/optimizers.md``
(section "Optimizers: LAMB, 1-bit Adam, 1-bit LAMB"); the others check
:mod:`thinwire.train.compare` in one process, where they run in seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import tiny_config
from thinwire.errors import ConfigError
from thinwire.train.compare import compare, parse_run_spec
from thinwire.train.compare_report import format_comparison, plot_comparison
from thinwire.train.config import TrainConfig

STEPS = 80
FREEZE = 20  # 25% of the run in full precision


def _ci_base(tmp_path: Path) -> TrainConfig:
    """A 1-layer, 64-wide GPT on the bundled Shakespeare, 2 workers x 16 sequences of 32."""
    return TrainConfig(
        model="tiny",
        n_layer=1,
        n_embd=64,
        seq_len=32,
        batch_size=16,
        steps=STEPS,
        lr=0.015,
        warmup_steps=8,
        freeze_step=FREEZE,
        seed=0,
        eval_interval=STEPS,
        eval_sequences=64,
        log_interval=10,
        checkpoint_interval=0,
        progress=False,
        out_dir=str(tmp_path / "unused"),
    )


@pytest.mark.timeout(400)
def test_onebit_lamb_converges_like_lamb_with_a_sixth_of_the_bytes(tmp_path: Path) -> None:
    """1-bit LAMB (freeze at 25% of 80 steps) reaches LAMB's validation loss, 2 workers.

    Three runs on identical settings (lr 0.015, warmup 8, same batches): ``lamb``,
    ``onebit-lamb`` and, as a control, ``onebit-lamb`` with ``freeze_step = steps`` and an
    fp32 warmup exchange, which never compresses. The trainer's 1-bit optimizers
    bias-correct like its LAMB, so the control must reproduce LAMB exactly: the warmup
    rule is LAMB's.

    Tolerances, from seeds 0, 1, 2 (ratios of final validation losses, ~5.53 at the start):

    * 1-bit LAMB / LAMB: measured 0.975, 1.059, 1.039. Asserted <= 1.08: what the
      compression costs on a run this short (the variance is frozen after 20 steps); a
      broken error feedback or momentum exchange costs far more. The 2% goal is
      met by the longer runs of docs/results/optimizers.md.
    * bytes: 1-bit LAMB / LAMB measured 0.159 (0.25 of the steps in fp16, half of LAMB's
      fp32 bytes, + 0.75 x ~1/32 + scale gathers); asserted in [0.14, 0.18]. The control
      sends what LAMB sends.
    """
    control_spec = f"onebit-lamb@freeze_step={STEPS},grad_dtype=fp32"
    runs = ["lamb", f"onebit-lamb@freeze_step={FREEZE}", control_spec]
    result = compare(runs, _ci_base(tmp_path), workers=2, out_dir=tmp_path / "cmp")
    print(format_comparison(result))  # shown with pytest -s: the numbers behind the bounds
    lamb, onebit, control = (result["runs"][r] for r in runs)
    for r in (lamb, onebit, control):
        assert math.isfinite(r["final_val_loss"])
        assert r["final_val_loss"] < r["val"][0][1] - 1.5, r["val"]  # it learned
    assert onebit["final_val_loss"] <= 1.08 * lamb["final_val_loss"], format_comparison(result)
    assert control["final_val_loss"] == lamb["final_val_loss"], format_comparison(result)
    assert 0.14 <= onebit["comm_bytes"] / lamb["comm_bytes"] <= 0.18, format_comparison(result)
    assert control["comm_bytes"] == lamb["comm_bytes"]
    # the stage switch happened where it was asked to, and only in the compressed run
    metrics = Path(onebit["config"]["out_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.open()]
    stages = {r["step"]: r["compressing"] for r in records if "compressing" in r}
    assert stages[FREEZE - 10] == 0 and stages[FREEZE] == 1 and stages[STEPS] == 1


@pytest.mark.timeout(400)
def test_onebit_adam_converges_like_adamw(tmp_path: Path) -> None:
    """1-bit Adam (freeze at 25%, preconditioned exchange) against AdamW at one lr.

    Measured 1.010 and 1.017 of AdamW's loss on seeds 0 and 1 (with the papers' raw
    momentum exchange: 1.064 and 1.358). Asserted <= 1.05.
    """
    runs = ["adamw@lr=0.002", f"onebit-adam@lr=0.002,freeze_step={FREEZE}"]
    result = compare(runs, _ci_base(tmp_path), workers=2, out_dir=tmp_path / "cmp")
    adamw, onebit = (result["runs"][r] for r in runs)
    assert adamw["final_val_loss"] < adamw["val"][0][1] - 1.5, adamw["val"]
    assert onebit["final_val_loss"] <= 1.05 * adamw["final_val_loss"], format_comparison(result)
    assert onebit["comm_bytes"] < 0.2 * adamw["comm_bytes"], format_comparison(result)


def test_run_specs_parse_and_reject_bad_input() -> None:
    assert parse_run_spec("lamb") == ("lamb", {})
    assert parse_run_spec("onebit-lamb@lr=0.01,freeze-step=30") == (
        "onebit-lamb",
        {"lr": 0.01, "freeze_step": 30},
    )
    assert parse_run_spec("adamw@betas=0.9/0.95")[1] == {"betas": (0.9, 0.95)}
    with pytest.raises(ConfigError, match="unknown algorithm 'lam'"):
        parse_run_spec("lam@lr=0.1")
    with pytest.raises(ConfigError, match="'speed=3' is not KEY=VALUE"):
        parse_run_spec("lamb@speed=3")
    with pytest.raises(ConfigError, match="'out_dir=x' is not KEY=VALUE"):
        parse_run_spec("lamb@out_dir=x")  # shared by every run, not per run
    with pytest.raises(ConfigError, match="bad value 'fast' for lr"):
        parse_run_spec("lamb@lr=fast")
    # An asynchronous method is a run spec too: async-diloco with the method's settings.
    algo, settings = parse_run_spec("dn-dylu@outer_lr=0.3")
    assert algo == "async-diloco" and settings["dylu"] and not settings["sync"]
    assert settings["outer"] == "dn" and settings["outer_lr"] == 0.3
    assert parse_run_spec("sync")[1]["c"] == 0.0
    assert parse_run_spec("sync")[1]["sync"] and parse_run_spec("naive")[1]["outer"] == "nesterov"
    assert parse_run_spec("polythres")[1]["max_staleness"] == 10


@pytest.mark.timeout(120)
def test_compare_in_one_process_writes_json_plot_and_ratios(tmp_path: Path) -> None:
    base = tiny_config(tmp_path, steps=6, eval_interval=3, checkpoint_interval=0)
    out = tmp_path / "cmp"
    runs = ["adamw", "lamb@lr=0.01", "onebit-lamb@freeze_step=2"]
    result = compare(runs, base, workers=1, out_dir=out, reference="lamb@lr=0.01")
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["reference"] == "lamb@lr=0.01" and list(saved["runs"]) == runs
    for label in runs:
        r = result["runs"][label]
        summary = json.loads((Path(r["config"]["out_dir"]) / "summary.json").read_text())
        assert r["final_val_loss"] == summary["final_val_loss"] == r["val"][-1][1]
        assert [s for s, _ in r["val"]] == [0, 12, 24]  # 3 and 6 steps of 4 sequences
        assert r["bytes_reduction"] is None  # one worker sends nothing
    assert result["runs"]["lamb@lr=0.01"]["config"]["lr"] == 0.01
    assert result["runs"]["adamw"]["config"]["lr"] == base.lr
    assert result["runs"]["onebit-lamb@freeze_step=2"]["freeze_step"] == 2
    # How soon each run reached the reference's final loss, by its own clock.
    ref = result["runs"]["lamb@lr=0.01"]
    reach = ref["time_to_ref_loss_s"]
    assert reach is not None and reach <= ref["val_time"][-1][0]
    assert ref["speedup_to_ref_loss"] == 1.0
    ref = result["runs"]["lamb@lr=0.01"]["final_val_loss"]
    ratio = result["runs"]["adamw"]["loss_ratio"]
    assert ratio == pytest.approx(result["runs"]["adamw"]["final_val_loss"] / ref)
    assert "lamb@lr=0.01 (ref)" in format_comparison(result)
    pytest.importorskip("matplotlib")
    png = plot_comparison(result, tmp_path / "cmp.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"

    # A second comparison into the same directory refuses, naming the directory...
    with pytest.raises(ConfigError, match="already holds a run"):
        compare(runs[:1], base, workers=1, out_dir=out)
    # ...unless asked to replace the runs, which then start from scratch.
    again = compare(runs[:1], base, workers=1, out_dir=out, overwrite=True)
    assert again["runs"]["adamw"]["final_val_loss"] == result["runs"]["adamw"]["final_val_loss"]


def test_compare_rejects_bad_requests(tmp_path: Path) -> None:
    base = tiny_config(tmp_path)
    with pytest.raises(ConfigError, match="reference 'x' is not one of the runs"):
        compare(["lamb"], base, workers=1, out_dir=tmp_path, reference="x")
    with pytest.raises(ConfigError, match="duplicate run specs"):
        compare(["lamb", "lamb"], base, workers=1, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        compare(["lamb"], base, workers=0, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="freeze-step must be 'auto' or a step >= 1"):
        compare(["onebit-lamb@freeze_step=-1"], base, workers=1, out_dir=tmp_path)
