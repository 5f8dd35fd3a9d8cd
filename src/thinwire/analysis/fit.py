"""Fit a link model (latency alpha, effective bandwidth B) to measured allreduce times.

``thinwire bench allreduce`` (:func:`thinwire.comm.bench.run_allreduce_bench`) measures
the median time of an fp32 allreduce per message size on the current process group.
:func:`fit_link` fits the ring model the simulator uses::

    T(S) = alpha_call + 8 * 2 (n-1)/n * S / B

by least squares on the *relative* error (small messages, which determine alpha, weigh
as much as large ones, which determine B). ``B`` is an effective rate: it folds in the
reductions and any protocol overhead, so simulate with ``--reduction none`` when using
it. ``alpha_call`` is the fixed cost of one collective; the simulator charges latency
per message, ``2 (n-1)`` messages per ring, so :attr:`LinkFit.alpha_per_message_s`
converts.

Tuning: measure sizes from a few KiB (latency-bound) to well above the bucket size
(bandwidth-bound); powers of two from 4 KiB to 16-64 MiB fit most links. Fewer than
two distinct sizes cannot separate alpha from B and is rejected.

:func:`bench_link` runs the benchmark (spawning local ranks, or on an existing group)
and returns its rows and the fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from thinwire.errors import ConfigError

__all__ = ["LinkFit", "bench_link", "fit_link"]


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: what ``analyze simulate --link`` reads."""

    alpha_s: float
    """Fixed seconds per allreduce call (all of its ring steps together)."""
    bandwidth_gbps: float
    """Effective per-worker link rate in Gbit/s (bus bandwidth of large messages)."""
    world_size: int
    points: int
    max_rel_error: float
    """Largest |measured - fitted| / measured over the points: how well the model fits."""

    @property
    def alpha_per_message_s(self) -> float:
        """Latency per ring message: ``alpha_s / (2 (n-1))`` (0 for one worker)."""
        return self.alpha_s / (2 * (self.world_size - 1)) if self.world_size > 1 else 0.0

    def predict(self, nbytes: float) -> float:
        """Fitted seconds for an allreduce of ``nbytes``."""
        n = self.world_size
        return self.alpha_s + 8 * 2 * (n - 1) / n * nbytes / (self.bandwidth_gbps * 1e9)

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
    # Weighted least squares on T = alpha + wire_bits * inv_b, weights 1/T.
    a = np.stack([np.ones_like(times), wire_bits], axis=1) / times[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(a, np.ones_like(times), rcond=None)
    if inv_b <= 0:
        raise ConfigError(
            "allreduce time does not grow with size in these measurements; measure larger messages"
        )
    if alpha < 0:
        # Latency cannot be negative: refit the slope alone through the origin.
        alpha = 0.0
        inv_b = float(np.sum(wire_bits / times) / np.sum((wire_bits / times) ** 2))
    fitted = alpha + wire_bits * inv_b
    return LinkFit(
        alpha_s=float(alpha),
        bandwidth_gbps=float(1 / inv_b / 1e9),
        world_size=n,
        points=len(use),
        max_rel_error=float(np.max(np.abs(times - fitted) / times)),
    )


def _bench_rank(
    rank: int, world: int, sizes: list[int], warmup: int, iters: int
) -> list[dict[str, Any]]:
    from thinwire.comm.bench import run_allreduce_bench

    return run_allreduce_bench(["fp32"], sizes, warmup, iters)


def bench_link(
    sizes: Sequence[int],
    workers: int = 2,
    warmup: int = 3,
    iters: int = 10,
    timeout_s: float = 300.0,
) -> tuple[list[dict[str, Any]], LinkFit]:
    """Measure fp32 allreduce times with ``thinwire bench allreduce`` and fit the link.

    Inside a process group (launched by torchrun) every rank must call this and the
    group's ranks are measured; otherwise ``workers`` local gloo ranks are spawned on
    loopback (which measures this machine, not a network: use it to check the tool, or
    run it under ``thinwire testbed run`` for an emulated link).
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
    if init_from_env() and dist.get_world_size() > 1:
        rows = _bench_rank(dist.get_rank(), dist.get_world_size(), size_list, warmup, iters)
    else:
        if workers < 2:
            raise ConfigError(f"a link benchmark needs >= 2 workers, got {workers}")
        rows = spawn(_bench_rank, workers, (size_list, warmup, iters), timeout_s=timeout_s)[0]
    if not rows or not math.isfinite(float(rows[0].get("time_s", math.nan))):
        raise ConfigError("the allreduce benchmark returned no measurements")
    return rows, fit_link(rows)
