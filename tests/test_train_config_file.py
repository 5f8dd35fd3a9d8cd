"""``thinwire train --config FILE``: settings from a file, flags over the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire.cli.main import build_parser
from thinwire.cli.train import config_from_args
from thinwire.errors import ConfigError
from thinwire.io import INPUT_LIMIT
from thinwire.train.algorithms import default_lr
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import read_config_file, write_config_file


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
    cfg = TrainConfig(algo="async-diloco", slowdown=(1.0, 2.0), extra={"k": 1}, freeze_step=7)
    path = write_config_file(cfg, tmp_path / "c.json")
    assert TrainConfig.from_dict(read_config_file(path)) == cfg
    assert _config("--config", str(path)) == cfg


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
        ("a.json", '{"extra": {"powersgd_rank": "x"}}', "extra.powersgd_rank must be a whole"),
        ("a.json", '{"extra": {"powersgd_rank": -5}}', r"powersgd_rank must be in \[1, 1024\]"),
        ("a.json", '{"extra": {"powersgd_rank": 0}}', r"powersgd_rank must be in \[1, 1024\]"),
        ("a.json", '{"extra": {"junk": 1}}', "extra: unknown key 'junk'"),
        ("a.json", '{"extra": {"bias_correction": 1}}', "bias_correction must be true or false"),
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
