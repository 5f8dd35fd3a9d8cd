"""Everything ``thinwire analyze report`` needs, computed once: the simulation JSON.

:func:`run_study` simulates one configuration in detail (with per-bucket events for
the Gantt chart), inverts the model for the target scaling factor (compression ratio,
bandwidth, Local-SGD period), prices thinwire's alternatives on the same network, and
sweeps the grids behind the plots:

* SF vs bandwidth, one line per worker count;
* SF over (bandwidth, compression ratio) at the configured worker count, which the
  report draws both as lines (one per bandwidth) and as a heatmap.

The result is plain JSON (``format: thinwire.simulation/1``), so a study computed on
one machine can be rendered on another, and a test can read every number.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from thinwire.analysis.buckets import Bucket, ddp_buckets
from thinwire.analysis.costs import AddCost
from thinwire.analysis.network_model import (
    NetworkConfig,
    required_bandwidth,
    required_compression,
    required_local_steps,
    simulate,
)
from thinwire.analysis.profile import Profile
from thinwire.comm.onebit_hook import HOOK_BLOCK
from thinwire.compress.quantize import QuantCompressor
from thinwire.errors import ConfigError

__all__ = ["SIMULATION_FORMAT", "run_study", "sweep_values"]

SIMULATION_FORMAT = "thinwire.simulation/1"
STANDARD_GBPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 25, 40, 100, 200, 400)
STANDARD_RATIOS = (1, 1.5, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 1024)
STANDARD_WORKERS = (2, 4, 8, 16, 32, 64)
STANDARD_CAPS_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 64, 256)


def sweep_values(base: float, standard: tuple[float, ...], span: float) -> list[float]:
    """Standard grid values within ``[base/span, base*span]``, plus ``base`` itself."""
    vals = {float(v) for v in standard if base / span <= v <= base * span}
    vals.add(float(base))
    return sorted(vals)


def _sf(profile: Profile, buckets: list[Bucket], cfg: NetworkConfig, add: AddCost) -> float:
    return simulate(profile, buckets, cfg, add).scaling_factor


def _plain(cfg: NetworkConfig) -> NetworkConfig:
    # Plain DDP on the same network: fp32 ring, overlapped, no codec. A codec cost the
    # user gave for a ring compressor is kept; the 1-bit scheme's is not a ring's.
    codec = 0.0 if cfg.scheme == "onebit" else cfg.codec_s_per_byte
    overlap = True if cfg.scheme == "onebit" else cfg.overlap
    return replace(
        cfg,
        scheme="ring",
        compression=1.0,
        local_steps=1,
        codec_s_per_byte=codec,
        overlap=overlap,
    )


def _cap_sweep(profile: Profile, cfg: NetworkConfig, add: AddCost) -> list[dict[str, float]]:
    # DDP's bucket cap trades overlap (small buckets start early) against per-message
    # latency; the report suggests a cap when one alone reaches the target.
    return [
        {"cap_mb": cap, "scaling_factor": _sf(profile, ddp_buckets(profile, cap), cfg, add)}
        for cap in STANDARD_CAPS_MB
    ]


def _alternatives(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    add: AddCost,
    local_steps: int | None,
    onebit_codec: float,
) -> list[dict[str, Any]]:
    ring = _plain(cfg)
    onebit = replace(ring, scheme="onebit", codec_s_per_byte=onebit_codec)
    options: list[tuple[str, NetworkConfig]] = [
        ("fp32 allreduce (plain DDP)", ring),
        ("fp16/bf16 allreduce (2x)", replace(ring, compression=2.0)),
    ]
    g = cfg.workers_per_node
    if g == 1:
        options += [
            ("1-bit allreduce, overlapped (comm hook)", replace(onebit, onebit_block=HOOK_BLOCK)),
            ("1-bit Adam/LAMB (1-bit, after backward)", replace(onebit, overlap=False)),
        ]
    else:
        # With nodes, thinwire's 1-bit path is the optimizers under HSDP: FSDP2 inside a
        # node, each shard 1-bit across the nodes (the comm hook is flat DDP's only).
        options.append(
            (
                f"1-bit Adam/LAMB across nodes (--shard-within {g}, after backward)",
                replace(onebit, overlap=False),
            )
        )
    hs = sorted({h for h in (4, 16, local_steps) if h is not None and h > 1})
    options += [
        (f"Local-SGD/DiLoCo, H={h}", replace(ring, scheme="localsgd", local_steps=h)) for h in hs
    ]
    if hs and hs[-1] >= 8:
        # Streaming DiLoCo at the largest H: 4 fragments in turn, each exchange behind a
        # step of compute, int4 with its block scales (thinwire.compress.quantize).
        h = hs[-1]
        streaming = replace(
            ring,
            scheme="localsgd",
            local_steps=h,
            fragments=4,
            fragment_overlap=1,
            compression=QuantCompressor("int4").ratio(1 << 20),
        )
        options.append((f"Local-SGD/Streaming DiLoCo, H={h}, 4 fragments, int4", streaming))
    out = []
    for name, alt in options:
        r = simulate(profile, buckets, alt, add)
        out.append({"name": name, **r.to_json()})
    return out


def run_study(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    add: AddCost | None = None,
    *,
    target: float = 0.9,
    bucket_kind: str = "ddp",
    onebit_codec_s_per_byte: float | None = None,
    workers_sweep: list[int] | None = None,
    gbps_sweep: list[float] | None = None,
    ratio_sweep: list[float] | None = None,
) -> dict[str, Any]:
    """Simulate ``cfg``, invert it for ``target``, price alternatives, sweep the grids.

    The needed compression, bandwidth and Local-SGD period are those of plain DDP on
    the same network (fp32 ring; overlapped when ``cfg`` is a 1-bit scheme).
    ``onebit_codec_s_per_byte`` prices the 1-bit alternatives' compute (default: the
    configured codec cost if ``cfg`` is 1-bit, else 0).
    """
    add = add if add is not None else AddCost.zero()
    if not 0 < target <= 1:
        raise ConfigError(f"target scaling factor must be in (0, 1], got {target}")
    base = simulate(profile, buckets, cfg, add)
    ring = _plain(cfg)
    if onebit_codec_s_per_byte is None:
        onebit_codec_s_per_byte = cfg.codec_s_per_byte if cfg.scheme == "onebit" else 0.0
    need_c = required_compression(profile, buckets, ring, target, add)
    need_b = required_bandwidth(profile, buckets, ring, target, add)
    need_h = required_local_steps(profile, buckets, ring, target, add)
    sweeps = _sweeps(profile, buckets, cfg, add, workers_sweep, gbps_sweep, ratio_sweep)
    return {
        "format": SIMULATION_FORMAT,
        "profile": profile.summary(),
        "buckets": {
            "kind": bucket_kind,
            "count": len(buckets),
            "nbytes": [b.nbytes for b in buckets],
            "ready_s": [b.ready_s for b in buckets],
        },
        "reduction": add.source,
        "target": target,
        "result": base.to_json(events=True),
        "needed": {
            "compression": need_c,
            "bandwidth_gbps": need_b,
            "local_steps": need_h,
            "infinite_compression_sf": _sf(
                profile, buckets, replace(ring, compression=math.inf), add
            ),
        },
        "alternatives": _alternatives(profile, buckets, cfg, add, need_h, onebit_codec_s_per_byte),
        "onebit_codec_s_per_byte": onebit_codec_s_per_byte,
        "bucket_caps": _cap_sweep(profile, cfg, add) if bucket_kind in ("ddp", "observed") else [],
        "sweeps": sweeps,
    }


def _sweeps(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    add: AddCost,
    workers_sweep: list[int] | None,
    gbps_sweep: list[float] | None,
    ratio_sweep: list[float] | None,
) -> dict[str, Any]:
    """The study's grids: scaling factor by workers and bandwidth, and (as a ring) by
    bandwidth and compression ratio; the standard grids where none is given."""
    g = cfg.workers_per_node
    # With nodes of g workers, only whole nodes make a cluster.
    workers = sorted({w for w in (workers_sweep or STANDARD_WORKERS) if w % g == 0} | {cfg.workers})
    gbps = gbps_sweep or sweep_values(cfg.bandwidth_gbps, STANDARD_GBPS, 1000.0)
    ratios = ratio_sweep or list(STANDARD_RATIOS)
    for v in gbps:
        if not v > 0:
            raise ConfigError(f"sweep bandwidths must be > 0 Gbit/s, got {v}")
    for v in ratios:
        if not v >= 1:
            raise ConfigError(f"sweep compression ratios must be >= 1, got {v}")
    by_bw = [
        [_sf(profile, buckets, replace(cfg, workers=n, bandwidth_gbps=b), add) for b in gbps]
        for n in workers
    ]
    ring_cfg = replace(cfg, scheme="ring") if cfg.scheme == "onebit" else cfg
    grid = [
        [
            _sf(profile, buckets, replace(ring_cfg, bandwidth_gbps=b, compression=c), add)
            for c in ratios
        ]
        for b in gbps
    ]
    return {
        "workers": workers,
        "gbps": gbps,
        "ratios": ratios,
        "sf_by_workers_gbps": by_bw,
        "sf_by_gbps_ratio": grid,
    }
