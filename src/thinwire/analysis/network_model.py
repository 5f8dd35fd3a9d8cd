"""A deterministic event model of data-parallel communication: what if the network were...

The model of Zhang et al., "Is Network the Bottleneck of Distributed Training?"
(arXiv 2006.10103), extended with latency, codec cost, 1-bit allreduce and Local-SGD.
Nothing sleeps: every time is computed.

One FIFO channel all-reduces the buckets (see :mod:`thinwire.analysis.buckets`) one at
a time; bucket ``k`` starts at ``max(ready_k, finish_{k-1})``. With ``overlap=False`` (or
for Local-SGD) every bucket waits for the end of the backward pass. The codec (the
compression compute, ``codec * S``) runs on the processor that runs backward: a bucket
whose collective starts while backward is still running delays backward's end, and the
ready time of every later bucket, by its codec time (the 1-bit comm hook on a CPU host:
its thread packs bits on the cores backward uses). Overlap hides the wire, not the
codec. The cost of a bucket of ``S`` bytes over ``n`` workers on links of ``B`` bit/s:

* ``ring`` (plain or compressed allreduce)::

      T(S) = 2 * 8S (n-1) / (n B c)      network: reduce-scatter + all-gather
           + (n-1) * t_add(S/n)          the reductions of the reduce-scatter
           + 2 (n-1) * alpha             one latency per message of the ring
           + codec * S                   compress + decompress compute, if measured

  ``c`` divides only the network term. ``alpha = 0``, ``codec = 0`` and the paper's
  vector-add table reproduce the paper.
* ``onebit`` (:class:`thinwire.comm.onebit_allreduce.OneBitAllreduce`: an all-to-all of
  sign bits, the chunk owner averages and re-compresses, an all-gather of the result):
  about ``2 (n-1)/n * S/32`` bytes per worker (the implementation's exact count, with
  padding, scales and metadata), the same reductions, 3 messages (three collectives of
  one step each: across a WAN the collective's tuner sends the metadata and phase 2 as
  a fan-out, and its all-to-all is one step already; on a LAN, where the ring's
  ``2 (n-1) + 1`` steps may stay, alpha is too small for the count to matter), plus
  ``codec * S`` (measure it with ``--measure-codec``). Gradients are
  assumed fp32; ``compression`` must stay 1. Overlapped, this is the 1-bit comm hook
  (:mod:`thinwire.comm.onebit_hook`: one thread reduces the buckets in order while
  backward goes on); with ``overlap=False``, 1-bit Adam/LAMB's one exchange after
  backward.
* hierarchical (``workers_per_node = g > 1``, ring and Local-SGD): reduce-scatter in
  each node over ``intra_node_gbps``, ring allreduce of the shards across the ``n/g``
  nodes, all-gather in each node; only ``2 (n/g - 1)`` messages cross the network.
* ``localsgd``: workers step alone and all-reduce the model every ``local_steps`` = H
  steps, after the step (nothing to overlap with), so the exposed time is amortised: a
  ring allreduce of all buckets divided by H.

Outputs (:class:`SimResult`): exposed communication (time after the undisturbed backward
pass that the step waits for the network or for the codec's delay of backward), step
time ``t_iter + exposed``, scaling factor
``SF = t_iter / (t_iter + exposed)``, link utilization (wire bytes per step over what the
link could have carried in that time), and per-bucket events for a Gantt chart.

:func:`required_compression`, :func:`required_bandwidth` and :func:`required_local_steps`
invert the model: the smallest ratio / rate / H reaching a target scaling factor. SF
never decreases when c or B grows, so bisection finds the threshold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from thinwire.analysis.buckets import Bucket
from thinwire.analysis.costs import AddCost
from thinwire.analysis.profile import Profile
from thinwire.comm.onebit_allreduce import onebit_wire_bytes
from thinwire.errors import ConfigError

__all__ = [
    "SCHEMES",
    "BucketEvent",
    "NetworkConfig",
    "SimResult",
    "bucket_cost",
    "required_bandwidth",
    "required_compression",
    "required_local_steps",
    "simulate",
]

SCHEMES = ("ring", "onebit", "localsgd")


@dataclass(frozen=True)
class NetworkConfig:
    """One what-if: cluster size, link, and communication scheme."""

    workers: int = 8
    """Data-parallel workers n (>= 1). The paper's clusters: 16, 32, 64 GPUs."""
    bandwidth_gbps: float = 10.0
    """Per-worker link rate B in Gbit/s (> 0). Use the fitted rate of ``analyze bench``."""
    alpha_s: float = 0.0
    """Latency per message in seconds (>= 0); a ring pays ``2 (n-1)`` of them."""
    compression: float = 1.0
    """Ratio c >= 1 dividing the bytes on the wire (``inf``: free network)."""
    codec_s_per_byte: float = 0.0
    """Compress + decompress compute per uncompressed byte (>= 0), e.g. from
    :func:`thinwire.analysis.costs.measure_codec_cost`."""
    overlap: bool = True
    """All-reduce buckets during the backward pass (DDP, Horovod). False: after it
    (1-bit Adam/LAMB, which communicate in the optimizer step)."""
    scheme: str = "ring"
    """``ring``, ``onebit`` or ``localsgd`` (see the module docstring)."""
    local_steps: int = 1
    """H for ``localsgd``: steps between model averages (>= 1)."""
    workers_per_node: int = 1
    """g > 1: hierarchical allreduce on nodes of g workers (must divide ``workers``);
    ``bandwidth_gbps`` is then each node's network link. Fewer messages cross the slow
    network (``2 (n/g - 1)`` instead of ``2 (n - 1)``): it pays off when latency does."""
    intra_node_gbps: float = 800.0
    """Link rate between the workers of one node (NVLink ~ 800-2400, PCIe ~ 100-250)."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or int(self.workers) != self.workers or self.workers < 1:
            raise ConfigError(f"workers must be an integer >= 1, got {self.workers}")
        if not (self.bandwidth_gbps > 0 and math.isfinite(self.bandwidth_gbps)):
            raise ConfigError(
                f"bandwidth must be a finite number of Gbit/s > 0, got {self.bandwidth_gbps}"
            )
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ConfigError(f"latency alpha must be >= 0 s, got {self.alpha_s}")
        if not self.compression >= 1:  # also rejects NaN
            raise ConfigError(f"compression ratio must be >= 1 (1 = none), got {self.compression}")
        if not (self.codec_s_per_byte >= 0 and math.isfinite(self.codec_s_per_byte)):
            raise ConfigError(f"codec cost must be >= 0 s/byte, got {self.codec_s_per_byte}")
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if self.scheme == "onebit" and self.compression != 1:
            raise ConfigError("the onebit scheme fixes its own ratio (32x); leave compression at 1")
        g = self.workers_per_node
        if int(g) != g or g < 1 or self.workers % g:
            raise ConfigError(
                f"workers per node must be an integer >= 1 dividing workers={self.workers}, got {g}"
            )
        if not (self.intra_node_gbps > 0 and math.isfinite(self.intra_node_gbps)):
            raise ConfigError(
                f"intra-node bandwidth must be > 0 Gbit/s, got {self.intra_node_gbps}"
            )
        if int(self.local_steps) != self.local_steps or self.local_steps < 1:
            raise ConfigError(f"local steps H must be an integer >= 1, got {self.local_steps}")

    @property
    def bandwidth_bps(self) -> float:
        return self.bandwidth_gbps * 1e9


@dataclass(frozen=True)
class BucketEvent:
    """One bucket's all-reduce on the channel."""

    nbytes: int
    ready_s: float
    start_s: float
    end_s: float
    network_s: float
    reduce_s: float
    latency_s: float
    codec_s: float
    wire_bytes: float


@dataclass
class SimResult:
    """The predicted step of one configuration (times in seconds)."""

    config: NetworkConfig
    iteration_s: float
    backward_s: float
    exposed_s: float
    comm_s: float
    """Channel busy time per step (amortised over H for Local-SGD)."""
    wire_bytes: float
    """Bytes each worker sends per step (amortised over H for Local-SGD)."""
    events: list[BucketEvent] = field(default_factory=list)
    compute_stall_s: float = 0.0
    """Codec compute that ran during backward and delayed its end (amortised like comm_s)."""

    @property
    def step_s(self) -> float:
        return self.iteration_s + self.exposed_s

    @property
    def scaling_factor(self) -> float:
        return self.iteration_s / self.step_s

    @property
    def link_utilization(self) -> float:
        """Mean fraction of the link rate used over a step."""
        return self.wire_bytes * 8 / (self.config.bandwidth_bps * self.step_s)

    def breakdown(self) -> dict[str, float]:
        """Channel time per step split into network, reduction, latency and codec."""
        h = self.config.local_steps if self.config.scheme == "localsgd" else 1
        keys = ("network_s", "reduce_s", "latency_s", "codec_s")
        return {k: sum(getattr(e, k) for e in self.events) / h for k in keys}

    def to_json(self, events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": asdict(self.config),
            "iteration_s": self.iteration_s,
            "backward_s": self.backward_s,
            "exposed_s": self.exposed_s,
            "step_s": self.step_s,
            "scaling_factor": self.scaling_factor,
            "comm_s": self.comm_s,
            "wire_bytes": self.wire_bytes,
            "link_utilization": self.link_utilization,
            "compute_stall_s": self.compute_stall_s,
            "breakdown": self.breakdown(),
        }
        if events:
            out["events"] = [asdict(e) for e in self.events]
        return out


def bucket_cost(nbytes: float, cfg: NetworkConfig, add: AddCost) -> dict[str, float]:
    """Time components and wire bytes of one bucket's collective (see the module docstring)."""
    n = cfg.workers
    if n == 1 or nbytes <= 0:
        return {"network_s": 0.0, "reduce_s": 0.0, "latency_s": 0.0, "codec_s": 0.0, "wire": 0.0}
    share = (n - 1) / n
    messages = 2 * (n - 1)
    g = cfg.workers_per_node
    if g > 1 and cfg.scheme != "onebit":
        return _hierarchical_cost(nbytes, cfg, add)
    if cfg.scheme == "onebit":
        # The implementation's own count: padded sign bits of both phases + scales/meta.
        wire = float(onebit_wire_bytes(math.ceil(nbytes / 4), n))
        messages = 3  # metadata, all-to-all, final gather: one step each (see above)
    else:
        wire = 0.0 if math.isinf(cfg.compression) else 2 * share * nbytes / cfg.compression
    return {
        "network_s": 8 * wire / cfg.bandwidth_bps,
        "reduce_s": (n - 1) * add(nbytes / n),
        "latency_s": messages * cfg.alpha_s,
        "codec_s": cfg.codec_s_per_byte * nbytes,
        "wire": wire,
    }


def _hierarchical_cost(nbytes: float, cfg: NetworkConfig, add: AddCost) -> dict[str, float]:
    # Reduce-scatter inside each node (g workers), g parallel ring allreduces of one
    # S/g shard each across the m nodes (together they move 2 (m-1)/m * S through each
    # node's link), all-gather inside each node. Intra-node messages are taken as free
    # of latency; compression applies to the inter-node phase only.
    g = cfg.workers_per_node
    m = cfg.workers // g
    inter = 0.0 if math.isinf(cfg.compression) else 2 * (m - 1) / m * nbytes / cfg.compression
    intra_s = 8 * 2 * (g - 1) / g * nbytes / (cfg.intra_node_gbps * 1e9)
    return {
        "network_s": 8 * inter / cfg.bandwidth_bps + intra_s,
        "reduce_s": (g - 1) * add(nbytes / g) + (m - 1) * add(nbytes / (g * m)),
        "latency_s": 2 * (m - 1) * cfg.alpha_s,
        "codec_s": cfg.codec_s_per_byte * nbytes,
        "wire": inter,
    }


def simulate(
    profile: Profile, buckets: list[Bucket], cfg: NetworkConfig, add: AddCost | None = None
) -> SimResult:
    """Play one step of ``profile`` with ``buckets`` on the network ``cfg``.

    ``add`` prices the reductions (default: free). A profile whose gradients never
    became ready has no buckets: nothing is communicated and SF is 1.
    """
    add = add if add is not None else AddCost.zero()
    bk_end = profile.backward_end_s
    deferred = not cfg.overlap or cfg.scheme == "localsgd"
    free_at = 0.0
    stall = 0.0  # codec compute run during backward so far: backward is that much later
    events = []
    for b in buckets:
        c = bucket_cost(b.nbytes, cfg, add)
        busy = c["network_s"] + c["reduce_s"] + c["latency_s"] + c["codec_s"]
        ready = bk_end if deferred else b.ready_s + stall
        start = max(ready, free_at)
        if not deferred and start < bk_end + stall:
            stall += c["codec_s"]  # it shares the processor with the rest of backward
        free_at = start + busy
        events.append(
            BucketEvent(
                nbytes=b.nbytes,
                ready_s=ready,
                start_s=start,
                end_s=free_at,
                network_s=c["network_s"],
                reduce_s=c["reduce_s"],
                latency_s=c["latency_s"],
                codec_s=c["codec_s"],
                wire_bytes=c["wire"],
            )
        )
    exposed = max(0.0, free_at - bk_end, stall) if events else 0.0
    h = cfg.local_steps if cfg.scheme == "localsgd" else 1
    return SimResult(
        config=cfg,
        iteration_s=profile.iteration_s,
        backward_s=bk_end,
        exposed_s=exposed / h,
        comm_s=sum(e.end_s - e.start_s for e in events) / h,
        wire_bytes=sum(e.wire_bytes for e in events) / h,
        events=events,
        compute_stall_s=stall / h,
    )


def _check_target(target: float) -> None:
    if not 0 < target <= 1:
        raise ConfigError(f"target scaling factor must be in (0, 1], got {target}")


def _bisect_log(sf_of: Any, lo: float, hi: float, target: float, iters: int = 60) -> float:
    # Invariant: sf_of(lo) < target <= sf_of(hi); bisect in log space (ratios span decades).
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if sf_of(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-6:
            break
    return hi


def required_compression(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    target: float,
    add: AddCost | None = None,
    max_ratio: float = 1e6,
) -> float | None:
    """Smallest compression ratio c >= 1 with SF >= ``target``; None if even c = inf fails.

    None means the network term is not what is exposed: latency, reductions or codec
    cost alone exceed the budget, and only fewer messages (bigger buckets, Local-SGD)
    or a faster reduction help.
    """
    _check_target(target)
    base = replace(cfg, scheme="ring" if cfg.scheme == "onebit" else cfg.scheme)

    def sf(c: float) -> float:
        return simulate(profile, buckets, replace(base, compression=c), add).scaling_factor

    if sf(1.0) >= target:
        return 1.0
    if sf(math.inf) < target:
        return None
    hi = 2.0
    while sf(hi) < target:
        if hi >= max_ratio:
            return None
        hi = min(hi * 4, max_ratio)
    return _bisect_log(sf, hi / 4 if hi > 2 else 1.0, hi, target)


def required_bandwidth(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    target: float,
    add: AddCost | None = None,
    max_gbps: float = 1e6,
) -> float | None:
    """Smallest link rate in Gbit/s with SF >= ``target``; None if no rate up to ``max_gbps``."""
    _check_target(target)

    def sf(gbps: float) -> float:
        return simulate(profile, buckets, replace(cfg, bandwidth_gbps=gbps), add).scaling_factor

    if sf(max_gbps) < target:
        return None
    lo = 1e-6
    if sf(lo) >= target:
        return lo
    return _bisect_log(sf, lo, max_gbps, target)


def required_local_steps(
    profile: Profile,
    buckets: list[Bucket],
    cfg: NetworkConfig,
    target: float,
    add: AddCost | None = None,
) -> int | None:
    """Smallest H for Local-SGD reaching ``target`` (None only for target 1 with traffic)."""
    _check_target(target)
    once = simulate(profile, buckets, replace(cfg, scheme="localsgd", local_steps=1), add)
    if once.exposed_s == 0:
        return 1
    if target >= 1:
        return None
    budget = profile.iteration_s * (1 / target - 1)  # exposed time per step allowed
    return max(1, math.ceil(once.exposed_s / budget - 1e-12))
