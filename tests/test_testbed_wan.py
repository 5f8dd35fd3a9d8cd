"""Wide-area settings of the testbed without root: parsing, per-host semantics, the delay
line's arguments, and the CLI's one-line errors for bad values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.testbed.delayline import link_args
from thinwire.testbed.wan import (
    MAX_DEFAULT_BUFFER_BYTES,
    WanConfig,
    format_duration,
    parse_duration,
    parse_loss,
)
from thinwire.units import parse_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("1.5s", 1.5), ("200us", 2e-4), ("0", 0.0), (0.02, 0.02), (".5ms", 5e-4)],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert math.isclose(parse_duration(text), seconds)


@pytest.mark.parametrize("bad", ["-5ms", "50", "5 parsecs", "1e3ms", "nan", "11s", "", True])
def test_parse_duration_rejects_bad_values_in_one_line(bad: object) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_duration(bad)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_parse_loss_and_size() -> None:
    assert parse_loss("0.1%") == pytest.approx(0.001)
    assert parse_loss("100%") == 1.0
    assert parse_loss(0.25) == 0.25
    for bad in ("101%", "-1%", "0.1", "x%", 1.5):
        with pytest.raises(ConfigError):
            parse_loss(bad)
    assert parse_size("16MiB", "buffer") == 16 * 2**20
    assert parse_size("512k", "buffer") == 512 * 2**10
    with pytest.raises(ConfigError):
        parse_size("16 furlongs", "buffer")
    assert format_duration(0.05) == "50ms" and format_duration(2e-4) == "200us"


def test_nothing_set_means_no_delay_line() -> None:
    assert WanConfig.resolve(4, 10**8) is None
    assert WanConfig.resolve(4, 10**8, delay="0ms", loss="0%") is None


def test_per_host_settings_from_scalars_lists_and_dicts() -> None:
    w = WanConfig.resolve(3, 10**8, delay="10ms", jitter=["1ms", "2ms", "0"], loss={2: "1%"})
    assert w is not None
    assert [h.delay_s for h in w.hosts] == [0.01] * 3
    assert [h.jitter_s for h in w.hosts] == [0.001, 0.002, 0.0]
    assert [h.loss for h in w.hosts] == [0.0, 0.0, 0.01]
    assert "delay 10ms" in w.describe() and "loss 0%/0%/1%" in w.describe()
    with pytest.raises(ConfigError, match="3 hosts"):
        WanConfig.resolve(3, None, delay=["1ms", "2ms"])
    with pytest.raises(ConfigError, match="host 5 does not exist"):
        WanConfig.resolve(3, None, delay={5: "1ms"})
    with pytest.raises(ConfigError, match="exceeds its delay"):
        WanConfig.resolve(2, None, delay="1ms", jitter="2ms")


def test_delay_line_gets_half_the_delay_and_loss_per_direction() -> None:
    w = WanConfig.resolve(2, 10**8, delay={1: "100ms"}, jitter={1: "10ms"}, loss="19%")
    assert w is not None
    args = [a.split(",") for a in link_args(w)]
    assert args[0][:4] == ["h0", "t0", "0", "0"]
    # Host 1 holds frames 50 ms each way +- 5 ms: 50 ms from host 0 in both directions.
    assert args[1][:4] == ["h1", "t1", str(50_000_000), str(5_000_000)]
    # Two halves of 10% loss each make 19% end to end; lossy links carry single frames.
    half = float(args[0][4])
    assert 1 - (1 - half) ** 2 == pytest.approx(0.19)
    assert args[0][6] == "0"
    assert all(int(a[5]) == w.buffer_bytes for a in args)


def test_buffer_must_hold_rate_times_delay() -> None:
    w = WanConfig.resolve(2, 10**9, delay="50ms")
    assert w is not None and w.buffer_bytes >= 10**9 / 8 * 0.025
    with pytest.raises(ConfigError, match="buffer") as exc:
        WanConfig.resolve(2, 10**9, delay="50ms", buffer="1MiB")
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="buffer"):
        WanConfig.resolve(2, 10**9, delay="10s")  # beyond the largest default buffer
    big = WanConfig.resolve(2, 10**9, delay="10s", buffer="1GiB")
    assert big is not None and big.buffer_bytes == 2**30 > MAX_DEFAULT_BUFFER_BYTES
    unlimited = WanConfig.resolve(2, None, delay="10ms")
    assert unlimited is not None and unlimited.buffer_bytes == 16 * 2**20


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--delay=-5ms"], "negative"),
        (["--loss", "101%"], "out of range"),
        (["--loss", "0.1"], "percentage"),
        (["--delay", "50"], "invalid"),
        (["--rate", "1gbit", "--delay", "50ms", "--buffer", "1MiB"], "buffer"),
        (["--jitter", "5ms"], "exceeds its delay"),
        (["--host-delay", "7=5ms"], "does not exist"),
        (["--host-delay", "5ms"], "HOST=VALUE"),
        (["--id", "abc", "--delay", "5ms"], "not with --id"),
    ],
)
def test_cli_refuses_bad_wan_settings_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checked before anything needs root, so this holds with and without it.
    assert main(["testbed", "run", *flags, "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_analyze_simulate_takes_a_measured_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "m.bk.log"
    log.write_text("c\n1\n2\n100,4000\n200,8000\n")
    base = ["analyze", "what-if", str(log), "--iteration-ms", "10", "--reduction", "none"]
    base += ["--workers", "4", "--bandwidth-gbps", "1"]
    sims = {}
    for name, extra in (
        ("none", []),
        ("latency", ["--rtt", "50ms"]),
        ("alpha", ["--alpha-us", "50000"]),
    ):
        out = tmp_path / f"{name}.json"
        assert main([*base, *extra, "-o", str(out)]) == 0
        sims[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert sims["latency"]["result"]["config"]["alpha_s"] == pytest.approx(0.05)
    assert sims["latency"]["result"] == sims["alpha"]["result"]
    assert sims["latency"]["result"]["step_s"] > sims["none"]["result"]["step_s"] + 0.05
    for extra, message in (
        (["--rtt=-1ms"], "negative"),
        (["--rtt", "50"], "invalid"),
        (["--rtt", "5ms", "--alpha-us", "3"], "not both"),
    ):
        assert main([*base, *extra, "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-testbed", "--delay", "50ms"], "--delay needs the emulated network"),
        (["--delay", "50"], "invalid"),
    ],
)
def test_demo_refuses_a_delay_it_cannot_emulate(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not out.exists()  # refused before anything was written
