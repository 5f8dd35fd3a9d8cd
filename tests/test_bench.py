"""`thinwire bench allreduce`: the library function, the table, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire.cli.bench import size_range
from thinwire.cli.main import main
from thinwire.comm import spawn
from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.bench import METHODS, format_table, matrix_shape, run_allreduce_bench
from thinwire.comm.onebit_allreduce import onebit_wire_bytes
from thinwire.errors import ConfigError
from thinwire.units import parse_size

KEYS = {
    "method",
    "size_bytes",
    "time_s",
    "algbw_gbps",
    "busbw_gbps",
    "wire_bytes",
    "world_size",
    "compute_s",
}


def _bench_body(rank: int, world: int) -> list[dict]:
    return run_allreduce_bench(list(METHODS), [4096, 65536], warmup=1, iters=2)


@pytest.mark.timeout(180)
def test_run_allreduce_bench_rows_are_complete_and_agree_across_ranks() -> None:
    per_rank = spawn(_bench_body, 2, timeout_s=170)
    rows = per_rank[0]
    assert rows == per_rank[1]  # slowest-rank times: the same table everywhere
    assert [(r["size_bytes"], r["method"]) for r in rows] == [
        (s, m) for s in (4096, 65536) for m in METHODS
    ]
    for r in rows:
        assert r.keys() >= KEYS
        assert r["world_size"] == 2 and r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(W-1)/W = 1 at W=2
        onebit = r["method"].startswith("onebit")
        assert (r["compute_s"] is not None) == onebit
        # Small messages go whole: nothing to tune.
        assert r["pieces"] == (1 if onebit else None)
    by = {(r["size_bytes"], r["method"]): r for r in rows}
    n = 65536
    assert by[n, "fp32"]["wire_bytes"] == ring_allreduce_bytes(n, 2)
    assert by[n, "bf16"]["wire_bytes"] == ring_allreduce_bytes(n // 2, 2)
    assert by[n, "onebit"]["wire_bytes"] == onebit_wire_bytes(n // 4, 2)
    assert by[n, "onebit-fanout"]["wire_bytes"] == by[n, "onebit"]["wire_bytes"]
    assert by[n, "onebit-serial"]["wire_bytes"] == by[n, "onebit"]["wire_bytes"]
    # 16384 elements as a 128 x 128 matrix: rank-r factors P and Q of 128 x r each.
    assert by[n, "powersgd-r4"]["wire_bytes"] == 2 * ring_allreduce_bytes(4 * 4 * 128, 2)
    assert by[n, "onebit"]["wire_bytes"] < by[n, "powersgd-r4"]["wire_bytes"]
    table = format_table(rows)
    assert "64 KiB" in table and "powersgd-r1" in table and "1.00x" in table


def test_run_allreduce_bench_needs_a_group() -> None:
    with pytest.raises(ConfigError, match="initialised process group"):
        run_allreduce_bench(["fp32"], [4096], 1, 1)


def test_matrix_shape() -> None:
    assert matrix_shape(16384) == (128, 128)
    assert matrix_shape(32768) == (128, 256)
    assert matrix_shape(12) == (2, 6)
    assert matrix_shape(7) == (1, 7)


def test_sizes() -> None:
    f = "--min-size"
    assert parse_size("4K", f) == parse_size("4KiB", f) == parse_size("4096", f) == 4096
    assert parse_size("64MiB", f) == 64 * 2**20
    assert size_range(4096, 32768) == [4096, 8192, 16384, 32768]
    with pytest.raises(ConfigError, match="cannot read size '4 parsecs'"):
        parse_size("4 parsecs", "--min-size")
    with pytest.raises(ConfigError, match="power of two"):
        size_range(3000, 8192)
    with pytest.raises(ConfigError, match="larger than --max-size"):
        size_range(8192, 4096)
    with pytest.raises(ConfigError, match="256 MiB"):
        size_range(4096, 512 * 2**20)


@pytest.mark.timeout(180)
def test_cli_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "allreduce", "--workers", "2", "--methods", "fp32,onebit"]
    argv += ["--min-size", "4KiB", "--max-size", "8KiB", "--warmup", "1", "--iters", "1"]
    assert main([*argv, "--pieces", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "allreduce.json").read_text())
    assert {r["pieces"] for r in data["rows"] if r["method"] == "onebit"} == {2}
    assert [(r["size_bytes"], r["method"]) for r in data["rows"]] == [
        (4096, "fp32"),
        (4096, "onebit"),
        (8192, "fp32"),
        (8192, "onebit"),
    ]
    assert (tmp_path / "allreduce.png").stat().st_size > 0
    assert "onebit" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "fp32,zip"], "unknown method 'zip'"),
        (["--max-size", "1GiB"], "above the supported 256 MiB"),
        (["--workers", "1"], "--workers must be at least 2"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--pieces", "0"], "--pieces takes 'auto' or a positive whole number, got '0'"),
    ],
)
def test_cli_bad_input_is_one_line_error(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "allreduce", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("thinwire: error: ") and message in err and err.count("\n") == 1


def test_packing_and_compute_benches_report_ratios() -> None:
    from thinwire.comm.bench_packing import run_onebit_compute_bench, run_packing_bench

    rows = run_packing_bench([4096], repeats=1, clock="cpu")
    assert [r["op"] for r in rows] == ["pack_bits", "unpack_bits", "pack_signs", "unpack_signs"]
    for r in rows:
        assert r["numpy_s"] >= 0 and r["torch_s"] >= 0 and r["numel"] == 4096
    c = run_onebit_compute_bench(4096, world_size=4, repeats=1)
    assert c["compute_s"] > 0 and c["passes"] == pytest.approx(c["compute_s"] / c["copy_s"])
    from thinwire.comm import bench  # the benches stay importable where they used to live

    assert bench.run_packing_bench is run_packing_bench


def test_cli_packing_rejects_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "packing", "--numel", "10Q"]) == 2
    assert "cannot read element count '10Q'" in capsys.readouterr().err
