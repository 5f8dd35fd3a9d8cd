"""``thinwire bench packing``: the CPU cost of the 1-bit allreduce, without a network.

Two measurements, both in one process on the CPU:

* :func:`run_packing_bench`: bit packing and unpacking in torch (pure and the compiled
  kernels of :mod:`thinwire.compress.native`) against numpy's ``packbits``/``unpackbits``
  on the same data;
* :func:`run_onebit_compute_bench`: one whole 1-bit allreduce with the network replaced
  by local copies (:meth:`~thinwire.comm.onebit_allreduce.OneBitAllreduce.compute_only`),
  in "passes": multiples of one plain fp32 copy of the buffer.

Timing: every function of a point is called once untimed, then ``repeats`` rounds in
which they take turns (so a burst of load on a shared machine hits them alike); each
reports its median. Tuning: on a busy, oversubscribed machine use ``clock="cpu"``
(process CPU time counts the work done, not the wait for a core); ``repeats`` 5 is
enough for buffers of millions of elements, use more for small ones.

The allreduce timings over a process group are in :mod:`thinwire.comm.bench`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from thinwire.comm.onebit_allreduce import OneBitAllreduce
from thinwire.compress import packing
from thinwire.compress.packing import pack_bits, pack_signs, unpack_bits, unpack_signs

__all__ = ["run_onebit_compute_bench", "run_packing_bench"]

_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _interleaved_medians(
    fns: dict[str, Callable[[], Any]], repeats: int, clock: str = "wall"
) -> dict[str, float]:
    """Median time of each function, calling them in turn so they share the same noise.

    ``clock="cpu"`` measures CPU time of this process (all its threads) instead of wall
    time: on a shared, oversubscribed machine it counts only the work done, not the time
    spent waiting for a core.
    """
    now = _CLOCKS[clock]
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = now()
            fn()
            times[k].append(now() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_packing_bench(
    numels: Sequence[int], repeats: int = 5, clock: str = "wall"
) -> list[dict[str, Any]]:
    """Bit packing and unpacking in torch vs numpy on the same data (single process, CPU).

    Four operations, each with numpy's natural spelling as the peer:

    * ``pack_bits``: bool -> bytes, vs ``np.packbits(bits)``;
    * ``unpack_bits``: bytes -> bool, vs ``np.unpackbits(packed)``;
    * ``pack_signs``: fp32 -> sign bytes, vs ``np.packbits(x >= 0)``;
    * ``unpack_signs``: bytes -> fp32 ``+-s``, vs ``unpackbits(p).astype(f32) * 2s - s``
      (the fastest numpy spelling we found; ``np.where`` and table lookups are slower).

    ``torch_s`` is the pure-torch path and ``native_s`` the compiled kernels
    (:mod:`thinwire.compress.native`; None where they are not built), both writing into
    reused ``out=``/scratch buffers as the compressed allreduce does; numpy allocates
    its outputs (it has no ``out=``). torch runs with its current intra-op thread count
    (``threads`` in the row); numpy is single-threaded. ``clock``: ``"wall"`` or
    ``"cpu"`` (process CPU time, see :func:`_interleaved_medians`).
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    has_native = packing.use_native(True)
    packing.use_native(None)
    for n in numels:
        for op, fns in _packing_cases(n - n % 8, gen, has_native).items():
            med = _interleaved_medians(fns, repeats, clock)
            native = med.get("native")
            rows.append(
                {
                    "op": op,
                    "clock": clock,
                    "numel": n - n % 8,
                    "threads": torch.get_num_threads(),
                    "numpy_s": med["numpy"],
                    "torch_s": med["torch"],
                    "native_s": native,
                    "speedup": med["numpy"] / med["torch"],
                    "speedup_native": None if native is None else med["numpy"] / native,
                }
            )
    return rows


def _packing_cases(
    n: int, gen: torch.Generator, has_native: bool
) -> dict[str, dict[str, Callable[[], Any]]]:
    x = torch.randn(n, generator=gen)
    bits = x >= 0
    packed = pack_bits(bits)
    xn, bn, pn = x.numpy(), bits.numpy(), packed.numpy()
    scale = np.float32(0.5)
    out_b = torch.empty(n // 8, dtype=torch.uint8)
    scratch = torch.empty(n, dtype=torch.uint8)
    out_bits = torch.empty(n, dtype=torch.bool)
    out_f = torch.empty(n)
    ts = torch.tensor(0.5)
    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "pack_bits": (
            lambda: np.packbits(bn),
            lambda: pack_bits(bits, out=out_b, scratch=scratch),
        ),
        "unpack_bits": (lambda: np.unpackbits(pn), lambda: unpack_bits(packed, out=out_bits)),
        "pack_signs": (
            lambda: np.packbits(xn >= 0),
            lambda: pack_signs(x, out=out_b, scratch=scratch),
        ),
        "unpack_signs": (
            lambda: np.unpackbits(pn).astype(np.float32) * (2 * scale) - scale,
            lambda: unpack_signs(packed, ts, out=out_f),
        ),
    }
    cases: dict[str, dict[str, Callable[[], Any]]] = {}
    for name, (with_numpy, with_torch) in ops.items():
        cases[name] = {"numpy": with_numpy, "torch": _with_native(with_torch, False)}
        if has_native:
            cases[name]["native"] = _with_native(with_torch, True)
    return cases


def _with_native(fn: Callable[[], Any], enabled: bool) -> Callable[[], Any]:
    def run() -> Any:
        packing.use_native(enabled)  # loaded once: then a dict update
        try:
            return fn()
        finally:
            packing.use_native(None)  # back to the process's default

    return run


def run_onebit_compute_bench(
    numel: int, world_size: int, repeats: int = 5, clock: str = "wall"
) -> dict[str, Any]:
    """Time one whole 1-bit allreduce of ``numel`` fp32 without the network, in passes.

    Runs :meth:`OneBitAllreduce.compute_only` (rank 0's complete share of the work for
    ``world_size`` ranks) with pure-torch packing (``compute_s``) and with the compiled
    kernels (``native_s``, None where they are not built), and, interleaved, one ``copy_`` of the
    buffer (a "pass": read and write ``4 * numel`` bytes). ``passes = compute_s /
    copy_s`` says how many plain passes over memory the compression costs.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    out = torch.empty_like(x)
    dst = torch.empty_like(x)
    # One piece: the tuner would otherwise change the count during the timed calls.
    pure = OneBitAllreduce.compute_only(world_size, pieces=1)
    fns: dict[str, Callable[[], Any]] = {
        "onebit": _with_native(lambda: pure(x, out=out), False),
        "copy": lambda: dst.copy_(x),
    }
    if packing.use_native(True):
        fast = OneBitAllreduce.compute_only(world_size, pieces=1)
        fns["native"] = _with_native(lambda: fast(x, out=out), True)
    packing.use_native(None)
    med = _interleaved_medians(fns, repeats, clock)
    native = med.get("native")
    return {
        "numel": numel,
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "clock": clock,
        "compute_s": med["onebit"],
        "native_s": native,
        "copy_s": med["copy"],
        "passes": med["onebit"] / med["copy"],
        "native_passes": None if native is None else native / med["copy"],
    }
