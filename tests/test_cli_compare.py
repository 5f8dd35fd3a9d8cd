"""``thinwire compare`` on local workers, the command tree (seven top-level commands, the
modes of ``compare``), and the old spellings that still work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import build_parser, main

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
        # a setting given for one run that its algorithm never reads
        (["compare", "--algos", "lamb@freeze_step=3"], "lamb does not use freeze_step"),
        (
            ["compare", "--algos", "sync@compress=onebit,error_feedback=false"],
            "async-diloco does not use error_feedback",
        ),
        # checked before any process starts: a 16-bit cast has no rounding to carry
        (
            ["compare", "--algos", "diloco@compress=bf16,error_feedback=false"],
            "turning it off with compress 'bf16' changes nothing",
        ),
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
        ["compare", "--async"],
        ["compare", "--testbed"],
        ["testbed", "sweep"],
        ["testbed", "probe"],
        ["analyze", "validate"],
        ["bench", "native", "status"],
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
    assert "usage: thinwire bench native status" in capsys.readouterr().out


def _help(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _listed(help_text: str) -> list[str]:
    """The subcommands a --help lists: the indented names under the COMMAND/VERB line."""
    block = help_text.split("positional arguments:")[1].split("options:")[0]
    return re.findall(r"^    (\S+)", block, flags=re.MULTILINE)


def test_thinwire_help_lists_at_most_seven_commands(capsys: pytest.CaptureFixture) -> None:
    listed = _listed(_help([], capsys))
    assert listed == ["train", "compare", "demo", "testbed", "analyze", "bench", "simulate"]
    assert len(listed) <= 7
    assert _listed(_help(["analyze"], capsys)) == [
        "validate",
        "profile",
        "fit",
        "what-if",
        "run",
        "report",
    ]
    assert "native" in _listed(_help(["bench"], capsys))
    assert "compare" not in _listed(_help(["testbed"], capsys))
    simulate = _help(["simulate"], capsys)
    assert "async" not in simulate.split("\n\n")[0] and "--methods" in simulate  # usage
    compare = _help(["compare"], capsys)
    assert "thinwire compare --async --methods" in compare and "--testbed" in compare


OLD_SPELLINGS = [
    # (old command line, new command line, the note the old one prints)
    (
        ["compare-async"],
        ["compare", "--async"],
        "'thinwire compare-async' is now 'thinwire compare --async'",
    ),
    (
        ["native", "build", "packing"],
        ["bench", "native", "build", "packing"],
        "'thinwire native' is now 'thinwire bench native'",
    ),
    (
        ["native", "status"],
        ["bench", "native", "status"],
        "'thinwire native' is now 'thinwire bench native'",
    ),
    (
        ["testbed", "compare", "--algos", "lamb", "--hosts", "2"],
        ["compare", "--testbed", "--algos", "lamb", "--hosts", "2"],
        "'thinwire testbed compare' is now 'thinwire compare --testbed'",
    ),
    (
        ["analyze", "bench", "--max-bytes", "1M"],
        ["analyze", "fit", "--max-bytes", "1M"],
        "'thinwire analyze bench' is now 'thinwire analyze fit'",
    ),
    (
        ["analyze", "simulate", "p.json"],
        ["analyze", "what-if", "p.json"],
        "'thinwire analyze simulate' is now 'thinwire analyze what-if'",
    ),
    (
        ["simulate", "async", "--methods", "dn"],
        ["simulate", "--methods", "dn"],
        "'thinwire simulate async' is now 'thinwire simulate'",
    ),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("old", "new", "note"), OLD_SPELLINGS)
def test_an_old_spelling_is_the_new_command_with_a_note(
    old: list[str], new: list[str], note: str, capsys: pytest.CaptureFixture
) -> None:
    """Hidden, but it parses to the same function with the same options, after saying
    its new spelling in one line on stderr (the new spelling says nothing)."""
    parser = build_parser()
    was, now = parser.parse_args(old), parser.parse_args(new)
    assert capsys.readouterr().err == f"thinwire: {note}\n"
    assert was.func is now.func
    # the same options with the same values; only the names of the verbs differ
    verbs = {"command", "verb", "bench_command", "simulate_command"}
    assert {k: v for k, v in vars(was).items() if k not in verbs} == {
        k: v for k, v in vars(now).items() if k not in verbs
    }


@pytest.mark.timeout(30)
def test_old_spellings_still_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Not just parsed: each runs, note first, and fails the same way as its new spelling
    on the same bad input (the quickest way to run them all without minutes of training)."""
    for old, new in (
        (["compare-async", "--methods", "fedavg"], ["compare", "--async", "--methods", "fedavg"]),
        (["native", "build", "nope"], ["bench", "native", "build", "nope"]),
        (["analyze", "bench", "--max-bytes", "nan"], ["analyze", "fit", "--max-bytes", "nan"]),
        (
            ["analyze", "simulate", str(tmp_path / "none.json")],
            ["analyze", "what-if", str(tmp_path / "none.json")],
        ),
        (["simulate", "async", "--methods", ","], ["simulate", "--methods", ","]),
    ):
        out = ["--out", str(tmp_path / "o")] if old[0] in ("compare-async", "simulate") else []
        assert main([*new, *out]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert main([*old, *out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith("thinwire: 'thinwire ") and " is now " in err[0]
        assert err[1:] == said


def test_compare_modes_pick_their_own_parser(capsys: pytest.CaptureFixture) -> None:
    from thinwire.cli import async_compare, compare, testbed_tools

    parser = build_parser()
    assert parser.parse_args(["compare", "--algos", "lamb"]).func is compare._main
    run_async = async_compare.run_async_compare
    both = parser.parse_args(["compare", "--testbed", "--async", "--methods", "dn"])
    assert both.func is run_async and both.testbed and both.methods == "dn"
    testbed = parser.parse_args(["compare", "--algos", "lamb", "--testbed", "--rates", "1gbit"])
    assert testbed.func is testbed_tools.run_testbed_compare and testbed.rates == ["1gbit"]
    # after "--", train's flags: a --testbed there is not the mode switch
    args = parser.parse_args(["compare", "--async", "--", "--testbed"])
    assert args.func is run_async and args.train_flags == ["--", "--testbed"]
    assert capsys.readouterr().err == ""
    # a mode flag cut short is refused, not taken as the flag and ignored
    with pytest.raises(SystemExit):
        parser.parse_args(["compare", "--asy", "--methods", "dn"])
    assert "write it in full: --async" in capsys.readouterr().err


def test_an_unknown_command_lists_only_the_commands_of_the_help(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare-sync"])
    err = capsys.readouterr().err
    assert "'simulate'" in err and "compare-async" not in err and "'native'" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--testbed", "--slowdown", "1,2", "--hosts", "4"], "--hosts must be 3"),
        (["--delay", "10ms"], "--delay needs the testbed"),
        (["--testbed", "--rates", "100mbit,1gbit"], "one link rate"),
    ],
)
def test_compare_async_checks_its_testbed_options_first(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Refused in one line before any cluster comes up, so this needs no root."""
    assert main(["compare", "--async", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
