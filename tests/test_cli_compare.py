"""``thinwire compare`` on local workers, and the commands that moved under ``thinwire``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import main

TINY = TINY_FLAGS


@pytest.mark.timeout(180)
def test_compare_writes_result_table_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", "--algos", "lamb", "onebit-lamb@freeze_step=3", "--workers", "2"]
    argv += ["--steps", "8", "--batch-size", "2", "--warmup-steps", "2", "--eval-interval", "4"]
    argv += ["--eval-sequences", "4", "--checkpoint-interval", "0", "--log-interval", "1"]
    assert main([*argv, *TINY, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "lamb (ref)" in table and "speed-up after freeze" in table
    result = json.loads((out / "comparison.json").read_text())
    assert result["command"].startswith("thinwire compare --algos lamb")
    assert result["where"] == {"kind": "local"}
    lamb, onebit = result["runs"].values()
    assert [s for s, _ in lamb["val"]] == [0, 16, 32]  # 2 workers x 2 sequences x 4 steps
    assert len(lamb["val_time"]) == 3 and lamb["val_time"][-1][0] > 0
    assert onebit["stages"]["compression"]["steps"] == 5 and onebit["freeze_step"] == 3
    assert onebit["bytes_reduction"] > 1.5
    assert (out / "comparison.png").stat().st_size > 0
    # The same --out again is refused, with one line, unless --overwrite.
    assert main([*argv, *TINY, "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["testbed", "sweep", "--mib", "0"], "sizes must be > 0"),
        (["testbed", "sweep", "--mib", "a,b"], "expected MiB"),
        (["compare", "--algos", "sgd"], "sgd"),
        (["compare", "--algos", "lamb@nope=1"], "nope=1"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_probe_outside_a_group_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["testbed", "probe"]) == 2
    assert "thinwire testbed run" in capsys.readouterr().err


def test_every_command_is_under_thinwire(capsys: pytest.CaptureFixture) -> None:
    for argv in (
        ["compare"],
        ["compare-async"],
        ["testbed", "compare"],
        ["testbed", "sweep"],
        ["testbed", "probe"],
        ["analyze", "validate"],
        ["native", "status"],
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
    assert "usage: thinwire native status" in capsys.readouterr().out
