"""The model zoo in CI: every thinwire piece, at its defaults, within 3% of its
uncompressed baseline on every zoo model that is not thinwire's GPT (tiny sizes, one seed).

The benchmark (docs/results/zoo.md, "The model zoo") runs the same code at three seeds
and a larger size; this is the regression net that keeps a piece from silently breaking
on a user's model again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire.cli.main import build_parser
from thinwire.errors import ConfigError
from thinwire.zoo import PIECES, TASKS, Job, run_jobs
from thinwire.zoo.compare import EXCEPTIONS, TOLERANCE, render, verdicts, zoo_jobs
from thinwire.zoo.loop import BASELINES
from thinwire.zoo.run import read_log

HOME = "gpt"
"""thinwire's own GPT in the zoo (the benchmark's reference row)."""


def main(argv: list[str]) -> int:
    """The command without main's error printing, so the ConfigError itself is seen."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


@pytest.mark.timeout(600)
def test_every_piece_holds_its_baseline_on_every_zoo_model() -> None:
    cnn_freeze_40 = Job(model="relu-cnn", piece="onebit-lamb", seed=7, options={"freeze_step": 40})
    # The language model at half the batch: the slowest runs of the zoo (its verdicts
    # match batch 64's, measured). thinwire's own GPT, the zoo's home row, is left to the
    # rest of the suite here (every algorithm through the train matrix, the convergence
    # tests): this net is for the models that are not ours.
    text = ["gpt2"]
    models = [m for m in TASKS if m != HOME]
    classifiers = [m for m in models if m not in text]
    jobs = (
        zoo_jobs(classifiers, PIECES, [0])
        + zoo_jobs(text, PIECES, [0], batch_size=32)
        + [
            Job(model="relu-cnn", piece="lamb", seed=7),
            cnn_freeze_40,
        ]
    )
    results = run_jobs(jobs)
    items = verdicts([r for r in results if r.seed == 0])
    print(table := render(items))
    assert len(items) == len(models) * sum(1 for b in BASELINES.values() if b), table
    assert all(v.ok for v in items), table
    assert all(v.skipped_steps == 0 for v in items), table
    for v in items:
        if v.piece.startswith("onebit"):
            # total_steps=150: compressing from step 46 at the latest (3x fewer bytes),
            # unless the freeze went stale, which it says
            stale = any("went stale" in line for line in v.notes)
            assert stale or (v.bytes_ratio > 2.5 and min(v.compressed_steps) >= 100), table
    assert {(v.model, v.piece) for v in items if not v.passed} <= set(EXCEPTIONS), table
    # The report's ReLU CNN with a fixed freeze at step 40 (the blow-up the floor fixes).
    lamb, fixed = results[-2], results[-1]
    assert fixed.freeze_step == 40 and fixed.skipped_steps == 0
    assert fixed.metrics["accuracy"] >= (1 - TOLERANCE) * lamb.metrics["accuracy"]


@pytest.mark.timeout(300)
def test_an_interrupted_benchmark_finishes_from_its_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "runs.jsonl"
    first = [
        Job(model="relu-mlp", piece="adamw", steps=10),
        Job(model="relu-mlp", piece="lamb", steps=10),
    ]
    done = run_jobs(first, log=log)
    assert [json.loads(x)["job"]["piece"] for x in log.read_text().splitlines()] == [
        "adamw",
        "lamb",
    ]
    # a run killed mid-write leaves half a line: skipped, counted, its job run again
    lines = log.read_text().splitlines()
    log.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2] + "\n")
    more = [*first, Job(model="relu-mlp", piece="lamb", steps=10, seed=1)]
    again = run_jobs(more, log=log, progress=True)
    assert "1 run(s) already in" in capsys.readouterr().err
    assert again[0] == done[0]  # from the log, not trained again (its seconds would differ)
    assert again[1].metrics == done[1].metrics  # trained again, deterministically
    assert [r.seed for r in again] == [0, 0, 1]
    assert len(read_log(log)) == 3


def test_bench_zoo_refuses_to_mix_benchmarks_in_one_out(tmp_path: Path) -> None:
    (tmp_path / "runs.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"already holds a zoo benchmark .*--resume"):
        main(["bench", "zoo", "--out", str(tmp_path), "--models", "relu-mlp", "--pieces", "adamw"])
    with pytest.raises(ConfigError, match="--resume needs the --out"):
        main(["bench", "zoo", "--resume"])
