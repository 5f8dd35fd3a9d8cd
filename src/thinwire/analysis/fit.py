"""Fit a link model (latency alpha, effective bandwidth B) to measured allreduce times.

``thinwire bench allreduce`` (:func:`thinwire.comm.bench.run_allreduce_bench`) measures
the median time of an fp32 allreduce per message size on the current process group.
:func:`fit_link` fits the ring model the simulator uses
(:func:`thinwire.analysis.collective_cost.ring_time`)::

    W(S) = 8 * 2 (n-1)/n * S / B
    T(S) = max(W, R(S) * alpha + W / 2)      R = 2 (n-1) round trips up to 2n MiB

by least squares on the *relative* error (small messages, which determine alpha, weigh
as much as large ones, which determine B). ``B`` is an effective rate: it folds in the
reductions and any protocol overhead, so simulate with ``--reduction none`` when using
it. ``alpha`` is the latency of one message (a round trip with gloo);
:attr:`LinkFit.alpha_s` is what a small allreduce pays for all ``2 (n-1)`` of them.
On a LAN alpha fits near 0 and ``T = W``: the old straight line.

Tuning: measure sizes from a few KiB (latency-bound) to well above the bucket size
(bandwidth-bound); powers of two from 4 KiB to 16-64 MiB fit most links. Across a WAN
include sizes on both sides of the bend (where a segment's wire time reaches the round
trip: ``2n * alpha * B / 8`` bytes). Fewer than two distinct sizes cannot separate
alpha from B and is rejected.

:func:`bench_link` runs the benchmark (spawning local ranks, or on an existing group)
and returns its rows and the fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from thinwire.analysis.collective_cost import ring_rounds, ring_time
from thinwire.errors import ConfigError

__all__ = ["LinkFit", "bench_link", "fit_link", "onebit_waits"]


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: what ``analyze what-if --link`` reads."""

    alpha_s: float
    """Latency of a small allreduce: its ``2 (n-1)`` messages' round trips together."""
    bandwidth_gbps: float
    """Effective per-worker link rate in Gbit/s (bus bandwidth of large messages)."""
    world_size: int
    points: int
    max_rel_error: float
    """Largest |measured - fitted| / measured over the points: how well the model fits."""
    onebit_latency: tuple[tuple[float, float], ...] = ()
    """(message bytes, seconds) per benchmarked size: what one call of thinwire's 1-bit
    allreduce waited on the network beyond its wire time and its compute (empty: not
    measured; the model then charges 2 alpha)."""

    @property
    def alpha_per_message_s(self) -> float:
        """Latency per ring message: ``alpha_s / (2 (n-1))`` (0 for one worker)."""
        return self.alpha_s / (2 * (self.world_size - 1)) if self.world_size > 1 else 0.0

    def predict(self, nbytes: float) -> float:
        """Fitted seconds for an allreduce of ``nbytes``."""
        n = self.world_size
        wire = 8 * 2 * (n - 1) / n * nbytes / (self.bandwidth_gbps * 1e9)
        return float(ring_time(wire, ring_rounds(nbytes, n), self.alpha_per_message_s))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "alpha_per_message_s": self.alpha_per_message_s}


def fit_link(rows: Sequence[dict[str, Any]], method: str = "fp32") -> LinkFit:
    """Fit alpha and B to benchmark rows (keys ``method``, ``size_bytes``, ``time_s``,
    ``world_size``); rows of other methods are ignored.

    Raises:
        ConfigError: no rows of ``method``, mixed world sizes, one world rank, fewer
            than two distinct sizes, or non-positive times.
    """
    use = [r for r in rows if r.get("method", method) == method]
    if not use:
        raise ConfigError(f"no {method!r} allreduce measurements to fit")
    worlds = {int(r["world_size"]) for r in use}
    if len(worlds) != 1:
        raise ConfigError(f"measurements mix world sizes {sorted(worlds)}; fit one at a time")
    n = worlds.pop()
    if n < 2:
        raise ConfigError("a link fit needs >= 2 workers; one worker sends nothing")
    sizes = np.array([float(r["size_bytes"]) for r in use])
    times = np.array([float(r["time_s"]) for r in use])
    if len(set(sizes.tolist())) < 2:
        raise ConfigError("a link fit needs at least two different message sizes")
    if not np.all(times > 0) or not np.all(np.isfinite(times)):
        raise ConfigError("allreduce times must be finite and > 0 s")
    wire_bits = 8 * 2 * (n - 1) / n * sizes
    # A straight line first (weights 1/T): times that do not grow with size leave
    # nothing to fit a bandwidth to.
    line = np.stack([np.ones_like(times), wire_bits], axis=1) / times[:, None]
    (_, slope), *_ = np.linalg.lstsq(line, np.ones_like(times), rcond=None)
    if slope <= 0:
        raise ConfigError(
            "allreduce time does not grow with size in these measurements; measure larger messages"
        )
    rounds = np.array([ring_rounds(s, n) for s in sizes])
    inv_b, alpha = _fit_ring(wire_bits, rounds, times)
    fitted = ring_time(wire_bits * inv_b, rounds, alpha)
    return LinkFit(
        alpha_s=float(alpha * 2 * (n - 1)),
        bandwidth_gbps=float(1 / inv_b / 1e9),
        world_size=n,
        points=len(use),
        max_rel_error=float(np.max(np.abs(times - fitted) / times)),
        onebit_latency=onebit_waits(rows, n, inv_b),
    )


def onebit_waits(
    rows: Sequence[dict[str, Any]], n: int, inv_b: float
) -> tuple[tuple[float, float], ...]:
    """Per size, what a 1-bit call took beyond its compute and its wire time at the
    fitted rate (>= 0), from ``onebit`` rows with ``compute_s``; () without them.

    Its collectives are all_to_alls, not rings: gloo's rendezvous per message and TCP's
    windows make each cost more than a ring message's alpha on some networks, and more
    for larger messages (on the testbed at 25 ms, 4 hosts, with the three collectives in
    sequence: 3.1 round trips at 64 KiB, 3.5 at 1-2 MiB), so it is measured per size,
    not derived.
    """
    waits = sorted(
        (
            float(r["size_bytes"]),
            max(
                0.0,
                float(r["time_s"]) - float(r["compute_s"]) - 8 * float(r["wire_bytes"]) * inv_b,
            ),
        )
        for r in rows
        if r.get("method") == "onebit"
        and int(r.get("world_size", n)) == n
        and r.get("compute_s") is not None
        and math.isfinite(float(r["time_s"]))
    )
    return tuple(waits)


def _fit_ring(wire_bits: np.ndarray, rounds: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """(1/B, alpha) minimising the squared relative error of the ring model
    (:func:`~thinwire.analysis.collective_cost.ring_time`).

    The model bends at max(...), so no linear solve: a log grid over both parameters,
    narrowed around the best point a few times (deterministic, ~50k evaluations).
    """
    # Bounds: 1/B between the slowest and the fastest rate any point allows (wire alone
    # would explain the point at most twice over), alpha from 0 to the smallest point's
    # time per round trip.
    per_bit = times / wire_bits
    b_lo, b_hi = float(per_bit.min()) / 4, float(per_bit.max()) * 2
    a_hi = float(np.min(times / rounds))
    if a_hi <= 0:
        raise ConfigError("allreduce times must be finite and > 0 s")
    best = (math.inf, b_hi, 0.0)
    a_lo = a_hi * 1e-6
    for _ in range(6):
        inv_bs = np.geomspace(b_lo, b_hi, 61)
        alphas = np.concatenate([[0.0], np.geomspace(a_lo, a_hi, 60)])
        model = ring_time(
            wire_bits[None, None, :] * inv_bs[:, None, None],
            rounds[None, None, :],
            alphas[None, :, None],
        )
        loss = np.sum(((model - times) / times) ** 2, axis=2)
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        if loss[i, j] < best[0]:
            best = (float(loss[i, j]), float(inv_bs[i]), float(alphas[j]))
        _, ib, al = best
        span_b = (b_hi / b_lo) ** 0.1
        b_lo, b_hi = ib / span_b, ib * span_b
        if al > 0:
            span_a = max((a_hi / a_lo) ** 0.1, 1.001)
            a_lo, a_hi = al / span_a, al * span_a
        else:
            a_hi = a_lo * 10
            a_lo = a_hi * 1e-6
    return best[1], best[2]


def _bench_rank(
    rank: int, world: int, methods: list[str], sizes: list[int], warmup: int, iters: int
) -> list[dict[str, Any]]:
    from thinwire.comm.bench import run_allreduce_bench

    return run_allreduce_bench(methods, sizes, warmup, iters)


def bench_link(
    sizes: Sequence[int],
    workers: int = 2,
    warmup: int = 3,
    iters: int = 10,
    timeout_s: float = 300.0,
    onebit: bool = True,
) -> tuple[list[dict[str, Any]], LinkFit]:
    """Measure allreduce times with ``thinwire bench allreduce`` and fit the link.

    fp32 fits alpha and B; with ``onebit`` the 1-bit collective is timed in the same
    rounds and :attr:`LinkFit.onebit_latency_s` is its call's measured wait (across a
    WAN it is what decides 1-bit's step; its tuning calls make the benchmark about
    twice as long). Inside a process group (launched by torchrun) every rank must call
    this and the group's ranks are measured; otherwise ``workers`` local gloo ranks are
    spawned on loopback (which measures this machine, not a network: use it to check
    the tool, or run it under ``thinwire testbed run`` for an emulated link).
    """
    if not sizes or any(int(s) < 4 for s in sizes):
        raise ConfigError("message sizes must be >= 4 bytes")
    if warmup < 0 or iters < 1:
        raise ConfigError(f"need warmup >= 0 and iters >= 1, got {warmup}, {iters}")
    try:
        import thinwire.comm.bench  # noqa: F401
    except ImportError:
        raise ConfigError(
            "thinwire.comm.bench (thinwire bench allreduce) is not available in this install"
        ) from None
    import torch.distributed as dist

    from thinwire.comm.launch import init_from_env, spawn

    size_list = sorted({int(s) for s in sizes})
    args = (["fp32", "onebit"] if onebit else ["fp32"], size_list, warmup, iters)
    if init_from_env() and dist.get_world_size() > 1:
        rows = _bench_rank(dist.get_rank(), dist.get_world_size(), *args)
    else:
        if workers < 2:
            raise ConfigError(f"a link benchmark needs >= 2 workers, got {workers}")
        rows = spawn(_bench_rank, workers, args, timeout_s=timeout_s)[0]
    if not rows or not math.isfinite(float(rows[0].get("time_s", math.nan))):
        raise ConfigError("the allreduce benchmark returned no measurements")
    return rows, fit_link(rows)
