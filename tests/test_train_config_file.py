"""``thinwire train --config FILE``: settings from a file, flags over the file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import build_parser
from thinwire.cli.train import config_from_args
from thinwire.cli.train_config import _FIELD_OF
from thinwire.errors import ConfigError
from thinwire.io import INPUT_LIMIT
from thinwire.train.algorithms import default_lr
from thinwire.train.config import FILE_ONLY, TrainConfig
from thinwire.train.config_file import read_config_file, write_config_file

_EXTRA_GONE = (
    "extra is no longer read: powersgd_rank, powersgd_start and bias_correction are "
    "settings of their own"
)


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_file_sets_fields_and_typed_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('algo = "onebit-lamb"\nsteps = 600\nbetas = [0.8, 0.99]\nseed = 4\n')
    cfg = _config("--config", str(path))
    assert (cfg.algo, cfg.steps, cfg.betas, cfg.seed) == ("onebit-lamb", 600, (0.8, 0.99), 4)
    # Defaults that follow the algorithm follow the file's algorithm.
    assert cfg.lr == default_lr("onebit-lamb") and cfg.out_dir == "runs/onebit-lamb"
    # A flag typed beside the file wins, even when it equals the flag's own default.
    assert TrainConfig.steps == 300
    over = _config("--config", str(path), "--steps", "300", "--algo", "lamb")
    assert (over.steps, over.algo, over.seed) == (300, "lamb", 4)
    assert over.lr == default_lr("lamb")
    # Order does not matter: flags before --config win as well.
    assert _config("--steps", "300", "--config", str(path)).steps == 300


def test_written_config_reads_back_identical(tmp_path: Path) -> None:
    cfg = TrainConfig(
        algo="async-diloco",
        slowdown=(1.0, 2.0),
        powersgd_rank=2,
        bias_correction=False,
        freeze_step=7,
    )
    path = write_config_file(cfg, tmp_path / "c.json")
    assert TrainConfig.from_dict(read_config_file(path)) == cfg
    assert _config("--config", str(path)) == cfg


def test_an_old_extra_is_refused_in_one_line_unless_empty(tmp_path: Path) -> None:
    """``extra`` once held powersgd_rank, powersgd_start and bias_correction (and before
    them settings such as ``sync``). A file or dict that still sets it would train with
    the defaults it meant to change, so it is refused in one line; an empty one, which
    every config.json written before holds, sets nothing and still reads."""
    old = TrainConfig(algo="adamw-powersgd").to_dict() | {"extra": {}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert _config("--config", str(path)) == TrainConfig(algo="adamw-powersgd")
    assert TrainConfig.from_dict(old) == TrainConfig(algo="adamw-powersgd")
    for extra in ({"powersgd_rank": 2}, {"bias_correction": False}, {"sync": True}):
        path.write_text(json.dumps({**old, "extra": extra}))
        with pytest.raises(ConfigError, match=_EXTRA_GONE) as from_file:
            _config("--config", str(path))
        with pytest.raises(ConfigError, match=_EXTRA_GONE) as from_dict:
            TrainConfig.from_dict({**old, "extra": extra})
        assert "\n" not in str(from_file.value) + str(from_dict.value)


def test_powersgd_and_bias_correction_flags_over_the_file_over_defaults(tmp_path: Path) -> None:
    def knobs(cfg: TrainConfig) -> tuple[int, int, bool]:
        return cfg.powersgd_rank, cfg.powersgd_start, cfg.bias_correction

    assert knobs(_config()) == (4, 10, True)
    flags = ("--powersgd-rank", "2", "--powersgd-start", "0", "--no-bias-correction")
    assert knobs(_config(*flags)) == (2, 0, False)
    path = tmp_path / "run.toml"
    path.write_text("powersgd_rank = 8\npowersgd_start = 20\nbias_correction = false\n")
    assert knobs(_config("--config", str(path))) == (8, 20, False)
    # A flag typed beside the file wins, even when it equals its default.
    typed = _config("--config", str(path), "--powersgd-rank", "4", "--bias-correction")
    assert knobs(typed) == (4, 20, True)


def _train_flags() -> tuple[dict[str, str], set[str]]:
    """Each ``thinwire train`` option that sets a TrainConfig field (its destination to
    the field), and the destinations :func:`config_from_args` reads."""
    read: set[str] = set()

    class Reads(argparse.Namespace):
        def __getattribute__(self, name: str) -> Any:
            read.add(name)
            return super().__getattribute__(name)

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    args = parser.parse_args(["train"], namespace=Reads())
    read.clear()  # argparse looks at every destination while it fills them in
    config_from_args(args)
    names = {f.name for f in fields(TrainConfig)}
    dests = (a.dest for a in sub.choices["train"]._actions)
    return {d: _FIELD_OF.get(d, d) for d in dests if _FIELD_OF.get(d, d) in names}, read


def test_every_field_has_a_flag_or_is_file_only() -> None:
    """Every TrainConfig field is set by a ``thinwire train`` flag (and so by ``thinwire
    compare``'s), or listed in FILE_ONLY; a field that gains a flag leaves the list."""
    names = [f.name for f in fields(TrainConfig)]
    field_of, read = _train_flags()
    flagged = set(field_of.values())
    assert [n for n in names if n not in flagged and n not in FILE_ONLY] == []
    assert [n for n in FILE_ONLY if n in flagged] == []
    assert set(FILE_ONLY) <= set(names) and len(set(FILE_ONLY)) == len(FILE_ONLY)
    # Each such flag is read into the config, not only parsed.
    assert sorted(d for d in field_of if d not in read) == []


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.json", '{"stesp": 3}', "unknown setting 'stesp'"),
        ("a.json", '{"steps": "3"}', "steps must be int"),
        ("a.json", '{"steps": true}', "steps must be int"),
        ("a.json", '{"lr": [1]}', "lr must be float"),
        ("a.json", "[1, 2]", "expected a table of settings"),
        ("a.json", "{", "not valid JSON"),
        ("a.toml", "x =", "not valid TOML"),
        ("a.yaml", "steps: 3", "expected a .json or .toml file"),
        ("a.json", '{"betas": [0.9, 0.99, 0.999]}', "betas must be two numbers"),
        ("a.json", '{"betas": []}', "betas must be two numbers"),
        ("a.json", '{"betas": [0.9]}', "betas must be two numbers"),
        ("a.toml", "betas = [0.9, 0.99, 0.999]", "betas must be two numbers"),
        ("a.json", '{"powersgd_rank": "x"}', "powersgd_rank must be int"),
        ("a.json", '{"powersgd_rank": 2.0}', "powersgd_rank must be int"),
        ("a.json", '{"powersgd_rank": -5}', r"powersgd-rank must be in \[1, 1024\]"),
        ("a.json", '{"powersgd_rank": 0}', r"powersgd-rank must be in \[1, 1024\]"),
        ("a.json", '{"powersgd_rank": 1025}', r"powersgd-rank must be in \[1, 1024\]"),
        ("a.json", '{"powersgd_start": -1}', "powersgd-start must be >= 0"),
        ("a.json", '{"powersgd_start": 1' + "0" * 20 + "}", "powersgd_start is out of range"),
        ("a.json", '{"bias_correction": 1}', "bias_correction must be bool"),
        ("a.json", '{"extra": {"powersgd_rank": 2}}', _EXTRA_GONE),
        ("a.json", '{"extra": {"junk": 1}}', _EXTRA_GONE),
        ("a.toml", "[extra]\nbias_correction = false", _EXTRA_GONE),
        ("a.json", '{"steps": 1e999}', "steps must be int"),
        ("a.json", '{"lr": NaN}', r"lr must be a number in \(0, inf\), got nan"),
        ("a.json", '{"lr": 1' + "0" * 30 + "}", "lr is out of range"),
        ("a.json", '{"steps": 1' + "0" * 5000 + "}", "not valid JSON: Exceeds the limit"),
        ("a.json", "[" * 100_000, "nested too deeply"),
        ("a.json", '{"seed": -1' + "0" * 20 + "}", "seed is out of range"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        _config("--config", str(path)).validate()  # what thinwire train does first
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: p.write_bytes(b'{"algo": "\xff"}'),
            "is not UTF-8 text (byte 0xff at offset 10)",
        ),
        (lambda p: p.mkdir(), "is a directory, not a regular file"),
        (lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),  # never opened: no hang
        (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
        (lambda p: p.write_bytes(b" " * (INPUT_LIMIT + 1)), "more than the 16777216 allowed"),
    ],
)
def test_config_files_that_are_not_settings_are_one_line(
    tmp_path: Path, make: Callable[[Path], object], message: str
) -> None:
    path = tmp_path / "c.json"
    make(path)
    with pytest.raises(ConfigError) as err:
        _config("--config", str(path))
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value) and str(err.value).startswith("--config: ")


def test_proc_files_are_named_for_what_they_are(tmp_path: Path) -> None:
    """/proc files report size 0; they are read to the cap like any other, and their
    error says what is wrong with them, never that they are missing."""
    with pytest.raises(ConfigError) as err:
        read_config_file("/proc/self/status")
    assert "expected a .json or .toml file" in str(err.value)
    with pytest.raises(ConfigError) as err:
        read_config_file("/proc/self")
    assert "is a directory" in str(err.value) and "missing" not in str(err.value)


def test_missing_file_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "thinwire", "train", "--config", str(tmp_path / "no.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--config: no such file" in proc.stderr


@pytest.mark.timeout(120)
def test_a_run_repeats_from_its_config_json(tmp_path: Path) -> None:
    """Every run keeps its resolved settings; handing them back trains the same run."""
    from thinwire.cli.main import main

    tiny = TINY_FLAGS
    common = ["--workers", "1", "--steps", "4", "--batch-size", "2", "--eval-interval", "4"]
    common += ["--eval-sequences", "4", "--checkpoint-interval", "0", "--no-progress"]
    assert main(["train", "--algo", "lamb", *tiny, *common, "--out", str(tmp_path / "a")]) == 0
    saved = tmp_path / "a" / "config.json"
    first = json.loads(saved.read_text())
    assert first["algo"] == "lamb" and first["n_embd"] == 32 and first["resume"] is False
    # --workers is how the run is launched, not a setting of the run: it is given again.
    again = ["train", "--config", str(saved), "--workers", "1", "--out", str(tmp_path / "b")]
    assert main(again) == 0
    second = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {**second, "out_dir": None} == {**first, "out_dir": None}
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert a["final_val_loss"] == b["final_val_loss"]


def test_print_config_is_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from thinwire.cli.main import main

    assert main(["train", "--algo", "onebit-adam", "--steps", "50", "--print-config"]) == 0
    path = tmp_path / "p.json"
    path.write_text(capsys.readouterr().out)
    assert _config("--config", str(path)) == _config("--algo", "onebit-adam", "--steps", "50")


def test_a_trained_start_picks_lambs_trained_lr_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from thinwire.cli.compare import base_and_lrs
    from thinwire.train.algorithms import TRAINED_LR

    assert TRAINED_LR["lamb"] < default_lr("lamb")  # the long tier's lr is lower
    assert _config("--algo", "lamb", "--pretrain-steps", "10").lr == TRAINED_LR["lamb"]
    assert _config("--algo", "lamb").lr == default_lr("lamb")  # from scratch: unchanged
    assert _config("--algo", "adamw", "--pretrain-steps", "10").lr == default_lr("adamw")
    assert _config("--algo", "lamb", "--pretrain-steps", "10", "--lr", "0.003").lr == 0.003
    path = tmp_path / "run.toml"
    path.write_text('algo = "onebit-lamb"\npretrain_steps = 10\n')
    assert _config("--config", str(path)).lr == TRAINED_LR["onebit-lamb"]
    # compare: each algorithm at its trained-start lr, with one line per algorithm.
    argv = ["compare", "--algos", "lamb", "onebit-lamb@freeze_step=5", "adamw"]
    args = build_parser().parse_args([*argv, "--pretrain-steps", "10"])
    _, lrs = base_and_lrs(args)
    assert lrs == {"lamb": 0.01, "onebit-lamb": 0.01, "adamw": default_lr("adamw")}
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and all("starts from a trained model" in line for line in said)
    _, lrs = base_and_lrs(build_parser().parse_args(argv))
    assert lrs is not None and lrs["lamb"] == default_lr("lamb")
    assert capsys.readouterr().err == ""
