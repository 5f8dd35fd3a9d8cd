"""Compute costs the network model charges besides the wire: reductions and packing.

A ring allreduce does not only move bytes: in its reduce-scatter phase every worker adds
``n - 1`` incoming chunks of ``S/n`` bytes to its own. On fast links this reduction is a
visible share of the collective, so the model charges ``(n - 1) * t_add(S / n)``.

:class:`AddCost` answers ``t_add(nbytes)`` from a table of measurements, interpolating
linearly between rows and extrapolating linearly beyond the ends (the cost of a large
add grows linearly with its size; below the smallest row the table's launch-bound floor
holds). Three ways to get one:

* :func:`thinwire.analysis.bklog.read_vec_add_table` reads the paper's GPU table
  (``cuda_vec_add.log``: ``bytes,seconds`` per line), which reproduces its numbers;
* :meth:`AddCost.measure` times ``torch.add`` here, on this device, for the sizes given;
* :meth:`AddCost.zero` charges nothing (for a link fit that already folds the
  reduction into its effective bandwidth).

:func:`measure_codec_cost` times the compute of thinwire's 1-bit allreduce per input
byte; the simulation charges it per bucket for compressed schemes when asked to.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.errors import ConfigError

__all__ = ["AddCost", "machine_costs", "measure_codec_cost"]

DEFAULT_MEASURE_SIZES = tuple(2**k for k in range(10, 25, 2))
"""Byte sizes :meth:`AddCost.measure` times by default: 1 KiB to 16 MiB, every 4x."""


@dataclass(frozen=True)
class AddCost:
    """Seconds to add two vectors of ``nbytes`` bytes, from a measured table.

    Args:
        sizes: byte sizes of the measurements, strictly increasing, at least two.
        seconds: measured seconds per add, one per size, non-negative.
        source: where the table came from (a file, ``"measured on cpu"``); shown in reports.
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]
    source: str = "table"

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds):
            raise ConfigError(
                f"add-cost table {self.source}: {len(self.sizes)} sizes but "
                f"{len(self.seconds)} times"
            )
        if len(self.sizes) == 1 and self.sizes[0] == 0 and self.seconds[0] == 0:
            return  # the zero table
        if len(self.sizes) < 2:
            raise ConfigError(f"add-cost table {self.source}: needs at least 2 rows")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ConfigError(f"add-cost table {self.source}: sizes must strictly increase")
        if any(s < 0 for s in self.seconds):
            raise ConfigError(f"add-cost table {self.source}: times must be >= 0")

    @classmethod
    def zero(cls) -> AddCost:
        """No reduction cost (the paper's model without its table, or a fitted link)."""
        return cls((0.0,), (0.0,), "none")

    @classmethod
    def measure(
        cls,
        sizes: Sequence[int] = DEFAULT_MEASURE_SIZES,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        repeats: int = 7,
    ) -> AddCost:
        """Time ``a.add_(b)`` on ``device`` for each byte size; fastest of ``repeats`` runs.

        The fastest run, not the median: on a shared machine other processes only ever
        add time, and the model wants the cost of the add itself.

        Tuning: the default sizes take well under a second on a CPU. Use sizes that cover
        ``bucket_bytes / workers`` of your runs; outside them the table extrapolates.
        """
        dev = torch.device(device)
        elem = torch.tensor([], dtype=dtype).element_size()
        out_sizes: list[float] = []
        out_times: list[float] = []
        for nbytes in sorted(set(int(s) for s in sizes)):
            n = max(1, nbytes // elem)
            a = torch.ones(n, dtype=dtype, device=dev)
            b = torch.ones(n, dtype=dtype, device=dev)
            a.add_(b)  # first touch: page faults and kernel selection are not the add
            times = []
            for _ in range(repeats):
                _sync(dev)
                t0 = time.perf_counter()
                a.add_(b)
                _sync(dev)
                times.append(time.perf_counter() - t0)
            out_sizes.append(float(n * elem))
            out_times.append(float(min(times)))
        return cls(tuple(out_sizes), tuple(out_times), f"measured on {dev.type}")

    def __call__(self, nbytes: float) -> float:
        """Seconds to add two ``nbytes``-byte vectors (0 for ``nbytes <= 0``)."""
        if nbytes <= 0 or len(self.sizes) == 1:
            return 0.0
        xs, ys = self.sizes, self.seconds
        if nbytes <= xs[0]:
            # Small adds are launch-bound: the smallest measurement is the floor.
            return ys[0]
        if nbytes >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return max(0.0, ys[-1] + slope * (nbytes - xs[-1]))
        return float(np.interp(nbytes, xs, ys))

    def to_json(self) -> dict[str, object]:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "source": self.source}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> AddCost:
        try:
            return cls(
                tuple(float(x) for x in data["sizes"]),  # type: ignore[union-attr]
                tuple(float(x) for x in data["seconds"]),  # type: ignore[union-attr]
                str(data.get("source", "table")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"add-cost table is malformed: {exc}") from None


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_codec_cost(
    nbytes: int = 4 * 2**20,
    world_size: int = 8,
    device: str | torch.device = "cpu",
    repeats: int = 10,
) -> float:
    """Seconds per input byte of the compute of thinwire's 1-bit allreduce.

    Times :meth:`thinwire.comm.onebit_allreduce.OneBitAllreduce.compute_only` (every
    step of a ``world_size``-rank call -- error feedback, scales, sign packing, the chunk
    owner's average, unpacking -- with the exchanges replaced by local copies) on an
    fp32 tensor of ``nbytes``. The simulation charges ``cost * bucket_bytes`` per bucket
    on top of the wire time. The owner's average is also priced by the reduction
    table, and the real call hides much of this compute behind the wire (the error
    updates run during the transfers, and the pieces overlap the rest), so this
    overcounts: an upper bound, worst on slow links. Timed with one piece, the count
    that adds no per-collective overhead.
    """
    from thinwire.comm.onebit_allreduce import OneBitAllreduce

    if nbytes < 4:
        raise ConfigError(f"codec measurement size must be >= 4 bytes, got {nbytes}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    dev = torch.device(device)
    x = torch.randn(nbytes // 4, device=dev)
    op = OneBitAllreduce.compute_only(world_size, pieces=1)
    op(x)  # warm-up: allocates the buffers once, as a training run would
    times = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        op(x)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return float(min(times)) / (x.numel() * 4)  # fastest run: see AddCost.measure


def machine_costs(
    threads: int | None = None,
    world_size: int = 4,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """This machine's compute prices, measured once and kept: ``codec_s_per_byte`` (the
    1-bit allreduce's compute per input byte, :func:`measure_codec_cost`) and ``add`` (the
    reduction table, :meth:`AddCost.measure`), both on the CPU at ``threads`` torch
    threads (default: this process's; pass a training rank's, which shares the cores).

    The cache is a small JSON file per machine and thread count under ``cache_dir``
    (default ``$THINWIRE_CACHE_DIR``, else ``~/.cache/thinwire``), keyed by the CPU model,
    the torch version and the threads; a file that cannot be read or written only costs a
    new measurement (about a second).
    """
    import json
    import os
    import platform

    from thinwire.io import atomic_write_text

    threads = threads or torch.get_num_threads()
    cpu = _cpu_model()
    key = f"{cpu}|torch {torch.__version__}|{threads} threads|W{world_size}"
    base = Path(
        cache_dir or os.environ.get("THINWIRE_CACHE_DIR") or Path.home() / ".cache" / "thinwire"
    )
    path = base / f"costs-{platform.node() or 'host'}-t{threads}-w{world_size}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return {
                "codec_s_per_byte": float(saved["codec_s_per_byte"]),
                "add": AddCost.from_json(saved["add"]),
                "source": f"measured on this machine ({threads} threads), cached in {path}",
            }
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        pass
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        codec = measure_codec_cost(world_size=world_size)
        add = AddCost.measure()
    finally:
        torch.set_num_threads(before)
    blob = {"key": key, "codec_s_per_byte": codec, "add": add.to_json()}
    try:
        base.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(blob, indent=1) + "\n")
    except OSError:
        pass  # measured anyway; the next call measures again
    return {
        "codec_s_per_byte": codec,
        "add": add,
        "source": f"measured on this machine ({threads} threads)",
    }


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
