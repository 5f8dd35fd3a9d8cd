"""Time a plain fp32 allreduce on whatever group the environment describes.

Run once per host (``thinwire testbed run --hosts 4 --rate 100mbit -- python -m
thinwire testbed probe --mib 8``); each rank prints one JSON line starting with
``PROBE`` per size (``--mib 1,8,32`` measures three sizes in one process)::

    PROBE {"rank": 0, "world": 4, "bytes": 8388608, "iters": 3,
           "seconds_per_iter": 1.07, "busbw_bits": 94000000.0,
           "wire_bytes": 50331648, "payload_bytes": 33554432}

``busbw_bits`` is the bus bandwidth, ``2 (W-1)/W * bytes * 8 / seconds_per_iter``:
what each rank's link carried per second under a ring allreduce, directly comparable
with the link rate. ``wire_bytes`` is this rank's total from
:data:`thinwire.comm.accounting.COUNTER` (warm-up included), the figure the NIC
counters are checked against; it is cumulative over the sizes measured so far.

Tuning: use at least a few MiB per call so the per-call latency (a few ms on these
links) does not pull the bus bandwidth down, and a warm-up call so connection set-up
is not timed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from thinwire.comm.accounting import COUNTER
from thinwire.comm.allreduce import all_reduce_mean_
from thinwire.comm.launch import world_size

__all__ = ["measure"]


def measure(mib: float, iters: int, warmup: int) -> dict[str, float | int]:
    w = world_size()
    numel = max(1, int(mib * 2**20) // 4)
    x = torch.ones(numel, dtype=torch.float32)
    for _ in range(warmup):
        all_reduce_mean_(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        all_reduce_mean_(x)
    dt = (time.perf_counter() - t0) / iters
    nbytes = numel * 4
    # The mean of ones is ones: a cheap check that the data really went around.
    if not torch.allclose(x, torch.ones_like(x)):
        raise RuntimeError("allreduce result is wrong")
    return {
        "rank": dist.get_rank(),
        "world": w,
        "bytes": nbytes,
        "iters": iters,
        "seconds_per_iter": dt,
        "busbw_bits": 2 * (w - 1) / w * nbytes * 8 / dt if w > 1 else 0.0,
        "wire_bytes": COUNTER.wire_bytes,
        "payload_bytes": COUNTER.payload_bytes,
    }
