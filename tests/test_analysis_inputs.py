"""Readers and writers: malformed logs and profiles name the file and line; the link fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from thinwire.analysis import (
    AddCost,
    ParamTiming,
    Profile,
    fit_link,
    load_profile,
    read_bklog,
    read_vec_add_table,
    save_profile,
)
from thinwire.errors import ConfigError

GOOD_LOG = "comment line, ignored\n1\n3\n100.0,4000\n-5.0,8000\n2500,16\n"


def test_bklog_clips_negative_waits(tmp_path: Path) -> None:
    f = tmp_path / "m.bk.log"
    f.write_text(GOOD_LOG)
    prof = read_bklog(f, iteration_s=0.01)
    assert [p.ready_s for p in prof.params] == pytest.approx([100e-6, 100e-6, 2600e-6])
    assert [p.index for p in prof.params] == [2, 1, 0]  # backward order is reversed
    assert prof.backward_s == pytest.approx(2600e-6)


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("c\n1\n3\n100.0,4000\n12,abc\n1,1\n", 5, "not a number"),
        ("c\n1\n3\n100.0,4000\n1,2\n", 6, "expected row 3 of 3"),
        ("c\none\n3\n", 2, "number of batches"),
        ("c\n1\n2\n1,2,3\n1,2\n", 4, "two comma-separated"),
        ("c\n1\n1\n1,-5\n", 4, "size must be"),
        ("c\n1\n1\n1,5\n7,7\n", 5, "unexpected data"),
    ],
)
def test_bklog_errors_name_file_and_line(tmp_path: Path, text: str, line: int, what: str) -> None:
    f = tmp_path / "bad.bk.log"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"bad\.bk\.log:{line}: .*{what}") as exc:
        read_bklog(f, iteration_s=0.01)
    assert "\n" not in str(exc.value)


def test_bklog_without_iteration_time_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "mine.bk.log"
    f.write_text(GOOD_LOG)
    with pytest.raises(ConfigError, match="iteration time"):
        read_bklog(f)


def test_vec_add_table_interpolates_and_extrapolates(tmp_path: Path) -> None:
    f = tmp_path / "add.log"
    f.write_text("100,1e-6\n200,2e-6\n400,3e-6\n")
    add = read_vec_add_table(f)
    assert add(150) == pytest.approx(1.5e-6)
    assert add(50) == pytest.approx(1e-6)  # launch-bound floor
    assert add(800) == pytest.approx(5e-6)  # last segment's slope
    f.write_text("100,1e-6\n50,2e-6\n")
    with pytest.raises(ConfigError, match=r"add\.log:2: sizes must increase"):
        read_vec_add_table(f)


def test_measured_add_cost_grows_with_size() -> None:
    add = AddCost.measure(sizes=(2**12, 2**22), repeats=3)
    assert add(2**22) > add(2**12) > 0


def _profile() -> Profile:
    return Profile(
        model="m",
        iteration_s=0.1,
        backward_s=0.05,
        params=[
            ParamTiming("a.weight", 0, 400, ready_s=0.04),
            ParamTiming("b.weight", 1, 800, ready_s=0.01),
            ParamTiming("frozen.weight", 2, 80, ready_s=None),
        ],
        observed_buckets=[[1, 0]],
    )


def test_profile_round_trip(tmp_path: Path) -> None:
    path = save_profile(_profile(), tmp_path / "p.json")
    back = load_profile(path)
    assert back == _profile()
    assert [p.name for p in back.ready] == ["b.weight", "a.weight"]
    assert back.summary()["frozen_params"] == 1


def test_malformed_profile_names_file_and_line(tmp_path: Path) -> None:
    path = save_profile(_profile(), tmp_path / "p.json")
    lines = path.read_text().splitlines()
    bad = next(i for i, line in enumerate(lines) if "b.weight" in line)
    lines[bad] = lines[bad].replace('"nbytes": 800', '"nbytes": "lots"')
    path.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=rf"p\.json:{bad + 1}: params\[1\]"):
        load_profile(path)
    path.write_text('{"format": "thinwire.profile/1",\n "iteration_s": 0.1,\n oops}')
    with pytest.raises(ConfigError, match=r"p\.json:3: not valid JSON"):
        load_profile(path)
    path.write_text(
        json.dumps(
            {"format": "thinwire.profile/1", "iteration_s": 0, "backward_s": 0.1, "params": []}
        )
    )
    with pytest.raises(ConfigError, match="iteration time must be > 0"):
        load_profile(path)


@pytest.mark.parametrize(
    ("alpha", "gbps"),
    [(0.0, 2.5), (250e-6, 2.5), (0.02, 0.1), (0.1, 0.1)],
    ids=["lan", "fast-link", "wan-20ms", "wan-100ms"],
)
def test_link_fit_recovers_synthetic_alpha_and_bandwidth(alpha: float, gbps: float) -> None:
    """Times drawn from the ring model with 1% noise, from latency-bound small messages
    to bandwidth-bound large ones: the fit finds both parameters again."""
    from thinwire.analysis.collective_cost import ring_rounds, ring_time

    rng = np.random.default_rng(0)
    n = 4
    rows = []
    for k in range(12, 26):
        size = 2**k
        wire = 8 * 2 * (n - 1) / n * size / (gbps * 1e9)
        t = ring_time(wire, ring_rounds(size, n), alpha)
        rows.append(
            {
                "method": "fp32",
                "size_bytes": size,
                "world_size": n,
                "time_s": t * (1 + rng.normal(0, 0.01)),
            }
        )
    rows.append({"method": "onebit", "size_bytes": 1, "world_size": n, "time_s": 9.0})
    fit = fit_link(rows)
    assert fit.alpha_per_message_s == pytest.approx(alpha, rel=0.05, abs=2e-6)
    assert fit.bandwidth_gbps == pytest.approx(gbps, rel=0.03)
    assert fit.alpha_s == pytest.approx(fit.alpha_per_message_s * 6)
    assert fit.max_rel_error < 0.05
    for r in rows[:-1]:  # predict() is the fitted model itself
        assert fit.predict(r["size_bytes"]) == pytest.approx(r["time_s"], rel=0.05)


def test_link_fit_does_not_add_latency_to_the_wire_across_a_wan() -> None:
    """Measured on the testbed (4 hosts, 100 Mbit/s, 50 ms one way, gloo): a 64 KiB
    allreduce takes 7 round trips, a 16 MiB one barely more than its wire time. The
    ring model fits both ends; a straight line alpha + S/B cannot."""
    sizes = [2**k for k in range(16, 25)]
    secs = [0.684, 0.733, 0.758, 0.762, 0.763, 0.764, 0.929, 1.287, 2.398]
    rows = [
        {"method": "fp32", "size_bytes": s, "world_size": 4, "time_s": t}
        for s, t in zip(sizes, secs, strict=True)
    ]
    fit = fit_link(rows)
    assert fit.max_rel_error < 0.10
    assert 0.09 < fit.bandwidth_gbps < 0.11  # the 100 Mbit/s link, not a faster one
    assert 0.10 < fit.alpha_per_message_s < 0.13  # one round trip (100 ms) and a little


def test_onebit_call_latency_is_what_its_call_took_beyond_wire_and_compute() -> None:
    from thinwire.analysis.collective_cost import onebit_wait

    n, gbps, alpha = 4, 0.1, 0.02
    rows = [
        {"method": "fp32", "size_bytes": s, "world_size": n, "time_s": 8 * 1.5 * s / (gbps * 1e9)}
        for s in (2**16, 2**20, 2**24)
    ]
    assert fit_link(rows).onebit_latency == ()  # fp32 alone: not measured
    sizes = [2**k for k in range(16, 25)]
    waits = [3 * alpha] * 4 + [3.5 * alpha, 9 * alpha, 3.5 * alpha, 3.5 * alpha, 3.5 * alpha]
    for s, wait in zip(sizes, waits, strict=True):
        wire, compute = s / 16, s * 1e-9  # ~2 (n-1)/n * S / 32 bytes; compute grows
        t = wait + compute + 8 * wire / (gbps * 1e9)
        rows.append(
            {
                "method": "onebit",
                "size_bytes": s,
                "world_size": n,
                "time_s": t,
                "compute_s": compute,
                "wire_bytes": wire,
            }
        )
    fit = fit_link(rows)
    assert fit.points == 3  # alpha and B come from fp32 alone
    assert [s for s, _ in fit.onebit_latency] == sizes
    assert [w for _, w in fit.onebit_latency] == pytest.approx(waits, rel=1e-3)
    # A bucket's wait is the median of its neighbours within 4x: one jump does not decide.
    assert onebit_wait(fit.onebit_latency, 2**21) == pytest.approx(3.5 * alpha, rel=1e-3)
    assert onebit_wait(fit.onebit_latency, 2**16) == pytest.approx(3 * alpha, rel=1e-3)
    assert onebit_wait(fit.onebit_latency, 2**40) == pytest.approx(3.5 * alpha, rel=1e-3)


def test_link_fit_rejects_unfittable_data() -> None:
    one = [{"method": "fp32", "size_bytes": 1024, "world_size": 2, "time_s": 1e-4}]
    with pytest.raises(ConfigError, match="two different message sizes"):
        fit_link(one * 3)
    with pytest.raises(ConfigError, match="no 'fp32'"):
        fit_link([])
    flat = [
        {"method": "fp32", "size_bytes": s, "world_size": 2, "time_s": 1e-3 / s}
        for s in (1024, 4096)
    ]
    with pytest.raises(ConfigError, match="does not grow"):
        fit_link(flat)


def test_profile_times_the_optimizer_the_stage_runs() -> None:
    from thinwire.analysis.measure import profile_gpt

    lamb = profile_gpt("tiny", 2, warmup=2, steps=2, optimizer="onebit-lamb")
    assert lamb.optimizer_s is not None and lamb.optimizer_s > 0
    assert lamb.grad_bytes > 0  # the same step, with another update
    with pytest.raises(ConfigError, match="cannot profile optimizer 'sgd'"):
        profile_gpt("tiny", 2, warmup=0, steps=1, optimizer="sgd")


def test_measured_onebit_codec_cost_is_positive_and_small() -> None:
    from thinwire.analysis import measure_codec_cost

    per_byte = measure_codec_cost(nbytes=2**18, world_size=4, repeats=2)
    assert 0 < per_byte < 1e-6  # well under 1 us per byte on any CPU
