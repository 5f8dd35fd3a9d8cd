"""The one size parser (:mod:`thinwire.units`): what each spelling means, what is refused,
and that every flag taking a size reads it the same way, with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.testbed.wan import WanConfig
from thinwire.units import MAX_SIZE_BYTES, parse_count, parse_size

KIB, MIB, GIB = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1048576", MIB),
        ("4096B", 4096),
        ("4096 b", 4096),
        # binary: a bare letter, Ki/Mi/Gi, KiB/MiB/GiB, any case
        ("4K", 4 * KIB),
        ("4k", 4 * KIB),
        ("4Ki", 4 * KIB),
        ("4KiB", 4 * KIB),
        ("64M", 64 * MIB),
        ("64mib", 64 * MIB),
        ("64 MiB", 64 * MIB),
        ("1G", GIB),
        ("1Gi", GIB),
        ("1GiB", GIB),
        ("1024G", 1024 * GIB),  # the size docs/reliability.md refuses for its memory, not here
        # decimals, scaled exactly
        ("1.5M", 3 * MIB // 2),
        ("1.5MiB", 3 * MIB // 2),
        ("0.5K", 512),
        (".5K", 512),
        ("2.", 2),
        # decimal SI: a unit ending in B without the i
        ("16MB", 16 * 10**6),
        ("16mb", 16 * 10**6),
        ("4kB", 4000),
        ("4KB", 4000),
        ("1.5GB", 1_500_000_000),
        ("  64MiB  ", 64 * MIB),
    ],
)
def test_size_spellings(text: str, nbytes: int) -> None:
    assert parse_size(text, "--size") == nbytes


def test_size_from_python_int() -> None:
    assert parse_size(4096, "--size") == 4096
    assert parse_size(0, "--size", allow_zero=True) == 0
    assert parse_size("0", "--size", allow_zero=True) == 0
    assert parse_size("0KiB", "--size", allow_zero=True) == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4 parsecs", "--size: cannot read size '4 parsecs'; use bytes (4096)"),
        ("", "--size: cannot read size ''"),
        ("MiB", "--size: cannot read size 'MiB'"),
        ("1e6", "--size: cannot read size '1e6'"),
        ("0x10", "--size: cannot read size '0x10'"),
        ("1_000", "--size: cannot read size '1_000'"),
        ("+5", "--size: cannot read size '+5'"),
        ("4Mb/s", "--size: cannot read size '4Mb/s'"),
        ("1.2.3K", "--size: cannot read size '1.2.3K'"),
        ("4KIB B", "--size: cannot read size '4KIB B'"),
        ("-4K", "--size: size '-4K' is negative"),
        ("- 4", "--size: size '- 4' is negative"),
        (-1, "--size: size -1 is negative"),
        ("inf", "--size: size 'inf' is not a finite number"),
        ("-inf", "--size: size '-inf' is not a finite number"),
        ("NaN", "--size: size 'NaN' is not a finite number"),
        ("0", "--size: size '0' is zero; it must be at least 1"),
        ("0.0M", "--size: size '0.0M' is zero"),
        (0, "--size: size 0 is zero"),
        ("0.1K", "--size: size '0.1K' is 102.4 bytes, not a whole number"),
        ("1.5", "--size: size '1.5' is 1.5 bytes, not a whole number"),
        ("9999999999G", "--size: size '9999999999G' is too large"),
        (1.5, "--size: cannot read size 1.5"),
        (True, "--size: cannot read size True"),
    ],
)
def test_size_refusals_are_one_line_naming_flag_and_value(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_size(value, "--size")  # type: ignore[arg-type]
    assert str(exc.value).startswith(message), str(exc.value)
    assert "\n" not in str(exc.value)


def test_size_limit_is_a_signed_64_bit_integer() -> None:
    assert parse_size(str(MAX_SIZE_BYTES), "--size") == 2**63 - 1
    with pytest.raises(ConfigError, match="too large"):
        parse_size(str(MAX_SIZE_BYTES + 1), "--size")


def test_counts_are_decimal() -> None:
    assert parse_count("10M", "--numel") == 10_000_000
    assert parse_count("100m", "--numel") == 100_000_000
    assert parse_count("2.5k", "--numel") == 2500
    assert parse_count("1G", "--numel") == 10**9
    assert parse_count("4096", "--numel") == 4096
    for bad, message in [
        ("10Q", "--numel: cannot read element count '10Q'"),
        ("10MiB", "--numel: cannot read element count '10MiB'"),  # a size, not a count
        ("10MB", "--numel: cannot read element count '10MB'"),
        ("-10", "--numel: element count '-10' is negative"),
        ("1.0001K", "--numel: element count '1.0001K' is 1000.1 elements, not a whole number"),
        ("0", "--numel: element count '0' is zero"),
    ]:
        with pytest.raises(ConfigError) as exc:
            parse_count(bad, "--numel")
        assert str(exc.value).startswith(message), str(exc.value)


def test_buffer_reads_sizes_by_the_same_rule() -> None:
    def buffer(value: str) -> int:
        wan = WanConfig.resolve(2, 10**8, delay="10ms", buffer=value)
        assert wan is not None
        return wan.buffer_bytes

    assert buffer("64MiB") == buffer("64M") == 64 * MIB
    assert buffer("16MB") == 16 * 10**6
    assert buffer("1.5GiB") == 3 * GIB // 2
    with pytest.raises(ConfigError, match=r"^buffer: cannot read size '16 furlongs'"):
        buffer("16 furlongs")
    with pytest.raises(ConfigError, match=r"^buffer: size '-16MiB' is negative"):
        buffer("-16MiB")


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("thinwire: error: ") and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "allreduce", "--min-size", "1.5x"], "--min-size: cannot read size '1.5x'"),
        (["bench", "allreduce", "--max-size=-64MiB"], "--max-size: size '-64MiB' is negative"),
        (["bench", "allreduce", "--max-size", "0"], "--max-size: size '0' is zero"),
        (["bench", "packing", "--numel", "10M,1e6"], "--numel: cannot read element count '1e6'"),
        (["analyze", "fit", "--max-bytes", "nan"], "--max-bytes: size 'nan' is not a finite"),
        (["analyze", "fit", "--min-bytes", "0.5"], "--min-bytes: size '0.5' is 0.5 bytes"),
        (
            ["analyze", "validate", "--fit-min-bytes", "64KiBs"],
            "--fit-min-bytes: cannot read size '64KiBs'",
        ),
        (
            ["testbed", "run", "--delay", "10ms", "--buffer", "lots", "--", "true"],
            "buffer: cannot read size 'lots'",
        ),
    ],
)
def test_every_size_flag_refuses_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _one_line_error(argv, capsys)


def test_analyze_bench_takes_decimals_and_si_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the memory check, which runs before any rank starts, names the size it was given
    out = str(tmp_path / "link.json")
    err = _one_line_error(["analyze", "fit", "--max-bytes", "16384GB", "-o", out], capsys)
    assert "smaller --max-bytes" in err and "16,384,000,000,000 bytes" in err
    err = _one_line_error(["analyze", "fit", "--max-bytes", "65536.5G", "-o", out], capsys)
    assert f"{65536 * GIB + GIB // 2:,} bytes" in err
