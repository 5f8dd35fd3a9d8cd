"""Allreduce benchmark over message sizes, in the style of nccl-tests.

:func:`run_allreduce_bench` is called on every rank of an initialised process group
and times, for each message size (bytes of fp32 data) and method, one averaging of a
buffer of that size across the group:

* ``fp32``: plain ``all_reduce`` (the baseline);
* ``fp16`` / ``bf16``: cast, ``all_reduce`` in 16 bits, cast back (casts included);
* ``powersgd-r1`` / ``powersgd-r4``: PyTorch's own ``powerSGD_hook`` (rank 1 and 4,
  error feedback and warm start on, as its docs recommend), called directly on a
  stand-in gradient bucket whose single gradient is the buffer viewed as a near-square
  matrix (rows: the largest power of two dividing ``n`` that is at most ``sqrt(n)``),
  the shape PowerSGD sees for a large layer. Its compression always runs
  (``min_compression_rate=1``; PowerSGD falls back to plain allreduce only where the
  factors would not be smaller than the matrix);
* ``onebit``: :class:`thinwire.comm.onebit_allreduce.OneBitAllreduce` at its defaults
  (``phase2="auto"``); ``onebit-ring`` and ``onebit-fanout`` with phase 2 fixed to
  gloo's ring all_gather or to a fan-out to every peer at once; ``onebit-serial`` at
  the defaults but every call waiting for the metadata before its bits
  (``overlap_meta=False``: three round trips in sequence instead of two).

Timing: ``warmup`` untimed calls per method, then ``iters`` rounds in which the methods
take turns, each call timed from a barrier to its end (CUDA synchronised); taking turns
means a burst of load on a shared machine hits every method alike. Every rank measures
every call; the time of a call is the slowest rank's, and ``time_s`` is the median. Like nccl-tests,
``algbw = size / time`` and ``busbw = algbw * 2 (W-1)/W`` (the bandwidth a ring
allreduce of the uncompressed data would need to match that time), both in GB/s
(1e9 bytes/s). ``wire_bytes`` is the analytical number of bytes one rank sends.

For ``onebit`` the row also has ``compute_s``: the median time of the same call with
the network replaced by local copies (:meth:`OneBitAllreduce.compute_only`), timed in
the same rounds, on all ranks at once so they compete for cores as in the real call. ``time_s -
compute_s`` approximates the wire time. The 1-bit allreduce first runs the untimed calls
that tune its piece count (see :mod:`thinwire.comm.piece_tuner`; at most 17); the row
reports the count chosen as ``pieces``, and the compute-only call uses the same count.

The single-process packing and 1-bit compute benchmarks (``thinwire bench packing``)
are in :mod:`thinwire.comm.bench_packing`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.allreduce import all_reduce_mean_
from thinwire.comm.bench_packing import run_onebit_compute_bench, run_packing_bench
from thinwire.comm.onebit_allreduce import OneBitAllreduce, onebit_wire_bytes
from thinwire.compress.cast import CAST_DTYPES, WIRE_DTYPES, CastCompressor
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text

# run_onebit_compute_bench and run_packing_bench (``thinwire bench packing``) live in
# thinwire.comm.bench_packing and stay importable from here.
__all__ = [
    "METHODS",
    "format_table",
    "matrix_shape",
    "plot_times",
    "run_allreduce_bench",
    "run_onebit_compute_bench",
    "run_packing_bench",
    "write_json",
]

METHODS: tuple[str, ...] = (
    *WIRE_DTYPES,  # fp32, then the 16-bit casts: the dtype names of thinwire.compress.cast
    "powersgd-r1",
    "powersgd-r4",
    "onebit",
    "onebit-ring",
    "onebit-fanout",
    "onebit-serial",
)


def matrix_shape(numel: int) -> tuple[int, int]:
    """Near-square (rows, cols) with rows a power of two, rows <= sqrt(n), rows*cols = n."""
    rows = 1
    while numel % (rows * 2) == 0 and (rows * 2) ** 2 <= numel:
        rows *= 2
    return rows, numel // rows


class _Bucket:
    """What ``powerSGD_hook`` reads from a ``dist.GradBucket``: one flat buffer whose only
    gradient is the buffer viewed as a matrix."""

    def __init__(self, buffer: torch.Tensor, shape: tuple[int, int]) -> None:
        self._buffer = buffer
        self._shape = shape

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.view(self._shape)]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _powersgd_op(
    buf: torch.Tensor, rank: int, group: dist.ProcessGroup | None
) -> tuple[Callable[[], None], int]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    w = dist.get_world_size(group)
    rows, cols = matrix_shape(buf.numel())
    state = psgd.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=1,
        use_error_feedback=True,
        warm_start=True,
    )
    state.iter = state.start_powerSGD_iter  # skip PowerSGD's own vanilla-allreduce phase
    bucket = _Bucket(buf, (rows, cols))
    r = min(rows, cols, rank)
    # PowerSGD's own rule: compress when the factors are smaller than the matrix.
    if (rows + cols) * r * state.min_compression_rate < rows * cols:
        wire = ring_allreduce_bytes(4 * r * rows, w) + ring_allreduce_bytes(4 * r * cols, w)
    else:
        wire = ring_allreduce_bytes(4 * buf.numel(), w)

    def op() -> None:
        psgd.powerSGD_hook(state, bucket).wait()  # type: ignore[arg-type]

    return op, wire


def _make_op(
    method: str, x: torch.Tensor, group: dist.ProcessGroup | None, pieces: int | None = None
) -> tuple[Callable[[], None], int, OneBitAllreduce | None]:
    """A zero-argument callable doing one averaging of ``x``'s size, its wire bytes, and
    the 1-bit allreduce behind it (``onebit`` only)."""
    w = dist.get_world_size(group)
    n = x.numel()
    buf = x.clone()
    if method == "fp32":

        def op() -> None:
            buf.copy_(x)
            all_reduce_mean_(buf, group, op_name="bench.fp32")

        return op, ring_allreduce_bytes(4 * n, w), None
    if method in CAST_DTYPES:
        codec = CastCompressor(CAST_DTYPES[method])

        def op() -> None:
            message = codec.compress(x)
            all_reduce_mean_(message.tensors[0], group, op_name=f"bench.{method}")
            codec.decompress(message, out=buf)

        return op, ring_allreduce_bytes(2 * n, w), None
    if method.startswith("powersgd-r"):

        def reset_then(op: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                buf.copy_(x)  # the hook works in place on the bucket
                op()

            return run

        inner, wire = _powersgd_op(buf, int(method.removeprefix("powersgd-r")), group)
        return reset_then(inner), wire, None
    if method.startswith("onebit"):
        phase2 = method.removeprefix("onebit-")
        allreduce = OneBitAllreduce(
            group,
            pieces=pieces,
            phase2=phase2 if phase2 in ("ring", "fanout") else "auto",
            overlap_meta=method != "onebit-serial",
        )

        def op() -> None:
            allreduce(x, out=buf)

        return op, onebit_wire_bytes(n, w), allreduce
    raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _time_interleaved(
    ops: dict[str, Callable[[], None]],
    warmup: int,
    iters: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, list[float]]:
    """Per-call times of each op, each the slowest rank's.

    The ops take turns within every iteration (each after a barrier), so a burst of
    load on a shared machine hits all of them alike and their ratios stay meaningful.
    """
    for op in ops.values():
        for _ in range(warmup):
            op()
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(iters):
        for name, op in ops.items():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            op()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    names = list(ops)
    slowest = torch.tensor([times[k] for k in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, slowest.cpu().tolist(), strict=True))


def _validate(methods: Sequence[str], sizes_bytes: Sequence[int], warmup: int, iters: int) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if not methods:
        raise ConfigError("no methods to benchmark")
    bad = [s for s in sizes_bytes if s < 4 or s % 4]
    if bad:
        raise ConfigError(f"message size {bad[0]} bytes is not a positive multiple of 4 (fp32)")
    if not sizes_bytes:
        raise ConfigError("no message sizes to benchmark")
    if warmup < 0 or iters < 1:
        raise ConfigError(f"need warmup >= 0 and iters >= 1, got {warmup} and {iters}")


def _ops_at_size(
    methods: Sequence[str],
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    pieces: int | None,
    w: int,
) -> tuple[dict[str, Callable[[], None]], dict[str, int], dict[str, OneBitAllreduce]]:
    """Each method's call on ``x`` and its wire bytes, the 1-bit allreduces tuned (and
    ``onebit-compute``, their compute-only twin, among the ops)."""
    ops: dict[str, Callable[[], None]] = {}
    wires: dict[str, int] = {}
    onebits: dict[str, OneBitAllreduce] = {}
    for method in methods:
        ops[method], wires[method], made = _make_op(method, x, group, pieces)
        if made is not None:
            onebits[method] = made
    for method, made in onebits.items():
        # Untimed: the calls that tune the piece count (the same choice on every rank).
        while not made.tuned:
            ops[method]()
    onebit = next(iter(onebits.values()), None)
    if onebit is not None:
        # The compute-only twin runs at the collective's count, so that time - compute
        # splits the very call that was timed.
        local = OneBitAllreduce.compute_only(w, pieces=onebit.pieces_in_use)
        local_out = torch.empty_like(x)
        ops["onebit-compute"] = lambda: local(x, out=local_out)
    return ops, wires, onebits


def run_allreduce_bench(
    methods: Sequence[str],
    sizes_bytes: Sequence[int],
    warmup: int,
    iters: int,
    group: dist.ProcessGroup | None = None,
    pieces: int | None = None,
) -> list[dict[str, Any]]:
    """Time each method at each size; call on every rank; every rank gets the same rows.

    Args:
        methods: names from :data:`METHODS`.
        sizes_bytes: message sizes in bytes of fp32 data (multiples of 4).
        warmup: untimed calls per (method, size); PowerSGD and 1-bit need >= 1 to set up.
        iters: timed calls per (method, size); the median is reported.
        group: process group (default: the default group). The data lives on CUDA when
            the group's backend is NCCL (the current CUDA device), else on CPU.
        pieces: the 1-bit allreduce's piece count (None: tuned by measuring).

    Returns:
        One dict per (size, method) with ``method``, ``size_bytes``, ``numel``,
        ``time_s`` (median), ``algbw_gbps``, ``busbw_gbps`` (GB/s), ``wire_bytes``,
        ``world_size``, ``backend``, ``compute_s`` and ``pieces`` (``onebit`` only,
        else None), ``warmup`` and ``iters``.
    """
    if not dist.is_initialized():
        raise ConfigError("run_allreduce_bench needs an initialised process group")
    _validate(methods, sizes_bytes, warmup, iters)
    w = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(1234 + dist.get_rank(group))
    rows: list[dict[str, Any]] = []
    for size in sizes_bytes:
        n = size // 4
        x = torch.randn(n, generator=gen).to(device)
        ops, wires, onebits = _ops_at_size(methods, x, group, pieces, w)
        times = _time_interleaved(ops, warmup, iters, group, device)
        for method in methods:
            t = statistics.median(times[method])
            compute = statistics.median(times["onebit-compute"]) if method in onebits else None
            algbw = size / t / 1e9
            rows.append(
                {
                    "method": method,
                    "size_bytes": int(size),
                    "numel": n,
                    "time_s": t,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * 2 * (w - 1) / w,
                    "wire_bytes": int(wires[method]),
                    "world_size": w,
                    "backend": backend,
                    "compute_s": compute,
                    "pieces": onebits[method].pieces_in_use if method in onebits else None,
                    "phase2": onebits[method].phase2_in_use if method in onebits else None,
                    "warmup": warmup,
                    "iters": iters,
                }
            )
        del ops
    return rows


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"  # pragma: no cover


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """An nccl-tests style text table; ``vs fp32`` is the fp32 time over this method's
    time at the same size, from the same run (>1: faster than fp32)."""
    fp32 = {r["size_bytes"]: r["time_s"] for r in rows if r["method"] == "fp32"}
    head = (
        f"{'size':>10} {'method':>13} {'time(ms)':>10} {'algbw(GB/s)':>12} "
        f"{'busbw(GB/s)':>12} {'wire bytes':>12} {'vs fp32':>8} {'compute(ms)':>12} "
        f"{'pieces':>6} {'phase 2':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = fp32.get(r["size_bytes"])
        ratio_s = f"{ratio / r['time_s']:.2f}x" if ratio else "-"
        comp = f"{r['compute_s'] * 1e3:.2f}" if r.get("compute_s") is not None else "-"
        pieces = r.get("pieces") or "-"
        phase2 = r.get("phase2") or "-"
        lines.append(
            f"{_human_bytes(r['size_bytes']):>10} {r['method']:>13} {r['time_s'] * 1e3:>10.3f} "
            f"{r['algbw_gbps']:>12.4f} {r['busbw_gbps']:>12.4f} {r['wire_bytes']:>12} "
            f"{ratio_s:>8} {comp:>12} {pieces:>6} {phase2:>7}"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[dict[str, Any]], path: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` to ``path``; returns it."""
    path = Path(path)
    atomic_write_text(path, json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")
    return path


def plot_times(rows: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Log-log plot of median time vs message size, one line per method.

    Returns the path, or None when matplotlib is not installed (``pip install
    thinwire[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["size_bytes"], r["time_s"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes of fp32)")
    ax.set_ylabel("median time per allreduce (ms)")
    w = rows[0]["world_size"] if rows else 0
    ax.set_title(f"allreduce time vs size, {w} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
