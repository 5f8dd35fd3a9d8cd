"""Bad input to every command: one line on stderr, exit status 2, nothing half-done.

Each case of issue 15's "accepted nonsense" and "raw tracebacks" lists (the non-async
ones) is here, run in-process through the real command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS
from thinwire.analysis import ParamTiming, Profile, save_profile
from thinwire.cli.main import main
from thinwire.errors import ConfigError

SMALL = [
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--eval-sequences",
    "4",
    "--no-progress",
    "--workers",
    "1",
]


def _error(args: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    assert main(args) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("thinwire: error: "), err
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "nan"], "lr must be a number in (0, inf), got nan"),
        (["--lr", "inf"], "lr must be a number in (0, inf), got inf"),
        (["--lr", "-1"], "lr must be a number"),
        (["--weight-decay", "-1"], "weight-decay must be a number in [0, inf), got -1"),
        (["--grad-clip", "nan"], "grad-clip must be a number in [0, inf), got nan"),
        (["--algo", "diloco", "--outer-lr", "0"], "outer-lr must be a number in (0, inf), got 0"),
        (["--algo", "diloco", "--outer-lr", "-1"], "outer-lr must be a number"),
        (["--algo", "diloco", "--outer-momentum", "-1"], "outer-momentum must be a number"),
        (
            ["--algo", "diloco", "--outer-momentum", "2"],
            "outer-momentum must be a number in [0, 1)",
        ),
        (
            ["--algo", "onebit-adam", "--steps", "60", "--freeze-step", "61"],
            "freeze-step 61 is past steps 60: onebit-adam would never compress",
        ),
        (["--algo", "async-diloco"], "asynchronous Local-SGD needs at least 2 ranks"),
        (["--algo", "onebit-lamb", "--freeze-step", "0"], "freeze-step must be 'auto' or a step"),
        (["--algo", "onebit-lamb", "--freeze-cap", "0"], "freeze-cap must be a number in (0, 1]"),
        (["--algo", "onebit-lamb", "--freeze-cap", "1.5"], "freeze-cap must be a number"),
        (["--algo", "onebit-adam", "--freeze-tolerance", "nan"], "freeze-tolerance must be"),
        (["--algo", "onebit-adam", "--freeze-tolerance", "-1"], "freeze-tolerance must be"),
        (
            ["--timeout", "nan"],
            "--timeout must be seconds in (0, 31536000] (a year at most), got nan",
        ),
        (["--timeout", "1e30"], "--timeout must be seconds in (0, 31536000]"),
        (["--timeout", "0"], "--timeout must be seconds in (0, 31536000]"),
        (["--timeout", "-5"], "--timeout must be seconds in (0, 31536000]"),
        (
            ["--algo", "adamw-onebit", "--freeze-step", "99999"],
            "freeze-step 99999 is past steps 4: adamw-onebit would never compress",
        ),
        (
            ["--algo", "adamw-onebit-sync", "--freeze-step", "5"],
            "freeze-step 5 is past steps 4: adamw-onebit-sync would never compress",
        ),
    ],
)
def test_nonsense_hyperparameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    out = tmp_path / "run"
    err = _error(["train", *SMALL, "--steps", "4", *flags, "--out", str(out)], capsys)
    assert message in err
    assert not out.exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for machines without CUDA")
@pytest.mark.parametrize("workers", ["1", "2"])
def test_device_cuda_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str
) -> None:
    args = ["train", *SMALL, "--workers", workers, "--device", "cuda", "--out", str(tmp_path)]
    assert "CUDA is not available" in _error(args, capsys)


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_unwritable_out_of_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    bad = str(afile if where == "file" else afile / "sub")
    commands = [
        ["train", *SMALL, "--steps", "2", "--out", bad],
        ["demo", "--steps", "2", "--out", bad, "--no-testbed"],
        ["simulate", "--steps", "2", "--out", bad],
        ["bench", "allreduce", "--workers", "2", "--out", bad],
        ["analyze", "report", str(tmp_path / "absent.json"), "--plots", bad],
        ["testbed", "run", "--logs", bad, "--", "true"],
    ]
    for args in commands:
        err = _error(args, capsys)
        assert "not a directory" in err.lower() or "cannot write" in err, (args, err)
    assert afile.read_text() == "not a directory"


def test_analyze_output_that_is_a_directory_or_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (tmp_path, afile / "p.json"):
        for verb in (["profile", "--steps", "1"], ["fit"]):
            err = _error(["analyze", *verb, "-o", str(out)], capsys)
            assert "is a directory" in err or "is a file" in err, err


def _profile(tmp_path: Path, params: list[ParamTiming] | None = None) -> Path:
    prof = Profile(
        model="m",
        iteration_s=0.1,
        backward_s=0.05,
        params=params if params is not None else [ParamTiming("w", 0, 4_000_000, ready_s=0.02)],
    )
    return save_profile(prof, tmp_path / "profile.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe\x00", "not UTF-8 text"),
        (b"null", "not a thinwire"),
        (b"[1, 2]", "not a thinwire"),
        (b'{"format": 3}', "not a thinwire"),
        (b"{", "not valid JSON"),
    ],
)
def test_analyze_json_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    prof = _profile(tmp_path)
    out = str(tmp_path / "s.json")
    assert message in _error(["analyze", "what-if", str(bad), "-o", out], capsys)
    assert message in _error(["analyze", "report", str(bad)], capsys)
    link = ["analyze", "what-if", str(prof), "--link", str(bad), "-o", out]
    assert message in _error(link, capsys)


def test_analyze_wrongly_typed_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path)
    sim = tmp_path / "sim.json"
    assert main(["analyze", "what-if", str(prof), "--reduction", "none", "-o", str(sim)]) == 0
    capsys.readouterr()
    good = json.loads(sim.read_text())
    for key in ("profile", "result", "needed", "alternatives", "sweeps", "buckets", "target"):
        for value in (None, "x"):
            (tmp_path / "t.json").write_text(json.dumps(good | {key: value}))
            assert key in _error(["analyze", "report", str(tmp_path / "t.json")], capsys)
    (tmp_path / "t.json").write_text(json.dumps(good | {"result": {"step_s": "x"}}))
    assert "malformed simulation" in _error(["analyze", "report", str(tmp_path / "t.json")], capsys)
    for fit in (None, {"bandwidth_gbps": "fast", "alpha_per_message_s": 0}, {}):
        link = tmp_path / "link.json"
        link.write_text(json.dumps({"format": "thinwire.link/1", "fit": fit}))
        args = ["analyze", "what-if", str(prof), "--link", str(link), "-o", str(sim)]
        assert "fit" in _error(args, capsys)
    raw = json.loads(prof.read_text())
    for meta in ("x", {"onebit_codec_s_per_byte": "y"}, {"add_cost": 3}):
        (tmp_path / "p.json").write_text(json.dumps(raw | {"meta": meta}))
        args = ["analyze", "what-if", str(tmp_path / "p.json"), "-o", str(sim)]
        assert "meta" in _error(args, capsys)


def test_a_model_with_nothing_to_communicate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No gradient at all: the answer is "nothing to communicate", not a 100% scaling
    factor that reads as a verdict on the network."""
    for params in ([], [ParamTiming("frozen", 0, 4000, ready_s=None)]):
        prof = _profile(tmp_path, params)
        sim = tmp_path / "s.json"
        assert main(["analyze", "what-if", str(prof), "--reduction", "none", "-o", str(sim)]) == 0
        out = capsys.readouterr().out
        assert "nothing to communicate" in out and "scaling factor" not in out
        assert main(["analyze", "report", str(sim)]) == 0
        assert "there is nothing to communicate" in capsys.readouterr().out


def test_memory_estimates_refuse_absurd_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "p.json")
    err = _error(["analyze", "profile", "--batch-size", "100000", "-o", out], capsys)
    assert "GiB of memory" in err and "smaller --batch-size" in err
    err = _error(["analyze", "fit", "--max-bytes", "65536G", "-o", out], capsys)
    assert "GiB of memory" in err and "smaller --max-bytes" in err
    assert not Path(out).exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--methods", ","], "--methods needs at least one"),
        (["--jitter", "nan"], "--jitter must be a number >= 0, got nan"),
        (["--lr", "0"], "--lr must be a number > 0, got 0"),
        (["--warmup-steps", "-1"], "--warmup-steps must be a number >= 0, got -1"),
        (["--outer-momentum", "2"], "--outer-momentum must be a number in [0, 1)"),
    ],
)
def test_simulate_async_nonsense(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    args = ["simulate", "--steps", "2", *flags, "--out", str(tmp_path / "s")]
    assert message in _error(args, capsys)


@pytest.mark.parametrize("rate", ["0", "0mbit", "0.0gbit"])
def test_testbed_rate_zero_is_not_unlimited(capsys: pytest.CaptureFixture[str], rate: str) -> None:
    err = _error(["testbed", "run", "--rate", rate, "--", "true"], capsys)
    assert "is zero" in err or "needs root" in err


def test_unused_options_warn_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "train",
        *SMALL,
        "--steps",
        "2",
        "--out",
        str(tmp_path / "r"),
        "--dylu",
        "--sync",
        "--slowdown",
        "1,2",
        "--shards",
        "3",
        "--grace",
        "1",
        "--local-steps",
        "5",
        "--compress",
        "fp16",
        "--freeze-step",
        "1",
        "--powersgd-rank",
        "2",
        "--no-bias-correction",
    ]
    assert main(args) == 0
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warn) == 1
    for flag in (
        "--dylu",
        "--slowdown",
        "--sync",
        "--shards",
        "--grace",
        "--local-steps",
        "--compress",
        "--freeze-step",
        "--powersgd-rank",
        "--no-bias-correction",
    ):
        assert flag in warn[0], flag


@pytest.mark.timeout(60)
def test_a_rank_without_peers_fails_at_the_join_deadline(tmp_path: Path) -> None:
    from thinwire.comm.launch import free_port

    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        THINWIRE_JOIN_TIMEOUT_S="2",
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        [sys.executable, "-m", "thinwire", "train", *SMALL, "--out", str(tmp_path / "r")],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "rank 0 waited 2 s" in last and "WORLD_SIZE=2" in last, res.stderr
    assert "Traceback" not in res.stderr and "DistStoreError" not in res.stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
        (lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),  # never opened: no hang
        (lambda p: p.mkdir(), "is a directory, not a regular file"),
        (lambda p: p.write_bytes(b"x" * 5000), "more than the 4096 allowed"),
        (lambda p: None, "no such file"),
    ],
)
def test_token_files_that_are_not_tokens_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[Path], object], message: str
) -> None:
    from thinwire.localsgd.runtime.auth import TOKEN_ENV, TOKEN_FILE_ENV, read_token

    path = tmp_path / "token"
    make(path)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(path))
    with pytest.raises(ConfigError) as err:
        read_token()
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text, text
    assert "missing" not in text or message == "no such file"


def test_a_token_that_is_not_utf8_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from thinwire.localsgd.runtime.auth import TOKEN_ENV, read_token

    # How Python shows an environment value holding the byte 0xff (surrogateescape).
    monkeypatch.setenv(TOKEN_ENV, "a" * 20 + "\udcff")
    with pytest.raises(ConfigError, match=f"^{TOKEN_ENV} is not UTF-8 text; use a token"):
        read_token()
    monkeypatch.setenv(TOKEN_ENV, "a" * 20 + "é")  # UTF-8 beyond ASCII is a fine token
    assert read_token() == ("a" * 20 + "é").encode()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["train", "--freeze-step", "abc"],
            "thinwire train: error: argument --freeze-step: expected 'auto' or a step number, "
            "got 'abc' (see thinwire train --help)",
        ),
        (["bogus"], "thinwire: error: argument COMMAND: invalid choice: 'bogus'"),
        (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag (see thinwire"),
    ],
)
def test_a_usage_error_is_one_line_not_the_usage_block(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # argparse's default: the usage block, then this
    assert message in err, err
