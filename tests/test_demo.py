"""``thinwire demo`` end to end on tiny settings (loopback; the testbed path is covered by
the testbed experiment tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire.cli.main import main
from thinwire.workflow.demo import DemoSettings, _prepare_out


@pytest.mark.timeout(300)
def test_demo_tells_the_whole_story(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    args = [
        "demo",
        "--no-testbed",
        "--workers",
        "2",
        "--steps",
        "10",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    for needle in (
        "Is the network the bottleneck",
        "verdict",
        "1-bit LAMB",
        "final validation loss",
        "bytes sent per worker",
        "samples/s, after freeze",
        "Training with LAMB on 2 local workers",
        "LAMB's own record, analyzed",
        "reductions priced by: measured on cpu",
        "step after freeze, predicted",
        "step after freeze, measured",
        # where the 1-bit step went, timed before the run and in the run itself
        "1-bit LAMB's step timed before: update",
        "1-bit LAMB's step in its run: update",
    ):
        assert needle in text, needle
    result = json.loads((out / "demo.json").read_text())
    lamb, onebit = result["runs"]
    assert (lamb["algo"], onebit["algo"]) == ("lamb", "onebit-lamb")
    # freeze at 2 of 10 steps: 1-bit sends far less than LAMB's fp32 allreduce
    assert onebit["comm_bytes"] < lamb["comm_bytes"] / 3
    assert (out / "demo.png").stat().st_size > 10_000
    assert (out / "study.json").exists()
    # the analysis read LAMB's own record: its workers, its buckets
    study = json.loads((out / "study.json").read_text())
    assert study["recorded"]["world_size"] == 2
    assert study["record_path"].endswith("train/lamb/record.jsonl")
    assert all(r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 for r in result["runs"])
    for run in (lamb, onebit):
        assert run["predicted_step_s"] > 0 and run["measured_step_s"] > 0
    split = result["onebit_step"]
    assert split["in_the_run"]["wait_s"] >= 0 and split["in_the_run"]["steps"] >= 2
    assert split["timed_before"]["update_s"] > 0
    # a second demo replaces the first one's output; a foreign directory is refused
    _prepare_out(out)
    assert not (out / "demo.json").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main([*args[:-1], str(foreign)]) == 2
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.mark.root
@pytest.mark.timeout(300)
def test_demo_on_the_testbed_predicts_both_rows_from_the_lamb_record(tmp_path: Path) -> None:
    """The testbed path: LAMB recorded on 2 emulated hosts, its record analyzed at the
    hosts' rate, 1-bit LAMB's step timed on the same cluster, then 1-bit LAMB."""
    from thinwire.testbed import unavailable_reason
    from thinwire.workflow import DemoSettings, run_demo

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "demo"
    lines: list[str] = []
    settings = DemoSettings(
        workers=2,
        rate="1gbit",
        steps=10,
        batch_size=4,
        out=str(out),
        seq_len=16,
        n_layer=1,
        n_embd=32,
        n_head=2,
    )
    result = run_demo(settings, echo=lines.append)
    text = "\n".join(lines)
    assert result["where"] == "2 emulated hosts on 1gbit links"
    assert "LAMB's own record, analyzed" in text and "bytes on each host's NIC" in text
    # 1-bit LAMB's step was timed on the cluster's hosts, on the job's own parameters
    timed = json.loads((out / "onebit-step" / "optimizer.json").read_text())
    assert len(timed["ranks"]) == 2 and timed["summary"]["exchange_s"] > 0
    head = json.loads((out / "train" / "lamb" / "record.jsonl").read_text().splitlines()[0])
    assert 4 * sum(timed["numels"]) == sum(p["nbytes"] for p in head["params"])
    lamb, onebit = result["runs"]
    assert lamb["nic_bytes"] and onebit["nic_bytes"]  # read back, LAMB kept its counters
    for row in result["runs"]:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0


def test_the_demo_runs_one_worker_per_core_by_default() -> None:
    from thinwire.workflow.demo import DEMO_MAX_WORKERS, default_workers, workers_line

    assert [default_workers(c) for c in (1, 2, 3, 4, 16)] == [2, 2, 3, 4, DEMO_MAX_WORKERS]
    assert default_workers() >= 2
    cfg = DemoSettings(steps=20).train_config()  # None resolves before the checks
    assert cfg.steps == 20
    # it says how it chose, or that the workers asked for share the cores
    assert workers_line(None, 2, 2) == (
        "(2 workers: one per core of this machine's 2, at most 4; --workers N to choose)"
    )
    assert workers_line(4, 4, 2).startswith("note: 4 workers share this machine's 2 cores")
    assert workers_line(2, 2, 2) is None
