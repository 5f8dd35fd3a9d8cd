"""``thinwire analyze run``: a recorded run read back, checked, turned into a profile and a
what-if table; and the trainer recording its runs by default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_FLAGS
from thinwire.analysis.recorded import (
    analyze_record,
    load_record,
    measured,
    profile_from_record,
)
from thinwire.cli.main import main
from thinwire.comm.step_record import RECORD_FORMAT
from thinwire.errors import ConfigError

_PARAMS = [
    {"name": "a.weight", "index": 0, "nbytes": 4_000_000, "dtype": "float32"},
    {"name": "b.weight", "index": 1, "nbytes": 1_000_000, "dtype": "float32"},
]


def _step(k: int, ready: list[float | None], step_s: float = 0.2) -> dict[str, Any]:
    return {
        "step": k,
        "step_s": step_s,
        "forward_s": 0.03,
        "backward_s": step_s - 0.05,
        "optimizer_s": 0.02,
        "ready_s": ready,
        "buckets": [
            {"params": [1], "bytes": 1_000_000, "launch_s": 0.02, "hook_s": 0.001, "done_s": 0.06},
            {"params": [0], "bytes": 4_000_000, "launch_s": 0.05, "hook_s": 0.001, "done_s": 0.15},
        ],
        "wire_bytes": 5_000_000,
    }


def _write(path: Path, steps: list[dict[str, Any]], **head: Any) -> Path:
    header = {"format": RECORD_FORMAT, "model": "Net", "world_size": 2, "backend": "gloo"}
    header |= {"device": "cpu", "params": _PARAMS, "meta": {"batch_size": 8}} | head
    path.write_text("\n".join(json.dumps(x) for x in [header, *steps]) + "\n")
    return path


@pytest.mark.timeout(30)
def test_a_record_becomes_the_profile_of_its_compute(tmp_path: Path) -> None:
    # step 1 (DDP's first, another layout) is slow and left out; medians of the rest
    steps = [_step(1, [0.9, 0.9], step_s=2.0)] + [
        _step(k, [0.05 + 0.001 * k, 0.02]) for k in range(2, 9)
    ]
    rec = load_record(_write(tmp_path / "record.jsonl", steps))
    prof = profile_from_record(rec)
    assert prof.source == "recorded" and prof.batch_size == 8 and prof.steps == 6
    assert [p.ready_s for p in prof.params] == pytest.approx([0.0555, 0.02])
    assert prof.backward_s == pytest.approx(0.0555)
    assert prof.iteration_s == pytest.approx(0.03 + 0.0555 + 0.02)
    assert prof.observed_buckets == [[1], [0]]  # in launch order
    seen = measured(rec)
    assert seen["step_s"] == pytest.approx(0.2)
    assert seen["exposed_s"] == pytest.approx(0.2 - 0.1055)
    # ring allreduce of 5 MB on 2 ranks: 5 MB on each link in 0.13 s
    assert seen["achieved_gbps"] == pytest.approx(5e6 * 8 / 0.13 / 1e9)
    study = analyze_record(rec, bandwidth_gbps=1.0)
    assert study["self_check"]["measured_step_s"] == pytest.approx(0.2)
    assert study["self_check"]["predicted_step_s"] > prof.iteration_s
    assert study["result"]["scaling_factor"] < 1.0
    # another worker count is a prediction with nothing measured to check it against
    assert analyze_record(rec, workers=8, bandwidth_gbps=1.0)["self_check"] is None


@pytest.mark.timeout(30)
def test_a_onebit_record_splits_its_optimizer_into_update_codec_and_wait(
    tmp_path: Path,
) -> None:
    """A 1-bit optimizer's steps carry their exchange: the profile's optimizer is the
    update alone, the codec is priced per byte from what the run measured, and the wait
    is exposed communication, not compute."""
    warm = [_step(k, [0.05, 0.02]) for k in range(1, 5)]
    comp = [
        _step(k, [0.05, 0.02]) | {"optimizer_s": 0.05, "exchange_s": 0.03, "exchange_wait_s": 0.01}
        for k in range(5, 12)
    ]
    rec = load_record(_write(tmp_path / "record.jsonl", warm + comp))
    prof = profile_from_record(rec)
    assert prof.meta["onebit_optimizer_s"] == pytest.approx(0.02)
    assert prof.meta["onebit_codec_s_per_byte"] == pytest.approx(0.02 / 5_000_000)
    assert prof.optimizer_s == pytest.approx(0.02)  # warmup and compressing: the update
    seen = measured(rec)
    split = seen["onebit_exchange"]
    assert split["steps"] == 7 and split["wait_s"] == pytest.approx(0.01)
    assert split["codec_s"] == pytest.approx(0.02) and split["update_s"] == pytest.approx(0.02)
    # DDP's buckets carried nothing in the compressing steps: no DDP self-check
    assert analyze_record(rec, bandwidth_gbps=1.0)["self_check"] is None
    with pytest.raises(ConfigError, match=":6: exchange_wait_s must be a number >= 0"):
        bad = [*warm, comp[0] | {"exchange_wait_s": -1.0}]
        load_record(_write(tmp_path / "bad.jsonl", bad))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty, not a thinwire record"),
        (['{"format": "thinwire.profile/1"}'], "not a thinwire record"),
        (["{", "{}"], ":1: not JSON"),
        ([json.dumps({"format": RECORD_FORMAT, "world_size": 0, "params": []})], "world_size"),
        (
            [json.dumps({"format": RECORD_FORMAT, "world_size": 2, "params": [{"name": 1}]})],
            r"params\[0\] needs a name",
        ),
        (
            [json.dumps({"format": RECORD_FORMAT, "world_size": 2, "params": []})],
            "no step recorded",
        ),
    ],
)
def test_a_bad_record_is_one_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "record.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=message):
        load_record(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step_s": -1}, "step_s must be a number >= 0"),
        ({"ready_s": [0.1]}, "one time per parameter"),
        ({"ready_s": [0.1, "x"]}, "ready_s holds"),
        ({"buckets": [{"params": [7], "bytes": 1, "launch_s": 0}]}, "does not list"),
        ({"buckets": [{"params": [0], "bytes": -1, "launch_s": 0}]}, "bucket bytes"),
    ],
)
def test_a_bad_step_names_its_line(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    steps = [_step(1, [0.1, 0.1]), _step(2, [0.1, 0.1]) | change, _step(3, [0.1, 0.1])]
    with pytest.raises(ConfigError, match=f":3: .*{message}"):
        load_record(_write(tmp_path / "r.jsonl", steps))


@pytest.mark.timeout(30)
def test_a_line_cut_by_a_stopped_run_is_left_out(tmp_path: Path) -> None:
    path = _write(tmp_path / "r.jsonl", [_step(k, [0.1, 0.1]) for k in range(1, 5)])
    path.write_text(path.read_text() + '{"step": 5, "ste')
    assert [s["step"] for s in load_record(path).steps] == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"holds no record\.jsonl"):
        load_record(tmp_path)


@pytest.mark.timeout(180)
def test_the_trainer_records_and_analyze_run_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lamb"
    flags = ["--algo", "lamb", "--workers", "2", "--batch-size", "4", *TINY_FLAGS]
    flags += ["--eval-interval", "50", "--no-progress", "--out", str(out)]
    assert main(["train", *flags, "--steps", "6", "--stop-after", "4"]) == 0
    assert main(["train", *flags, "--steps", "6", "--resume"]) == 0
    rec = load_record(out)
    # a resumed run continues the record: one header, steps numbered as the run counts
    assert [s["step"] for s in rec.steps] == [1, 2, 3, 4, 5, 6]
    assert rec.header["meta"]["algo"] == "lamb" and rec.world_size == 2
    assert all(s["buckets"] for s in rec.steps)  # LAMB's fp32 gradients, through DDP
    capsys.readouterr()
    study = tmp_path / "study.json"
    assert main(["analyze", "run", str(out), "--out", str(study), "--skip", "1"]) == 0
    text = capsys.readouterr().out
    assert "recorded: GPT on 2 workers (gloo, cpu), 5 steps read" in text
    assert "predicted for the recorded setting" in text and "verdict" in text
    assert json.loads(study.read_text())["recorded"]["world_size"] == 2
    # --no-record: no file, and analyze run says what to do in one line
    quiet = tmp_path / "quiet"
    q_flags = [f if f != str(out) else str(quiet) for f in flags]
    assert main(["train", *q_flags, "--steps", "2", "--no-record"]) == 0
    assert not (quiet / "record.jsonl").exists()
    assert main(["analyze", "run", str(quiet)]) == 2
    assert "holds no record.jsonl" in capsys.readouterr().err


def _comparison(path: Path, losses: dict[str, float | None], reference: str = "lamb") -> Path:
    runs = {
        label: {"algo": label.split("@")[0], "final_val_loss": loss, "summary": {"steps": 100}}
        for label, loss in losses.items()
    }
    path.write_text(json.dumps({"reference": reference, "runs": runs}))
    return path


@pytest.mark.timeout(30)
def test_the_verdict_never_recommends_a_fix_that_failed_on_this_model(tmp_path: Path) -> None:
    from thinwire.analysis.evidence import gather
    from thinwire.analysis.report import recommend, render_report

    steps = [_step(k, [0.05, 0.02]) for k in range(1, 9)]
    rec = load_record(_write(tmp_path / "record.jsonl", steps))
    # 5 MB of gradients per 0.1 s step at 0.2 Gbit/s: 1-bit is the natural fix
    plain = analyze_record(rec, bandwidth_gbps=0.2, price=False)
    _, advice = recommend(plain)
    assert "1-bit Adam / 1-bit LAMB" in advice and plain["evidence"] == {}
    cmp = _comparison(tmp_path / "c.json", {"lamb": 2.0, "onebit-lamb": 2.3, "diloco": 2.01})
    found = gather([cmp])
    assert found["onebit-optimizer"].status == "failed"
    assert "onebit-lamb ended 15.0% above lamb" in found["onebit-optimizer"].why
    assert found["localsgd"].status == "ok"
    study = analyze_record(rec, bandwidth_gbps=0.2, price=False, evidence=[cmp])
    _, advice = recommend(study)
    assert "use 1-bit Adam / 1-bit LAMB" not in advice
    assert "Not recommended here: onebit-lamb ended 15.0% above lamb (c.json)" in advice
    table = render_report(study)
    assert "1-bit Adam/LAMB (1-bit, after backward)" in table
    assert "diverged or far off here" in table
    # both 1-bit families out: compression is not the fix, Local-SGD is
    both = _comparison(tmp_path / "d.json", {"lamb": 2.0, "onebit-lamb": 2.1, "adamw-onebit": None})
    _, advice = recommend(analyze_record(rec, bandwidth_gbps=0.2, price=False, evidence=[both]))
    assert advice.startswith("Compression is not the fix: the 1-bit schemes")
    assert "Local-SGD / DiLoCo" in advice and "adamw-onebit did not finish" in advice


@pytest.mark.timeout(30)
def test_zoo_results_count_for_their_model_only(tmp_path: Path) -> None:
    from thinwire.analysis.evidence import gather

    zoo = tmp_path / "zoo.json"
    verdicts = [
        {
            "model": "relu-cnn",
            "piece": "onebit-lamb",
            "baseline": "lamb",
            "gap": 0.2,
            "passed": False,
            "excused": None,
        },
        {
            "model": "bert",
            "piece": "onebit-lamb",
            "baseline": "lamb",
            "gap": 0.01,
            "passed": True,
            "excused": None,
        },
    ]
    zoo.write_text(json.dumps({"verdicts": verdicts}))
    assert gather([zoo], "relu-cnn")["onebit-optimizer"].status == "failed"
    assert gather([zoo], "bert")["onebit-optimizer"].status == "ok"
    assert gather([zoo])["onebit-optimizer"].status == "failed"  # worst over all models
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match=r"expected a comparison\.json or zoo\.json"):
        gather([bad])


@pytest.mark.timeout(30)
def test_a_recorded_run_that_skipped_steps_ranks_its_own_fix_lower(tmp_path: Path) -> None:
    run = tmp_path / "onebit"
    run.mkdir()
    rec_path = _write(run / "record.jsonl", [_step(k, [0.05, 0.02]) for k in range(1, 9)])
    (run / "summary.json").write_text(json.dumps({"algo": "onebit-lamb", "steps": 100}))
    metrics = [{"step": 50, "skipped_steps": 1}, {"step": 100, "skipped_steps": 5}]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, metrics)) + "\n")
    study = analyze_record(load_record(rec_path), bandwidth_gbps=0.2, price=False)
    finding = study["evidence"]["onebit-optimizer"]
    assert finding["status"] == "worse"
    assert finding["why"] == "the recorded onebit-lamb run skipped 5 of 100 steps"
    # one skipped step in 100 is within the share: the run trained
    metrics[-1]["skipped_steps"] = 1
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, metrics)) + "\n")
    study = analyze_record(load_record(rec_path), bandwidth_gbps=0.2, price=False)
    assert study["evidence"]["onebit-optimizer"]["status"] == "ok"


@pytest.mark.timeout(30)
def test_the_records_own_link_is_taken_at_the_rate_its_collectives_achieved(
    tmp_path: Path,
) -> None:
    from thinwire.analysis.recorded_predict import RecordedPredictor
    from thinwire.analysis.validate_compare import Link

    steps = [_step(k, [0.05, 0.02]) for k in range(1, 8)]
    path = _write(tmp_path / "record.jsonl", steps)
    (tmp_path / "testbed_run.json").write_text(json.dumps({"testbed": {"rate": "1gbit"}}))
    achieved = 5e6 * 8 / 0.13 / 1e9  # ring of 5 MB on 2 ranks in 0.13 s
    own = RecordedPredictor.from_run(path.parent, 2, Link.nominal(1e9))
    assert own.link.bandwidth_gbps == pytest.approx(achieved)
    assert own.link.source == "achieved by the recorded run"
    # another rate, another worker count or a set latency: the link as given
    for link, workers in (
        (Link.nominal(1e8), 2),
        (Link.nominal(1e9), 4),
        (Link.nominal(1e9, 0.01), 2),
    ):
        kept = RecordedPredictor.from_run(path.parent, workers, link).link
        assert kept == link
    # the achieved link predicts the recorded setting slower than the nominal one did
    nominal = RecordedPredictor.from_run(path.parent, 2, Link.nominal(1e9, 1e-9))
    assert own.step("ddp").step_s > nominal.step("ddp").step_s


@pytest.mark.timeout(30)
def test_the_1bit_row_takes_the_timed_passes_of_a_train_run_only(tmp_path: Path) -> None:
    # A timing after a user's own loop ran stand-in arithmetic before each step: its
    # "passes" are not the job's, and the record's stay. After a ``thinwire train`` run
    # (its config.json beside the record) they are the job's own passes.
    from thinwire.analysis.recorded_predict import RecordedPredictor
    from thinwire.analysis.validate_compare import Link

    steps = [_step(k, [0.05, 0.02]) for k in range(1, 8)]
    path = _write(tmp_path / "record.jsonl", steps)
    timing = {"update_s": 0.01, "codec_s": 0.002, "wait_s": 0.0, "passes_s": 0.01}
    link = Link.nominal(1e9)
    own_loop = RecordedPredictor.from_run(path.parent, 2, link, timing)
    assert "onebit_passes_s" not in own_loop.profile.meta
    (tmp_path / "config.json").write_text("{}")
    train_run = RecordedPredictor.from_run(path.parent, 2, link, timing)
    assert train_run.profile.meta["onebit_passes_s"] == pytest.approx(0.01)
    assert train_run.step("onebit").step_s < own_loop.step("onebit").step_s
    assert train_run.step("ddp").step_s == pytest.approx(own_loop.step("ddp").step_s)
