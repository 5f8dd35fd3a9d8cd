"""The what-if model against the paper's released profiles, and its analytic cases.

Golden values (Zhang et al., arXiv 2006.10103, section 4 of
shared/spec/network_analysis.md): Horovod fusion, no latency, the paper's vector-add
table, n = 64, c = 1 -> ResNet50 SF ~0.54 at 10 Gbit/s and ~0.91 at 25 Gbit/s, VGG16
~0.62 at 40 Gbit/s. Tolerance: +-0.03 absolute. The SFs are computed from the logs here.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from thinwire.analysis import (
    AddCost,
    Bucket,
    NetworkConfig,
    ParamTiming,
    Profile,
    horovod_buckets,
    read_bklog,
    read_vec_add_table,
    required_bandwidth,
    required_compression,
    required_local_steps,
    simulate,
)
from thinwire.comm.onebit_allreduce import onebit_wire_bytes
from thinwire.errors import ConfigError


def _golden_dir() -> Path:
    env = os.environ.get("THINWIRE_SHARED")
    base = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared"
    return base / "data" / "training-bottleneck"


GOLDEN = _golden_dir()
needs_golden = pytest.mark.skipif(
    not (GOLDEN / "resnet50.bk.log").exists(),
    reason=f"the paper's logs are not at {GOLDEN} (set THINWIRE_SHARED to the shared/ folder)",
)


@needs_golden
@pytest.mark.parametrize(
    ("model", "gbps", "expected"),
    [("resnet50", 10, 0.54), ("resnet50", 25, 0.91), ("vgg16", 40, 0.62)],
)
def test_paper_scaling_factors(model: str, gbps: float, expected: float) -> None:
    add = read_vec_add_table(GOLDEN / "cuda_vec_add.log")
    prof = read_bklog(GOLDEN / f"{model}.bk.log")
    res = simulate(prof, horovod_buckets(prof), NetworkConfig(workers=64, bandwidth_gbps=gbps), add)
    assert res.scaling_factor == pytest.approx(expected, abs=0.03)
    # Overlap matters: without it the same network scales strictly worse.
    no_overlap = NetworkConfig(workers=64, bandwidth_gbps=gbps, overlap=False)
    assert simulate(prof, horovod_buckets(prof), no_overlap, add).scaling_factor < (
        res.scaling_factor
    )


@needs_golden
def test_paper_logs_parse_and_paper_iteration_times() -> None:
    r50 = read_bklog(GOLDEN / "resnet50.bk.log")
    assert len(r50.params) == 161
    assert r50.iteration_s == pytest.approx(0.12809)
    # ResNet50 has ~25.6M fp32 parameters.
    assert r50.grad_bytes / 4 == pytest.approx(25.56e6, rel=0.01)
    ready = [p.ready_s for p in r50.ready]
    assert ready == sorted(ready)
    assert read_bklog(GOLDEN / "resnet101.bk.log").iteration_s == pytest.approx(0.19201)
    assert read_bklog(GOLDEN / "vgg16.bk.log").iteration_s == pytest.approx(0.19452)


@needs_golden
def test_paper_compression_needed_is_small_at_10g() -> None:
    # The paper's conclusion: ~2-5x suffices at 10 Gbit/s, not 100x.
    add = read_vec_add_table(GOLDEN / "cuda_vec_add.log")
    prof = read_bklog(GOLDEN / "resnet50.bk.log")
    b = horovod_buckets(prof)
    cfg = NetworkConfig(workers=64, bandwidth_gbps=10)
    c = required_compression(prof, b, cfg, 0.9, add)
    assert c is not None and 1.5 < c < 5
    from dataclasses import replace

    assert simulate(prof, b, replace(cfg, compression=c), add).scaling_factor >= 0.9
    assert simulate(prof, b, replace(cfg, compression=c * 0.99), add).scaling_factor < 0.9
    bw = required_bandwidth(prof, b, cfg, 0.9, add)
    assert bw is not None and 10 < bw <= 25


def _one_param_profile(nbytes: int, backward_s: float, iteration_s: float) -> Profile:
    return Profile(
        model="one",
        iteration_s=iteration_s,
        backward_s=backward_s,
        params=[ParamTiming("w", 0, nbytes, ready_s=backward_s)],
    )


def test_bucket_ready_at_backward_end_is_fully_exposed() -> None:
    prof = _one_param_profile(10_000_000, backward_s=0.05, iteration_s=0.1)
    b = [Bucket((0,), 10_000_000, 0.05)]
    cfg = NetworkConfig(workers=4, bandwidth_gbps=1, alpha_s=1e-4)
    res = simulate(prof, b, cfg)
    net = 2 * 8 * 10_000_000 * 3 / (4 * 1e9)
    # Bandwidth-bound: a 1 MiB segment's 8 ms on the wire hides its 0.1 ms round trip.
    assert res.exposed_s == pytest.approx(net)
    assert res.scaling_factor == pytest.approx(0.1 / (0.1 + net))
    # Link utilization: the wire bytes over what the link carries in one step.
    assert res.link_utilization == pytest.approx(net / res.step_s)
    # Latency-bound: a round trip per pair of 1 MiB segments (10 MB is over 2n MiB, so
    # more than 2 (n-1) of them), with half the wire time beside them.
    slow = simulate(prof, b, replace(cfg, alpha_s=0.05))
    rounds = 3 / 4 * 10_000_000 / 2**20
    assert slow.exposed_s == pytest.approx(rounds * 0.05 + net / 2)
    assert slow.breakdown()["latency_s"] == pytest.approx(rounds * 0.05 - net / 2)


def test_ring_latency_overlaps_the_wire_as_gloo_pipelines_it() -> None:
    from thinwire.analysis.collective_cost import ring_rounds, ring_time

    # Up to 2n MiB every chunk is two segments: 2 (n-1) round trips; then one per MiB sent.
    assert ring_rounds(1e6, 4) == 6 and ring_rounds(8 * 2**20, 4) == 6
    assert ring_rounds(32 * 2**20, 4) == pytest.approx(24)
    assert ring_rounds(1e9, 1) == 0
    assert ring_time(1.0, 6, 0.0) == 1.0  # no latency: the paper's wire time
    # Round trips hide while they take at most half the wire time (two segments in flight).
    assert ring_time(1.0, 6, 0.05) == 1.0
    assert ring_time(1.0, 6, 0.2) == pytest.approx(1.2 + 0.5)


def _two_buckets(nbytes: int, ready_a: float, ready_b: float) -> tuple[Profile, list[Bucket]]:
    """Two parameters of ``nbytes``, one bucket each, ready at the given times; backward
    ends at 0.1 s of a 0.3 s step."""
    prof = Profile(
        model="two",
        iteration_s=0.3,
        backward_s=0.1,
        params=[ParamTiming("a", 0, nbytes, ready_a), ParamTiming("b", 1, nbytes, ready_b)],
    )
    return prof, [Bucket((0,), nbytes, ready_a), Bucket((1,), nbytes, ready_b)]


def test_concurrent_collectives_share_the_link_and_hide_each_others_latency() -> None:
    """gloo runs two collectives at once: latency-bound ones overlap almost fully,
    bandwidth-bound ones take the link in turns (the bytes still add up)."""
    nbytes = 2_000_000
    prof, b = _two_buckets(nbytes, 0.1, 0.1)
    wan = NetworkConfig(workers=4, bandwidth_gbps=1, alpha_s=0.05)
    one = simulate(prof, b, wan)
    two = simulate(prof, b, replace(wan, concurrency=2))
    alone = one.events[0].end_s - one.events[0].start_s
    assert one.exposed_s == pytest.approx(2 * alone)  # FIFO: one after the other
    assert two.events[1].start_s == pytest.approx(0.1)  # both start at once
    wire = 8 * 2 * 3 / 4 * nbytes / 1e9
    share = 2 * wire / alone  # together they ask for this much of the link
    assert share < 1  # ... less than all of it: neither slows the other
    assert two.exposed_s == pytest.approx(alone)
    # Bandwidth-bound (no latency): sharing the link changes nothing in total.
    lan = NetworkConfig(workers=4, bandwidth_gbps=1)
    lan_one, lan_two = simulate(prof, b, lan), simulate(prof, b, replace(lan, concurrency=2))
    assert lan_two.exposed_s == pytest.approx(lan_one.exposed_s) == pytest.approx(2 * wire)
    assert [e.end_s for e in lan_two.events] == pytest.approx([0.1 + 2 * wire] * 2)
    # Unequal buckets: the small one finishes first, then the big one has the link alone.
    big = [Bucket((0,), nbytes, 0.1), Bucket((1,), 3 * nbytes, 0.1)]
    res = simulate(prof, big, replace(lan, concurrency=2))
    assert res.events[0].end_s == pytest.approx(0.1 + 2 * wire)
    assert res.events[1].end_s == pytest.approx(0.1 + 4 * wire)
    with pytest.raises(ConfigError, match="concurrency must be an integer >= 1"):
        NetworkConfig(concurrency=0)


def test_onebit_call_latency_measured_replaces_two_alphas() -> None:
    from thinwire.analysis.network_model import bucket_cost

    cfg = NetworkConfig(workers=4, bandwidth_gbps=0.1, alpha_s=0.1, scheme="onebit")
    # phase 1 with the metadata beside it, then phase 2
    assert bucket_cost(4e6, cfg, AddCost.zero())["latency_s"] == pytest.approx(0.2)
    measured = replace(cfg, onebit_latency=((1e6, 0.35), (4e6, 0.37), (16e6, 0.36), (1e9, 9.0)))
    assert bucket_cost(4e6, measured, AddCost.zero())["latency_s"] == pytest.approx(0.36)
    ring = replace(measured, scheme="ring")  # the ring keeps its own latency
    assert bucket_cost(4e6, ring, AddCost.zero()) == bucket_cost(
        4e6, replace(cfg, scheme="ring"), AddCost.zero()
    )
    with pytest.raises(ConfigError, match="1-bit call latency needs"):
        NetworkConfig(onebit_latency=((1e6, -1.0),))


def test_infinite_compression_leaves_only_reduction_cost() -> None:
    prof = _one_param_profile(8_000_000, backward_s=0.02, iteration_s=0.05)
    b = [Bucket((0,), 8_000_000, 0.02)]
    add = AddCost((1e3, 1e7), (1e-5, 1e-3), "synthetic")
    res = simulate(prof, b, NetworkConfig(workers=8, bandwidth_gbps=1, compression=math.inf), add)
    assert res.exposed_s == pytest.approx(7 * add(1_000_000))
    assert res.wire_bytes == 0


def test_onebit_and_localsgd_volumes() -> None:
    prof = _one_param_profile(4_000_000, backward_s=0.02, iteration_s=0.05)
    b = [Bucket((0,), 4_000_000, 0.02)]
    n = 8
    onebit = simulate(prof, b, NetworkConfig(workers=n, scheme="onebit"))
    assert onebit.wire_bytes == onebit_wire_bytes(1_000_000, n)
    # one bit per element plus a 32-bit scale per block of 256: 28x fewer than fp32
    bits = 2 * (n - 1) / n * 4_000_000 / 32
    assert onebit.wire_bytes == pytest.approx(bits * (1 + 32 / 256), rel=0.01)
    full = simulate(prof, b, NetworkConfig(workers=n))
    local = simulate(prof, b, NetworkConfig(workers=n, scheme="localsgd", local_steps=10))
    assert local.exposed_s == pytest.approx(full.exposed_s / 10)
    h = required_local_steps(prof, b, NetworkConfig(workers=n, bandwidth_gbps=0.1), 0.9)
    at_h = simulate(
        prof, b, NetworkConfig(workers=n, bandwidth_gbps=0.1, scheme="localsgd", local_steps=h)
    )
    assert at_h.scaling_factor >= 0.9
    if h > 1:
        before = NetworkConfig(workers=n, bandwidth_gbps=0.1, scheme="localsgd", local_steps=h - 1)
        assert simulate(prof, b, before).scaling_factor < 0.9


def test_streaming_diloco_spreads_the_same_bytes_over_fragments() -> None:
    prof = _one_param_profile(4_000_000, backward_s=0.02, iteration_s=0.05)
    b = [Bucket((0,), 4_000_000, 0.02)]
    slow = NetworkConfig(workers=4, bandwidth_gbps=0.1, scheme="localsgd", local_steps=12)
    whole = simulate(prof, b, slow)
    parts = simulate(prof, b, replace(slow, fragments=4))
    # The same bytes per step; a quarter of them per sync, four syncs per round.
    assert parts.wire_bytes == pytest.approx(whole.wire_bytes)
    assert parts.sync_wire_bytes == pytest.approx(whole.sync_wire_bytes / 4)
    assert whole.sync_wire_bytes == pytest.approx(12 * whole.wire_bytes)
    assert parts.exposed_s == pytest.approx(whole.exposed_s)  # nothing overlaps yet
    # Each fragment's 0.12 s on the wire (1.5 MB at 100 Mbit/s) runs behind one step
    # (0.05 s) of compute; at 200 Mbit/s two steps hide all of it.
    wire_s = parts.events[0].end_s - parts.events[0].start_s
    assert wire_s == pytest.approx(0.12)
    behind = simulate(prof, b, replace(slow, fragments=4, fragment_overlap=1))
    assert behind.exposed_s == pytest.approx(4 * (0.12 - 0.05) / 12)
    faster = replace(slow, bandwidth_gbps=0.2, fragments=4, fragment_overlap=2)
    hidden = simulate(prof, b, faster)
    assert hidden.exposed_s == 0.0 and hidden.scaling_factor == 1.0
    with pytest.raises(ConfigError, match=r"below H // fragments = 3"):
        replace(slow, fragments=4, fragment_overlap=3)
    with pytest.raises(ConfigError, match=r"fragments must be an integer in \[1, H=12\]"):
        replace(slow, fragments=13)
    with pytest.raises(ConfigError, match="Local-SGD's"):
        NetworkConfig(local_steps=4, fragments=2)


def test_single_worker_and_no_gradients_communicate_nothing() -> None:
    prof = _one_param_profile(1000, backward_s=0.01, iteration_s=0.02)
    res = simulate(prof, [Bucket((0,), 1000, 0.01)], NetworkConfig(workers=1))
    assert res.scaling_factor == 1.0 and res.wire_bytes == 0
    frozen = Profile("f", 0.02, 0.01, [ParamTiming("w", 0, 1000, ready_s=None)])
    assert frozen.grad_bytes == 0 and len(frozen.frozen) == 1
    assert horovod_buckets(frozen) == []
    res = simulate(frozen, [], NetworkConfig(workers=8))
    assert res.scaling_factor == 1.0 and res.link_utilization == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": 0}, "workers must be an integer >= 1"),
        ({"bandwidth_gbps": -1.0}, "bandwidth must be .* > 0"),
        ({"compression": 0.5}, r"compression ratio must be >= 1"),
        ({"alpha_s": -1e-6}, "latency alpha must be >= 0"),
        ({"scheme": "carrier-pigeon"}, "unknown scheme"),
        ({"scheme": "localsgd", "local_steps": 0}, "local steps H must be"),
    ],
)
def test_impossible_networks_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        NetworkConfig(**kwargs)


@needs_golden
def test_study_needs_are_those_of_plain_ddp_and_alternatives_are_priced() -> None:
    from thinwire.analysis import run_study

    add = read_vec_add_table(GOLDEN / "cuda_vec_add.log")
    prof = read_bklog(GOLDEN / "resnet50.bk.log")
    b = horovod_buckets(prof)
    ring = NetworkConfig(workers=64, bandwidth_gbps=10)
    onebit = NetworkConfig(
        workers=64, bandwidth_gbps=10, scheme="onebit", overlap=False, codec_s_per_byte=1e-10
    )
    s_ring = run_study(prof, b, ring, add, onebit_codec_s_per_byte=1e-10)
    s_one = run_study(prof, b, onebit, add)
    assert s_one["needed"] == s_ring["needed"]
    assert s_one["alternatives"] == s_ring["alternatives"]
    names = [a["name"] for a in s_ring["alternatives"]]
    assert names[0].startswith("fp32") and any(n.startswith("1-bit Adam") for n in names)
    fp32 = s_ring["alternatives"][0]
    assert fp32["scaling_factor"] == pytest.approx(s_ring["result"]["scaling_factor"])
    # Every sweep value is a scaling factor, and more bandwidth never hurts.
    for row in s_ring["sweeps"]["sf_by_workers_gbps"]:
        assert all(0 < v <= 1 for v in row) and row == sorted(row)


def test_report_names_frozen_parameters_and_handles_nothing_to_send() -> None:
    from thinwire.analysis import ddp_buckets, render_report, run_study

    prof = Profile(
        "m",
        0.1,
        0.05,
        [ParamTiming("w", 0, 4_000_000, ready_s=0.05), ParamTiming("f", 1, 400, ready_s=None)],
    )
    cfg = NetworkConfig(workers=4, bandwidth_gbps=0.1)
    text = render_report(run_study(prof, ddp_buckets(prof), cfg))
    assert "1 parameters (400 B) never got a gradient" in text
    assert "IS the bottleneck" in text
    frozen = Profile("f", 0.1, 0.05, [ParamTiming("f", 0, 400, ready_s=None)])
    study = run_study(frozen, ddp_buckets(frozen), cfg)
    assert study["result"]["scaling_factor"] == 1.0
    text = render_report(study)
    assert "nothing to communicate" in text and "NOT the bottleneck" in text


def test_hierarchical_allreduce_costs() -> None:
    from thinwire.analysis.network_model import bucket_cost

    s = 8_000_000
    add = AddCost.zero()
    one_node = bucket_cost(
        s, NetworkConfig(workers=8, workers_per_node=8, alpha_s=1e-3, intra_node_gbps=100), add
    )
    # A single node never touches the network: only the intra-node phases, no latency.
    assert one_node["wire"] == 0 and one_node["latency_s"] == 0
    assert one_node["network_s"] == pytest.approx(8 * 2 * 7 / 8 * s / 100e9)
    flat = NetworkConfig(workers=32, bandwidth_gbps=10, alpha_s=1e-3)
    hier = NetworkConfig(workers=32, bandwidth_gbps=10, alpha_s=1e-3, workers_per_node=8)
    f, h = bucket_cost(s, flat, add), bucket_cost(s, hier, add)
    # Latency beyond the wire: 2 (m-1) round trips over 4 nodes, 2 (n-1) over 32 workers.
    h_wire, f_wire = 8 * 2 * 3 / 4 * s / 10e9, 8 * 2 * 31 / 32 * s / 10e9
    assert h["latency_s"] == pytest.approx(max(0, 2 * 3 * 1e-3 - h_wire / 2))
    assert f["latency_s"] == pytest.approx(62e-3 - f_wire / 2)
    assert h["wire"] == pytest.approx(2 * 3 / 4 * s)
    with pytest.raises(ConfigError, match="dividing workers=30"):
        NetworkConfig(workers=30, workers_per_node=8)


def test_two_tier_jobs_price_each_tier_and_1bit_across_nodes_per_shard() -> None:
    """With nodes (HSDP islands) the bytes come per tier, and 1-bit crosses the nodes as
    one 1-bit allreduce per worker's shard (``--shard-within g``), not as a flat one."""
    from thinwire.analysis import ddp_buckets, render_report, run_study
    from thinwire.analysis.network_model import bucket_cost

    s, add = 8_000_000, AddCost.zero()
    ring = NetworkConfig(workers=8, bandwidth_gbps=0.05, workers_per_node=2)
    onebit = replace(ring, scheme="onebit")
    r, o = bucket_cost(s, ring, add), bucket_cost(s, onebit, add)
    # Inside a node each worker sends its reduce-scatter and all-gather: 2 (g-1)/g S.
    assert r["intra_wire"] == o["intra_wire"] == pytest.approx(s)
    # Across the 4 nodes: 2 (m-1)/m S through each node's link, or each of its 2 workers'
    # 1-bit allreduce of its half over 4 nodes (28x fewer with scales).
    assert r["wire"] == pytest.approx(2 * 3 / 4 * s)
    assert o["wire"] == 2 * onebit_wire_bytes(s // 8, 4)
    assert 25 < r["wire"] / o["wire"] < 32
    flat = bucket_cost(s, NetworkConfig(workers=8, bandwidth_gbps=0.05), add)
    assert flat["intra_wire"] == 0
    # The report names the tiers and the HSDP row; the flat comm hook is not offered.
    prof = Profile("m", 0.2, 0.1, [ParamTiming("w", 0, s, ready_s=0.05)])
    study = run_study(prof, ddp_buckets(prof), ring)
    text = render_report(study)
    assert "across nodes (each node's link)" in text and "inside/step" in text
    assert "1-bit Adam/LAMB across nodes (--shard-within 2, after backward)" in text
    assert "comm hook" not in text
    hsdp = next(a for a in study["alternatives"] if "--shard-within" in a["name"])
    assert hsdp["intra_wire_bytes"] == pytest.approx(s)
    assert hsdp["wire_bytes"] == pytest.approx(o["wire"])


def test_overlapped_onebit_hook_hides_the_wire_but_not_the_codec() -> None:
    """The 1-bit comm hook: a bucket ready mid-backward is reduced during backward (its
    wire time hidden), but its compression compute shares the processor and delays
    backward; 1-bit Adam/LAMB reduce after backward (nothing hidden)."""
    from thinwire.analysis.network_model import bucket_cost

    nbytes = 4_000_000
    prof, b = _two_buckets(nbytes, 0.05, 0.1)
    codec = 2e-9
    hook = NetworkConfig(
        workers=4, bandwidth_gbps=1, alpha_s=1e-4, scheme="onebit", codec_s_per_byte=codec
    )
    c = bucket_cost(nbytes, hook, AddCost.zero())
    busy = c["network_s"] + c["latency_s"] + c["codec_s"]
    assert c["codec_s"] == pytest.approx(codec * nbytes)
    res = simulate(prof, b, hook)
    # Bucket 0 starts at 0.05 and its codec delays backward, and bucket 1, by codec_s.
    first_end = 0.05 + busy
    second_start = max(0.1 + c["codec_s"], first_end)
    assert res.compute_stall_s == pytest.approx(c["codec_s"])
    assert res.events[1].ready_s == pytest.approx(0.1 + c["codec_s"])
    assert res.exposed_s == pytest.approx(second_start + busy - 0.1)
    # Without the codec only the wire is left, and bucket 0's is hidden.
    free = simulate(prof, b, replace(hook, codec_s_per_byte=0.0))
    wire = busy - c["codec_s"]
    assert free.compute_stall_s == 0.0
    assert free.exposed_s == pytest.approx(max(0.1, 0.05 + wire) + wire - 0.1)
    # After backward (1-bit Adam/LAMB): both buckets fully exposed, backward undisturbed.
    after = simulate(prof, b, replace(hook, overlap=False))
    assert after.exposed_s == pytest.approx(2 * busy) and after.compute_stall_s == 0.0
    assert free.exposed_s < res.exposed_s < after.exposed_s


def test_advice_steers_adam_users_away_from_the_1bit_hook() -> None:
    """When only the overlapped 1-bit hook reaches the target, the advice still tells an
    Adam user to take 1-bit Adam (the hook's 1-bit gradients lose Adam's per-element
    second moment), or Local-SGD."""
    from thinwire.analysis.report import recommend

    study = {
        "target": 0.9,
        "result": {
            "config": {"workers": 4, "bandwidth_gbps": 0.1},
            "scaling_factor": 0.4,
            "exposed_s": 0.3,
            "breakdown": {"network_s": 1.0},
        },
        "needed": {"compression": 8.0, "local_steps": 5},
        "alternatives": [
            {"name": "1-bit Adam/LAMB (1-bit, after backward)", "scaling_factor": 0.85},
            {"name": "1-bit allreduce, overlapped (comm hook)", "scaling_factor": 0.95},
        ],
    }
    _, advice = recommend(study)
    assert "use the overlapped 1-bit allreduce comm hook" in advice
    assert "with Adam or AdamW use 1-bit Adam instead (predicted SF 85.0%)" in advice
    assert advice.endswith(
        "; or Local-SGD / DiLoCo averaging every H = 5 steps reaches the target."
    )
