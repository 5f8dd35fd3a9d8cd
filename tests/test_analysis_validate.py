"""Prediction-vs-measurement logic of thinwire.analysis.validate on synthetic inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import own_clusters
from thinwire.analysis.collective_cost import ring_rounds, ring_time
from thinwire.analysis.profile import ParamTiming, Profile, save_profile
from thinwire.analysis.validate import (
    GLOO_CONCURRENCY,
    TCP_PAYLOAD_SHARE,
    Link,
    ValidationConfig,
    error_pct,
    format_table,
    measured_step_s,
    merge_profiles,
    plot_validation,
    predict_step,
    summarize,
)
from thinwire.comm.onebit_allreduce import onebit_wire_bytes
from thinwire.errors import ConfigError

MIB = 2**20


def validate(args: list[str]) -> int:
    from thinwire.cli.main import main

    return main(["analyze", "validate", *args])


def _profile(scale: float = 1.0, observed: list[list[int]] | None = None) -> Profile:
    # Three gradients ready during a 0.6 s backward pass (reverse registration order).
    params = [
        ParamTiming("a", 0, 4 * MIB, ready_s=0.6 * scale),
        ParamTiming("b", 1, 2 * MIB, ready_s=0.4 * scale),
        ParamTiming("c", 2, MIB, ready_s=0.1 * scale),
    ]
    return Profile(
        model="toy",
        iteration_s=1.0 * scale,
        backward_s=0.6 * scale,
        forward_s=0.3 * scale,
        optimizer_s=0.1 * scale,
        params=params,
        observed_buckets=observed,
    )


def test_merge_profiles_averages_times_and_ready_times() -> None:
    a, b = _profile(1.0), _profile(3.0)
    a.meta["onebit_codec_s_per_byte"] = 1e-9
    b.meta["onebit_codec_s_per_byte"] = 3e-9
    m = merge_profiles([a, b])
    assert m.iteration_s == pytest.approx(2.0)
    assert m.backward_s == pytest.approx(1.2)
    assert m.optimizer_s == pytest.approx(0.2)
    assert [p.ready_s for p in m.params] == pytest.approx([1.2, 0.8, 0.2])
    assert m.meta["onebit_codec_s_per_byte"] == pytest.approx(2e-9)
    assert m.meta["merged"] == 2
    # The 1-bit optimizer's update time is averaged too, and dropped if one lacks it.
    a.meta["onebit_optimizer_s"], b.meta["onebit_optimizer_s"] = 0.2, 0.4
    assert merge_profiles([a, b]).meta["onebit_optimizer_s"] == pytest.approx(0.3)
    del b.meta["onebit_optimizer_s"]
    assert "onebit_optimizer_s" not in merge_profiles([a, b]).meta


def test_merge_profiles_rejects_different_models() -> None:
    other = _profile()
    other.params = other.params[:2]
    with pytest.raises(ConfigError, match="differ in parameters"):
        merge_profiles([_profile(), other])
    with pytest.raises(ConfigError, match="no profiles"):
        merge_profiles([])


def test_onebit_is_one_collective_after_backward_with_codec() -> None:
    # Analytic: the 1-bit optimizer sends ONE buffer after backward; the step is the
    # iteration plus its wire time, 2 latencies (one-step collectives, the metadata's
    # beside phase 1) and the codec over all bytes.
    prof, n = _profile(), 4
    link = Link(bandwidth_gbps=0.1, alpha_per_message_s=1e-3, source="fitted")
    codec = 2e-9
    res = predict_step(prof, "onebit", link, n, codec)
    total = 7 * MIB
    wire = onebit_wire_bytes(total // 4, n)
    expected = 1.0 + 8 * wire / 0.1e9 + 2 * 1e-3 + codec * total
    assert res.step_s == pytest.approx(expected)
    assert len(res.events) == 1 and res.events[0].start_s == pytest.approx(0.6)
    # Where the profile timed the 1-bit optimizer's own update, the stage runs it.
    timed = _profile()
    timed.meta["onebit_optimizer_s"] = 0.25  # AdamW's was 0.1
    res2 = predict_step(timed, "onebit", link, n, codec)
    assert res2.iteration_s == pytest.approx(1.15)
    assert res2.step_s == pytest.approx(expected + 0.15)
    assert predict_step(timed, "ddp", link, n).iteration_s == pytest.approx(1.0)


def test_onebit_takes_the_passes_timed_between_1bit_steps() -> None:
    # The record's passes (0.3 + 0.6 s) ran beside DDP's allreduce; timed between 1-bit
    # steps they took 0.6 s: the stage's iteration and its gradients' ready times follow.
    link = Link(bandwidth_gbps=0.1, alpha_per_message_s=1e-3, source="fitted")
    plain = predict_step(_profile(), "onebit", link, 4, 2e-9)
    timed = _profile()
    timed.meta["onebit_passes_s"] = 0.6
    res = predict_step(timed, "onebit", link, 4, 2e-9)
    assert res.iteration_s == pytest.approx(0.7)
    assert res.step_s == pytest.approx(plain.step_s - 0.3)
    # the one buffer leaves when the last gradient is ready: 0.6 s scaled by 2/3
    assert res.events[0].start_s == pytest.approx(0.4)
    # with the timed update as well, both apply
    timed.meta["onebit_optimizer_s"] = 0.25
    assert predict_step(timed, "onebit", link, 4).iteration_s == pytest.approx(0.85)
    # DDP's own prediction keeps the record's passes
    assert predict_step(timed, "ddp", link, 4).iteration_s == pytest.approx(1.0)


def test_fused_fp32_is_a_ring_allreduce_after_backward() -> None:
    prof, n = _profile(), 4
    link = Link(bandwidth_gbps=0.05, alpha_per_message_s=2e-3)
    res = predict_step(prof, "fp32-fused", link, n)
    wire = 2 * (n - 1) / n * 7 * MIB
    assert res.exposed_s == pytest.approx(ring_time(8 * wire / 0.05e9, 2 * (n - 1), 2e-3))
    # Overlap hides part of it: DDP's observed buckets start during backward.
    ddp = predict_step(_profile(observed=[[2, 1], [0]]), "ddp", link, n)
    assert [e.nbytes for e in ddp.events] == [3 * MIB, 4 * MIB]
    assert ddp.events[0].start_s == pytest.approx(0.4)
    assert 0 < ddp.exposed_s < res.exposed_s
    # Across a WAN, DDP's two buckets run at once (gloo's two threads): the second's
    # round trips overlap the first's instead of queueing behind them.
    wan = Link(bandwidth_gbps=0.05, alpha_per_message_s=0.2)
    ddp_wan = predict_step(_profile(observed=[[2, 1], [0]]), "ddp", wan, n)
    assert ddp_wan.config.concurrency == GLOO_CONCURRENCY == 2
    assert ddp_wan.events[1].start_s < ddp_wan.events[0].end_s


def test_predict_step_ignores_codec_for_fp32_and_rejects_unknown_scheme() -> None:
    link = Link.nominal(100e6)
    assert link.bandwidth_gbps == pytest.approx(0.1 * TCP_PAYLOAD_SHARE)
    a = predict_step(_profile(), "fp32-fused", link, 4, codec_s_per_byte=1e-6)
    b = predict_step(_profile(), "fp32-fused", link, 4)
    assert a.step_s == b.step_s
    with pytest.raises(ConfigError, match="unknown scheme"):
        predict_step(_profile(), "powersgd", link, 4)


def test_diloco_amortizes_one_exchange_and_a_round_trip_per_message() -> None:
    """DiLoCo pays one fp32 exchange per H steps; a delayed link adds round trips to it
    (2 (n - 1) of them, beside half its wire time, when they outlast the wire)."""
    n, rtt = 4, 0.1
    lan, wan = Link.nominal(100e6), Link.nominal(100e6, rtt)
    assert wan.alpha_per_message_s == rtt and wan.bandwidth_gbps == lan.bandwidth_gbps
    fused = predict_step(_profile(), "fp32-fused", lan, n)
    one = predict_step(_profile(), "diloco", lan, n, local_steps=1)
    ten = predict_step(_profile(), "diloco", lan, n, local_steps=10)
    assert one.step_s == pytest.approx(fused.step_s)  # H = 1: every step exchanges
    assert ten.exposed_s == pytest.approx(one.exposed_s / 10)
    delayed = predict_step(_profile(), "diloco", wan, n, local_steps=10)
    wire = 8 * 2 * (n - 1) / n * 7 * MIB / (lan.bandwidth_gbps * 1e9)
    assert ten.exposed_s == pytest.approx(wire / 10)
    assert delayed.exposed_s == pytest.approx(ring_time(wire, 2 * (n - 1), rtt) / 10)
    assert delayed.exposed_s > ten.exposed_s


def _records(times: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, "step_s": t} for i, t in enumerate(times)] + [
        {"step": len(times), "val_loss": 3.0}  # evaluation record: no step time
    ]


@pytest.mark.timeout(180)
def test_onebit_steps_are_compared_once_the_collective_is_tuned(tmp_path: Path) -> None:
    """The trainer logs ``onebit_tuned`` once compressing; the validation's 1-bit span
    starts after the collective's piece tuner settled (its trial calls are slower)."""
    from conftest import TINY_FLAGS
    from thinwire.analysis.validate import _settled_step
    from thinwire.cli.main import main
    from thinwire.train.metrics import read_metrics

    argv = ["train", "--algo", "onebit-lamb", "--workers", "2", "--steps", "30"]
    argv += ["--freeze-step", "2", "--batch-size", "2", "--log-interval", "1"]
    argv += ["--eval-interval", "30", "--eval-sequences", "2", "--checkpoint-interval", "0"]
    assert main([*argv, *TINY_FLAGS, "--out", str(tmp_path / "run")]) == 0
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step_s" in r]
    flags = [(r["step"], r.get("onebit_tuned")) for r in recs]
    assert all(f is None for s, f in flags if s <= 2)  # fp32 warmup: no 1-bit collective
    tuned = [f for s, f in flags if s > 2]
    assert set(tuned) == {0, 1} and tuned == sorted(tuned)  # tunes, then stays tuned
    first_tuned = next(s for s, f in flags if f == 1)
    assert _settled_step(recs, 4) == first_tuned + 1
    assert _settled_step(recs, 29) == 29  # never before the span asked for
    assert _settled_step([{"step": 5, "step_s": 1.0}], 4) == 4  # a log from before the flag


def test_measured_step_s_uses_only_the_requested_steps() -> None:
    recs = _records([9.0, 9.0, 1.0, 2.0, 3.0, 100.0])
    m = measured_step_s(recs, 3, 5)
    assert (m["steps"], m["mean_s"], m["median_s"]) == (3, 2.0, 2.0)
    assert m["stdev_s"] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match=">= 2 logged steps"):
        measured_step_s(recs, 6, 9)


def test_error_and_summary() -> None:
    assert error_pct(1.1, 1.0) == pytest.approx(10.0)
    assert error_pct(0.8, 1.0) == pytest.approx(-20.0)
    rows = [{"e": 10.0}, {"e": -20.0}, {"e": 15.0}, {"e": None}, {"e": math.nan}]
    s = summarize(rows, "e")
    assert (s["rows"], s["within_goal"], s["worst_abs_pct"]) == (3, 2, 20.0)


def _row(rate: str, scheme: str, measured: float, predicted: float) -> dict[str, object]:
    pred = {"step_s": predicted, "compute_s": 0.5 * predicted, "exposed_s": 0.5 * predicted}
    return {
        "rate": rate,
        "scheme": scheme,
        "measured": {"mean_s": measured, "median_s": measured, "stdev_s": 0.1},
        "predicted": pred,
        "predicted_alone": pred,
        "predicted_nominal": pred,
        "err_pct": error_pct(predicted, measured),
        "err_alone_pct": error_pct(predicted, measured),
        "err_nominal_pct": error_pct(predicted, measured),
    }


def _result() -> dict[str, object]:
    rows = [_row("100mbit", "ddp", 2.0, 2.2), _row("100mbit", "onebit", 1.0, 1.5)]
    return {
        "format": "thinwire.validation/1",
        "rates": [{"rate": "100mbit", "rows": rows, "load_avg_1min": {"a": 3.0, "b": 5.0}}],
        "summary": {"err_pct": summarize(rows, "err_pct")},
    }


def test_table_and_plot_from_synthetic_result(tmp_path: Path) -> None:
    table = format_table(_result())
    assert "| 100mbit | fp32 DDP (adamw) | 2.000 +- 0.100, 2.000 s | 2.200 s | +10.0% |" in table
    assert "+50.0%" in table and "3.0-5.0" in table
    assert "Within 15%: 1 of 2 cases (worst 50.0%" in table
    png = plot_validation(_result(), tmp_path / "v.png")
    assert png.stat().st_size > 10_000


def test_cli_rerenders_and_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "validation.json"
    src.write_text(json.dumps(_result()))
    out = tmp_path / "again"
    assert validate(["--from-json", str(src), "--out", str(out), "--plot", str(out / "p.png")]) == 0
    assert "fp32 DDP" in (out / "validation.md").read_text() and (out / "p.png").exists()
    save_profile(_profile(), tmp_path / "notvalidation.json")
    assert validate(["--from-json", str(tmp_path / "notvalidation.json")]) == 2
    assert "not a thinwire validation" in capsys.readouterr().err
    assert validate(["--rates", "100mbit", "--hosts", "1", "--out", str(tmp_path / "x")]) == 2
    assert "hosts must be >= 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rates": ("unlimited",)}, "needs a link rate"),
        ({"rates": ("fast",)}, "rate"),
        ({"freeze_step": 29}, "freeze-step"),
        ({"onebit_algo": "adamw"}, "onebit algo"),
        ({"rates": ()}, "no link rates"),
        ({"fit_min_bytes": 2**20, "fit_max_bytes": 2**20}, "two sizes"),
        ({"local_steps": 40}, "local-steps"),
        ({"local_steps": -1}, "local-steps"),
        ({"delay": "0"}, "positive duration"),
        ({"delay": "-5ms"}, "negative"),
    ],
)
def test_config_check(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ValidationConfig(**kwargs).check()  # type: ignore[arg-type]


def test_recorded_predictions_use_the_fitted_link_only_with_a_set_delay() -> None:
    from thinwire.analysis.validate import _record_link

    fitted = Link(0.05, 0.002, "fitted", ((1e6, 0.01),))
    plain = _record_link(ValidationConfig(rates=("100mbit",)), 1e8, fitted)
    assert plain == Link.nominal(1e8)  # the record's achieved rate decides there
    delayed = ValidationConfig(rates=("100mbit",), delay="10ms")
    assert _record_link(delayed, 1e8, fitted) is fitted


@pytest.mark.root
@pytest.mark.timeout(240)
def test_smoke_on_the_testbed(tmp_path: Path) -> None:
    from thinwire.analysis.validate import repredict, run_validation
    from thinwire.testbed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cfg = ValidationConfig(
        model="tiny",
        batch_size=2,
        hosts=2,
        rates=("1gbit",),
        steps=6,
        freeze_step=2,
        skip_steps=1,
        profile_warmup=1,
        profile_steps=2,
        fit_min_bytes=256 * 1024,  # 256 KiB-1 MiB: large enough to grow with size
        fit_max_bytes=MIB,
        local_steps=3,
    )
    before = own_clusters()
    res = run_validation(cfg, tmp_path / "v")
    rows = res["rates"][0]["rows"]
    # Steps 2..2 leave no pair for the fused warmup: DDP, the 1-bit stage and DiLoCo's
    # one whole round after the skipped step (steps 4..6).
    assert [r["scheme"] for r in rows] == ["ddp", "onebit", "diloco"]
    assert (rows[2]["measured"]["first_step"], rows[2]["measured"]["last_step"]) == (4, 6)
    for r in rows:
        assert r["measured"]["steps"] >= 2 and r["measured"]["mean_s"] > 0
        assert r["predicted"]["step_s"] >= r["predicted"]["compute_s"] > 0
        assert math.isfinite(r["err_pct"])
    # The link is fitted on the cluster: fp32 and the 1-bit call, benchmarked there.
    link = res["rates"][0]["link"]
    assert link["source"] == "fitted" and len(link["onebit_latency"]) == 3  # 3 sizes
    assert rows[1]["link"]["onebit_latency"] == link["onebit_latency"]
    # Every scheme predicted from the DDP run's own record too, the 1-bit step timed on
    # the cluster's hosts on that run's parameters.
    for r in rows:
        assert r["predicted_recorded"]["step_s"] > 0 and math.isfinite(r["err_recorded_pct"])
    timed = json.loads((tmp_path / "v" / "1gbit" / "onebit-step" / "optimizer.json").read_text())
    assert len(timed["ranks"]) == 2 and res["rates"][0]["recorded"]["onebit_update_s"] > 0
    assert "from the DDP run's record" in (tmp_path / "v" / "validation.md").read_text()
    # predicted again from what was saved (the record, the timed step): the same numbers
    again = repredict(tmp_path / "v")["rates"][0]["rows"]
    assert [r["predicted_recorded"] for r in again] == [r["predicted_recorded"] for r in rows]
    assert json.loads((tmp_path / "v" / "validation.json").read_text())["rates"][0]["rows"]
    assert own_clusters() <= before  # its cluster is gone


def test_repredict_refits_the_link_from_saved_runs(tmp_path: Path) -> None:
    # A saved validation (one rate) built by hand: profiles, training records, benchmark.
    from dataclasses import asdict

    from thinwire.analysis.validate import repredict

    cfg = ValidationConfig(rates=("100mbit",), steps=8, freeze_step=3, skip_steps=1)
    rdir = tmp_path / "100mbit"
    for k in range(3):
        for kind, scale in (("alone", 0.5), ("colocated", 1.0)):
            prof = _profile(scale * (1 + k / 10), observed=[[2, 1], [0]] if k == 0 else None)
            prof.meta["onebit_codec_s_per_byte"] = 1e-9
            save_profile(prof, rdir / f"profile-{k}-{kind}" / "profile-0.json")
    for algo, secs in (("adamw", 2.0), ("onebit-adam", 1.2)):
        (rdir / algo).mkdir(parents=True)
        lines = [json.dumps({"step": s, "step_s": secs + s / 100}) for s in range(1, 9)]
        (rdir / algo / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    alpha, bw, n = 0.02, 0.09e9, 4  # an exact ring across a WAN
    rows = [
        {
            "method": "fp32",
            "size_bytes": s,
            "world_size": n,
            "time_s": ring_time(8 * 2 * (n - 1) / n * s / bw, ring_rounds(s, n), alpha),
        }
        for s in (2**k for k in range(16, 25))
    ]
    (rdir / "bench").mkdir()
    (rdir / "bench" / "allreduce.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    saved = {
        "format": "thinwire.validation/1",
        "config": asdict(cfg),
        "rates": [
            {
                "rate": "100mbit",
                "rate_bits": 100e6,
                "profiles": [{}, {}, {}],
                "runs": {"adamw": {}, "onebit-adam": {}},
                "load_avg_1min": {},
            }
        ],
    }
    (tmp_path / "validation.json").write_text(json.dumps(saved))
    res = repredict(tmp_path, fit_min_bytes=MIB)
    entry = res["rates"][0]
    assert entry["link"]["bandwidth_gbps"] == pytest.approx(0.09, rel=1e-3)
    assert entry["link"]["alpha_per_message_s"] == pytest.approx(alpha, rel=1e-3)
    assert entry["link_fit"]["fit"]["points"] == 5  # 1, 2, 4, 8, 16 MiB
    assert [r["scheme"] for r in entry["rows"]] == ["ddp", "ddp@warmup", "onebit"]
    ddp = entry["rows"][0]
    assert ddp["measured"]["first_step"] == 2 and ddp["measured"]["steps"] == 7
    assert ddp["err_pct"] == pytest.approx(
        error_pct(ddp["predicted"]["step_s"], ddp["measured"]["mean_s"])
    )
    # DDP runs between profiles 0 and 1: compute is their mean iteration (1.0 and 1.1 s).
    assert ddp["predicted"]["compute_s"] == pytest.approx(1.05)
    assert entry["rows"][2]["predicted"]["compute_s"] == pytest.approx(1.15)
    assert res["refit"]["min_bytes"] == MIB
