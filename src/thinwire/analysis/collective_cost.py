"""What one bucket's collective costs on a link: wire time, latency, reductions, codec.

The what-if model (:mod:`thinwire.analysis.network_model`) schedules buckets; this
module prices one of them. The link has a rate ``B`` (bit/s) and a latency ``alpha``
(seconds per message: with gloo, a round trip, since a message is only sent once its
receiver has posted the receive).

**The ring** (plain or compressed allreduce of ``S`` bytes over ``n`` workers) moves
``W = 2 (n-1)/n * 8S / (c B)`` seconds of bits through each worker's link (``c``: the
compression ratio). Its latency is not simply added: gloo cuts each worker's chunk in
segments of at most 1 MiB (:data:`RING_SEGMENT_BYTES`, at least two per chunk) and
keeps two of them in flight (:data:`RING_INFLIGHT`): while one segment waits for its
round trip the other is on the wire. A pair of segments of ``s`` bytes then costs
``max(2 * 8s/B, alpha + 8s/B)``, and over the ``R`` pairs the two phases send (``R =
2 (n-1)`` up to a ``2n`` MiB payload, then one per MiB each worker sends)::

    T = max(W, R * alpha + W / 2)

that is: bandwidth-bound (``T = W``, latency hidden) once a segment takes longer on the
wire than its round trip, latency-bound (``R alpha`` plus half the wire) below. With
``alpha = 0`` this is the paper's ``T = W``. On the testbed (4 hosts, 100 Mbit/s,
64 KiB-16 MiB at 0, 10 and 50 ms one way) it fits gloo's allreduce within 10%; the
straight line ``W + 2 (n-1) alpha`` put a whole ring of round trips on top of every
bucket's wire time and predicted DDP's step 48-79% too slow (docs/results/testbed.md, "What
latency changes"). The reductions of the reduce-scatter, ``(n-1) * t_add(S/n)``, and
the codec compute ``codec * S`` come on top.

**The 1-bit allreduce** (:class:`thinwire.comm.onebit_allreduce.OneBitAllreduce`):
about ``2 (n-1)/n * S/32`` bytes per worker (the implementation's own count, with
padding, scales and metadata) and three collectives (metadata, phase 1, phase 2), each
one step over a WAN (the metadata always goes as a fan-out, and the collective picks the
fan-out for phase 2 there).
Once the call is tuned the metadata travels beside phase 1 instead of ahead of it, so
``2 alpha`` plus the wire, the same reductions and the codec (measured: a 64 KiB call
between 4 hosts 50 ms apart took 0.21 s, against 0.31 s with the three in sequence).
Its all_to_alls are not ring messages, though: where ``analyze fit`` measured the call
(``NetworkConfig.onebit_latency``, per message size), :func:`onebit_wait` of it replaces
``2 alpha``.

**Hierarchical** (``workers_per_node = g > 1``): reduce-scatter inside each node over
``intra_node_gbps``, ``g`` rings of ``S/g`` across the ``m = n/g`` nodes, all-gather
inside each node; only the inter-node ring pays latency. The bytes come per tier:
``2 (g-1)/g * S`` per worker inside its node, ``2 (m-1)/m * S / c`` through each node's
link. With the 1-bit scheme the ``g`` shards cross the nodes as ``g`` 1-bit allreduces
(the layout of thinwire's 1-bit optimizers under HSDP, ``--shard-within g``).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

import numpy as np

from thinwire.analysis.costs import AddCost
from thinwire.comm.onebit_allreduce import onebit_wire_bytes

if TYPE_CHECKING:
    from thinwire.analysis.network_model import NetworkConfig

__all__ = [
    "RING_INFLIGHT",
    "RING_SEGMENT_BYTES",
    "bucket_cost",
    "onebit_wait",
    "ring_rounds",
    "ring_time",
]

RING_SEGMENT_BYTES = 1 << 20
"""gloo's largest ring segment (its ``AllreduceOptions::kMaxSegmentSize``)."""
RING_INFLIGHT = 2
"""Segments gloo's ring keeps in flight per direction."""
ONEBIT_COLLECTIVES = 2
"""The 1-bit allreduce's round trips per tuned call, one after the other (its metadata's
overlaps phase 1; three while it tunes, a handful of calls)."""


def ring_rounds(payload_bytes: float, n: int) -> float:
    """Round trips a ring allreduce of ``payload_bytes`` waits for, two segments at a time.

    ``2 (n-1)`` while every chunk is cut in two segments (payload up to ``2n`` MiB),
    then one per MiB each worker sends: ``(n-1)/n * payload / 1 MiB``.
    """
    if n < 2:
        return 0.0
    return max(2.0 * (n - 1), (n - 1) / n * payload_bytes / RING_SEGMENT_BYTES)


def ring_time(wire_s: Any, rounds: Any, alpha_s: Any) -> Any:
    """Seconds of a ring with ``wire_s`` on the wire and ``rounds`` round trips of
    ``alpha_s``: ``max(W, rounds * alpha + W / 2)`` (see the module docstring).

    Floats give a float; numpy arrays broadcast (the link fit prices a grid at once).
    """
    t = np.maximum(wire_s, rounds * alpha_s + wire_s / RING_INFLIGHT)
    return float(t) if np.ndim(t) == 0 else t


def onebit_wait(table: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """The 1-bit call's measured wait for a message of ``nbytes``: the median of those
    measured at sizes within 4x of it (the nearest size's if none is). A median of
    neighbours, not an interpolation: single benchmark points across a WAN jump by a
    round trip now and then (TCP's windows), and one must not decide the prediction."""
    near = [wait for size, wait in table if nbytes / 4 <= size <= 4 * nbytes]
    if not near:
        near = [min(table, key=lambda e: abs(math.log(e[0] / max(nbytes, 1.0))))[1]]
    return float(statistics.median(near))


def bucket_cost(nbytes: float, cfg: NetworkConfig, add: AddCost) -> dict[str, float]:
    """Time components and wire bytes of one bucket's collective.

    ``network_s`` is the wire time, ``latency_s`` what latency adds to it (the part not
    hidden behind the wire), ``reduce_s`` and ``codec_s`` the compute; their sum is the
    collective's time alone on the link. ``wire`` is the bytes each worker sends (with
    nodes: each node's link to the others), ``intra_wire`` what each worker sends inside
    its node (0 on a flat network).
    """
    n = cfg.workers
    if n == 1 or nbytes <= 0:
        return {
            "network_s": 0.0,
            "reduce_s": 0.0,
            "latency_s": 0.0,
            "codec_s": 0.0,
            "wire": 0.0,
            "intra_wire": 0.0,
        }
    if cfg.workers_per_node > 1:
        return _hierarchical_cost(nbytes, cfg, add)
    if cfg.scheme == "onebit":
        # The implementation's own count: padded sign bits of both phases + scales/meta.
        wire = float(onebit_wire_bytes(math.ceil(nbytes / 4), n, cfg.onebit_block))
        network = 8 * wire / cfg.bandwidth_bps
        if cfg.onebit_latency:  # measured on the link (analyze fit)
            latency = onebit_wait(cfg.onebit_latency, nbytes)
        else:  # one-step collectives: phase 1 (the metadata beside it), then phase 2
            latency = ONEBIT_COLLECTIVES * cfg.alpha_s
    else:
        inf = math.isinf(cfg.compression)
        wire = 0.0 if inf else 2 * (n - 1) / n * nbytes / cfg.compression
        network = 8 * wire / cfg.bandwidth_bps
        rounds = ring_rounds(0.0 if inf else nbytes / cfg.compression, n)
        latency = ring_time(network, rounds, cfg.alpha_s) - network
    return {
        "network_s": network,
        "reduce_s": (n - 1) * add(nbytes / n),
        "latency_s": latency,
        "codec_s": cfg.codec_s_per_byte * nbytes,
        "wire": wire,
        "intra_wire": 0.0,
    }


def _hierarchical_cost(nbytes: float, cfg: NetworkConfig, add: AddCost) -> dict[str, float]:
    # Reduce-scatter inside each node (g workers), g parallel allreduces of one S/g shard
    # each across the m nodes (together they move 2 (m-1)/m * S / c through each node's
    # link), all-gather inside each node. Intra-node messages are taken as free of
    # latency; compression applies to the inter-node phase only, so each worker encodes
    # its own shard. With the 1-bit scheme the shards cross in 1-bit: thinwire's 1-bit
    # optimizers under HSDP (``--shard-within g``), each rank compressing its shard across
    # the islands.
    g = cfg.workers_per_node
    m = cfg.workers // g
    intra = 2 * (g - 1) / g * nbytes
    intra_s = 8 * intra / (cfg.intra_node_gbps * 1e9)
    if m == 1:
        inter, inter_s, latency = 0.0, 0.0, 0.0
    elif cfg.scheme == "onebit":
        shard = float(onebit_wire_bytes(math.ceil(nbytes / (4 * g)), m, cfg.onebit_block))
        inter = g * shard
        inter_s = 8 * inter / cfg.bandwidth_bps
        if cfg.onebit_latency:
            latency = onebit_wait(cfg.onebit_latency, nbytes / g)
        else:
            latency = ONEBIT_COLLECTIVES * cfg.alpha_s
    else:
        inf = math.isinf(cfg.compression)
        inter = 0.0 if inf else 2 * (m - 1) / m * nbytes / cfg.compression
        inter_s = 8 * inter / cfg.bandwidth_bps
        rounds = ring_rounds(0.0 if inf else nbytes / (g * cfg.compression), m)
        latency = ring_time(inter_s, rounds, cfg.alpha_s) - inter_s
    return {
        "network_s": inter_s + intra_s,
        "reduce_s": (g - 1) * add(nbytes / g) + (m - 1) * add(nbytes / (g * m)),
        "latency_s": latency,
        "codec_s": cfg.codec_s_per_byte * nbytes / g,
        "wire": inter,
        "intra_wire": intra,
    }
