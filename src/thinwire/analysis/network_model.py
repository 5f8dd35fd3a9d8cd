"""A deterministic event model of data-parallel communication: what if the network were...

The model of Zhang et al., "Is Network the Bottleneck of Distributed Training?"
(arXiv 2006.10103), extended with latency, concurrent collectives, codec cost, 1-bit
allreduce and Local-SGD. Nothing sleeps: every time is computed.

Buckets (see :mod:`thinwire.analysis.buckets`) are all-reduced in order on
``concurrency`` channels: bucket ``k`` starts at ``ready_k`` or when a channel frees,
whichever is later. One channel is the paper's FIFO (and NCCL's one stream); gloo runs
two collectives of a process group at once (its two worker threads), and with a
latency the second one's transfers fill the first one's round trips. Collectives in
flight together share the link: alone, one uses the fraction ``wire / time`` of it
(the rest of its time it waits for round trips, reductions or the codec); when the
fractions of those running add up to more than 1, each is slowed in proportion. With
``overlap=False`` (or for Local-SGD) every bucket waits for the end of the backward
pass. The codec (the compression compute, ``codec * S``) runs on the processor that
runs backward: a bucket whose collective starts while backward is still running delays
backward's end, and the ready time of every later bucket, by its codec time (the 1-bit
comm hook on a CPU host: its thread packs bits on the cores backward uses). Overlap
hides the wire, not the codec.

What one collective costs alone (ring, 1-bit, hierarchical; how latency overlaps the
wire inside gloo's ring) is :func:`thinwire.analysis.collective_cost.bucket_cost`; in
short, for a ring of ``S`` bytes on links of ``B`` bit/s with latency ``alpha``::

    W = 2 * 8S (n-1) / (n B c)                 network: reduce-scatter + all-gather
    T = max(W, R * alpha + W / 2)              R = 2 (n-1) round trips up to 2n MiB
      + (n-1) * t_add(S/n)                     the reductions of the reduce-scatter
      + codec * S                              compress + decompress compute, if measured

``c`` divides only the network term. ``alpha = 0``, ``codec = 0``, one channel and the
paper's vector-add table reproduce the paper. The 1-bit allreduce sends about
``2 (n-1)/n * S/32`` bytes in three one-step collectives, two of them at once
(``2 alpha``, or the wait ``analyze fit`` measured); overlapped it is the 1-bit comm hook
(:mod:`thinwire.comm.onebit_hook`: one thread, so one channel whatever ``concurrency``), with
``overlap=False`` 1-bit Adam/LAMB's one exchange after backward. ``localsgd``: workers
step alone and all-reduce the model every ``local_steps`` = H steps, after the step
(nothing to overlap with), so the exposed time is amortised over H. With ``fragments``
P > 1 or a ``fragment_overlap`` tau (Streaming DiLoCo) a sync carries 1/P of the model,
P syncs per H steps, and each hides up to tau steps of compute behind its wire time.

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
from thinwire.analysis.collective_cost import bucket_cost
from thinwire.analysis.costs import AddCost
from thinwire.analysis.profile import Profile
from thinwire.compress.onebit import DEFAULT_BLOCK
from thinwire.errors import ConfigError

__all__ = [
    "BACKEND_CONCURRENCY",
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

BACKEND_CONCURRENCY = {"gloo": 2, "nccl": 1}
"""Collectives a process group runs at once: ``ProcessGroupGloo`` works on two threads,
NCCL on one stream (:attr:`NetworkConfig.concurrency`)."""


@dataclass(frozen=True)
class NetworkConfig:
    """One what-if: cluster size, link, and communication scheme."""

    workers: int = 8
    """Data-parallel workers n (>= 1). The paper's clusters: 16, 32, 64 GPUs."""
    bandwidth_gbps: float = 10.0
    """Per-worker link rate B in Gbit/s (> 0). Use the fitted rate of ``analyze fit``."""
    alpha_s: float = 0.0
    """Latency per message in seconds (>= 0): with gloo a round trip between hosts. A
    small ring waits for ``2 (n-1)`` of them, overlapped with its wire time."""
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
    fragments: int = 1
    """Streaming DiLoCo (``localsgd`` only): P fragments of the model, each synced once
    per H steps in turn. The bytes per step stay DiLoCo's; each sync carries 1/P of
    them, so the link's peak drops P-fold (:class:`thinwire.localsgd.StreamingDiLoCo`)."""
    fragment_overlap: int = 0
    """Streaming DiLoCo: steps of compute a fragment's exchange runs behind (tau); the
    wire time they cover is hidden, the codec's compute is not."""
    workers_per_node: int = 1
    """g > 1: hierarchical allreduce on nodes of g workers (must divide ``workers``);
    ``bandwidth_gbps`` is then each node's network link. Fewer messages cross the slow
    network (``2 (n/g - 1)`` instead of ``2 (n - 1)``): it pays off when latency does."""
    intra_node_gbps: float = 800.0
    """Link rate between the workers of one node (NVLink ~ 800-2400, PCIe ~ 100-250)."""
    onebit_latency: tuple[tuple[float, float], ...] = ()
    """(message bytes, seconds >= 0): what a 1-bit allreduce call waited on the network
    beyond its wire time, per size (``analyze fit`` measures it:
    ``LinkFit.onebit_latency``). Empty: two messages' latency, ``2 * alpha`` (its
    one-step collectives, the metadata's beside phase 1)."""
    onebit_block: int | None = DEFAULT_BLOCK
    """Elements per 1-bit scale of the ``onebit`` scheme: 256 for 1-bit Adam/LAMB, 64 for
    the comm hook (:data:`thinwire.comm.onebit_hook.HOOK_BLOCK`), None for the papers' one
    scale per buffer; it sets the bytes (28x, 21x, 32x fewer than fp32)."""
    concurrency: int = 1
    """Collectives in flight at once (>= 1): 1 for NCCL (one stream) and for the paper;
    2 for gloo (``ProcessGroupGloo`` runs each group's work on two threads). Tuning: it
    matters only with latency and several buckets; DDP over gloo across a WAN then
    hides one bucket's round trips behind another's transfer."""

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
            raise ConfigError(
                "the onebit scheme fixes its own ratio (about 28x); leave compression at 1"
            )
        g = self.workers_per_node
        if int(g) != g or g < 1 or self.workers % g:
            raise ConfigError(
                f"workers per node must be an integer >= 1 dividing workers={self.workers}, got {g}"
            )
        if not (self.intra_node_gbps > 0 and math.isfinite(self.intra_node_gbps)):
            raise ConfigError(
                f"intra-node bandwidth must be > 0 Gbit/s, got {self.intra_node_gbps}"
            )
        for size, wait in self.onebit_latency:
            if not (size > 0 and wait >= 0 and math.isfinite(size) and math.isfinite(wait)):
                raise ConfigError(
                    f"1-bit call latency needs (bytes > 0, seconds >= 0) pairs, got ({size}, {wait})"
                )
        c = self.concurrency
        if isinstance(c, bool) or int(c) != c or c < 1:
            raise ConfigError(f"concurrency must be an integer >= 1, got {c}")
        if int(self.local_steps) != self.local_steps or self.local_steps < 1:
            raise ConfigError(f"local steps H must be an integer >= 1, got {self.local_steps}")
        self._check_fragments()

    def _check_fragments(self) -> None:
        p, tau = self.fragments, self.fragment_overlap
        if isinstance(p, bool) or int(p) != p or not 1 <= p <= self.local_steps:
            raise ConfigError(f"fragments must be an integer in [1, H={self.local_steps}], got {p}")
        if isinstance(tau, bool) or int(tau) != tau or tau < 0:
            raise ConfigError(f"fragment overlap must be an integer >= 0, got {tau}")
        if tau and tau >= max(1, self.local_steps // p):
            # Streaming DiLoCo's own rule: a fragment lands before the next one leaves.
            raise ConfigError(
                f"fragment overlap must be below H // fragments = {self.local_steps // p}, "
                f"got {tau}"
            )
        if (p > 1 or tau > 0) and self.scheme != "localsgd":
            raise ConfigError("fragments and fragment overlap are Local-SGD's (scheme localsgd)")

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
    intra_wire_bytes: float = 0.0


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
    """Bytes each worker sends per step (amortised over H for Local-SGD); with nodes
    (``workers_per_node > 1``) what each node's link carries to the other nodes."""
    events: list[BucketEvent] = field(default_factory=list)
    compute_stall_s: float = 0.0
    sync_wire_bytes: float = 0.0
    """Bytes each worker sends in one synchronization, the most the link carries at
    once: a step's for DDP and 1-bit, a round's for DiLoCo, a fragment's for Streaming
    DiLoCo."""
    """Codec compute that ran during backward and delayed its end (amortised like comm_s)."""
    intra_wire_bytes: float = 0.0
    """With nodes: bytes each worker sends per step inside its node (the fast tier),
    amortised like ``wire_bytes``; 0 on a flat network."""

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
            "sync_wire_bytes": self.sync_wire_bytes,
            "intra_wire_bytes": self.intra_wire_bytes,
            "breakdown": self.breakdown(),
        }
        if events:
            out["events"] = [asdict(e) for e in self.events]
        return out


def simulate(
    profile: Profile, buckets: list[Bucket], cfg: NetworkConfig, add: AddCost | None = None
) -> SimResult:
    """Play one step of ``profile`` with ``buckets`` on the network ``cfg``.

    ``add`` prices the reductions (default: free). A profile whose gradients never
    became ready has no buckets: nothing is communicated and SF is 1.
    """
    add = add if add is not None else AddCost.zero()
    if cfg.fragments > 1 or cfg.fragment_overlap > 0:
        return _streaming(profile, buckets, cfg, add)
    bk_end = profile.backward_end_s
    deferred = not cfg.overlap or cfg.scheme == "localsgd"
    stall = 0.0  # codec compute run during backward so far: backward is that much later
    events: list[BucketEvent] = []
    pending = list(buckets)
    # The 1-bit comm hook reduces its buckets one after another on a thread of its own.
    channels = 1 if cfg.scheme == "onebit" else cfg.concurrency
    # In flight: [event index, fraction of the collective left, seconds alone, link share alone]
    active: list[list[Any]] = []
    ends: dict[int, float] = {}
    t = 0.0
    while pending or active:
        # Start buckets in order while a channel is free and the next one is ready.
        while pending and len(active) < channels:
            ready = bk_end if deferred else pending[0].ready_s + stall
            if ready > t:
                break
            b = pending.pop(0)
            c = bucket_cost(b.nbytes, cfg, add)
            busy = c["network_s"] + c["reduce_s"] + c["latency_s"] + c["codec_s"]
            if not deferred and t < bk_end + stall:
                stall += c["codec_s"]  # it shares the processor with the rest of backward
            events.append(_event(b.nbytes, ready, t, c))
            if busy > 0:
                active.append([len(events) - 1, 1.0, busy, c["network_s"] / busy])
        next_ready = math.inf
        if pending and len(active) < channels:
            next_ready = max(t, bk_end if deferred else pending[0].ready_s + stall)
        if not active:
            t = next_ready
            continue
        # Collectives in flight share the link in proportion once they ask for more of it.
        slow = max(1.0, sum(job[3] for job in active))
        rates = [1.0 / (job[2] * slow) for job in active]
        step = min(min(job[1] / r for job, r in zip(active, rates, strict=True)), next_ready - t)
        t += step
        for job, r in zip(active, rates, strict=True):
            job[1] -= r * step
            if job[1] <= 1e-12 * max(1.0, job[2]):
                ends[job[0]] = t
        active = [job for job in active if job[0] not in ends]
    events = [replace(e, end_s=ends.get(i, e.start_s)) for i, e in enumerate(events)]
    last_end = max((e.end_s for e in events), default=0.0)
    exposed = max(0.0, last_end - bk_end, stall) if events else 0.0
    h = cfg.local_steps if cfg.scheme == "localsgd" else 1
    wire = sum(e.wire_bytes for e in events)
    return SimResult(
        config=cfg,
        iteration_s=profile.iteration_s,
        backward_s=bk_end,
        exposed_s=exposed / h,
        comm_s=sum(e.end_s - e.start_s for e in events) / h,
        wire_bytes=wire / h,
        events=events,
        compute_stall_s=stall / h,
        sync_wire_bytes=wire,
        intra_wire_bytes=sum(e.intra_wire_bytes for e in events) / h,
    )


def _event(
    nbytes: int, ready_s: float, start_s: float, c: dict[str, float], end_s: float | None = None
) -> BucketEvent:
    """One collective priced by :func:`bucket_cost` (``c``); it ends at ``start_s`` until
    the link model says when."""
    return BucketEvent(
        nbytes=nbytes,
        ready_s=ready_s,
        start_s=start_s,
        end_s=start_s if end_s is None else end_s,
        network_s=c["network_s"],
        reduce_s=c["reduce_s"],
        latency_s=c["latency_s"],
        codec_s=c["codec_s"],
        wire_bytes=c["wire"],
        intra_wire_bytes=c["intra_wire"],
    )


def _streaming(
    profile: Profile, buckets: list[Bucket], cfg: NetworkConfig, add: AddCost
) -> SimResult:
    """Streaming DiLoCo: each of the P fragments (1/P of the model's bytes) syncs once
    per H steps, after a step, its exchange running behind ``fragment_overlap`` steps of
    compute. What the overlap does not cover, and the codec's compute, the step that
    applies the fragment waits for; fragments sync one at a time (their turns are H/P
    steps apart, more than the overlap)."""
    p, h = cfg.fragments, cfg.local_steps
    bk_end = profile.backward_end_s
    c = bucket_cost(sum(b.nbytes for b in buckets) / p, cfg, add)
    wire_s = c["network_s"] + c["reduce_s"] + c["latency_s"]
    exposed = c["codec_s"] + max(0.0, wire_s - cfg.fragment_overlap * profile.iteration_s)
    nbytes = int(sum(b.nbytes for b in buckets) / p)
    events = [_event(nbytes, bk_end, bk_end, c, end_s=bk_end + wire_s + c["codec_s"])] * p
    return SimResult(
        config=cfg,
        iteration_s=profile.iteration_s,
        backward_s=bk_end,
        exposed_s=p * exposed / h,
        comm_s=p * (wire_s + c["codec_s"]) / h,
        wire_bytes=p * c["wire"] / h,
        events=events,
        sync_wire_bytes=c["wire"],
        intra_wire_bytes=p * c["intra_wire"] / h,
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
