"""Check thinwire's CUDA paths on a machine with a GPU, and time them. One short run.

    python tools/cuda_check.py [--out cuda_check.json] [--numel 100M]

What it does, in order (about a minute on one GPU):

1. the CUDA tests of the suite (``pytest -k cuda``: packing, the 1-bit allreduce's
   compute, the optimizers on CUDA tensors), which skip on machines without CUDA;
2. packing and unpacking throughput on CUDA tensors against ``numpy.packbits`` /
   ``unpackbits`` on the CPU, same data;
3. one whole 1-bit allreduce of 64 MiB without the network
   (:meth:`~thinwire.comm.onebit_allreduce.OneBitAllreduce.compute_only`, 4 simulated
   ranks) on CUDA against the CPU, and its output checked against the CPU's;
4. LAMB / 1-bit LAMB steps on a 25M-parameter problem on CUDA.

Prints a table and writes the numbers as JSON. Exits with status 2 and one line when
CUDA is not available, 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _timed(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Median seconds of ``fn`` after one warm-up call (CUDA synchronised)."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def packing(numel: int, repeats: int) -> dict[str, float]:
    from thinwire.compress.packing import pack_bits, pack_signs, unpack_bits, unpack_signs

    x = torch.randn(numel, device="cuda")
    bits = x >= 0
    packed = pack_signs(x)
    host_bits = bits.cpu().numpy()
    host_packed = packed.cpu().numpy()
    scale = torch.tensor(0.5, device="cuda")
    return {
        "pack_bits_s": _timed(lambda: pack_bits(bits), repeats, True),
        "pack_signs_s": _timed(lambda: pack_signs(x), repeats, True),
        "unpack_bits_s": _timed(lambda: unpack_bits(packed, numel), repeats, True),
        "unpack_signs_s": _timed(lambda: unpack_signs(packed, scale), repeats, True),
        "numpy_packbits_s": _timed(lambda: np.packbits(host_bits), repeats, False),
        "numpy_unpackbits_s": _timed(lambda: np.unpackbits(host_packed), repeats, False),
    }


def onebit_compute(repeats: int) -> dict[str, Any]:
    from thinwire.comm.onebit_allreduce import OneBitAllreduce

    x = torch.randn(16 << 20)
    xc = x.cuda()
    cpu, gpu = OneBitAllreduce.compute_only(4, pieces=1), OneBitAllreduce.compute_only(4)
    big_chunks = OneBitAllreduce.compute_only(4, chunk=1 << 24)
    # First call (zero error): same signs, scales equal up to rounding. Later calls may
    # differ where rounding flips the sign of a near-zero element.
    same = torch.allclose(gpu(xc).cpu(), cpu(x), rtol=1e-5, atol=1e-6)
    return {
        "cpu_s": _timed(lambda: cpu(x), repeats, False),
        "cuda_s": _timed(lambda: gpu(xc), repeats, True),
        "cuda_chunk_16M_s": _timed(lambda: big_chunks(xc), repeats, True),
        "cuda_pieces": gpu.pieces_in_use,
        "matches_cpu": bool(same),
    }


def optimizers(repeats: int) -> dict[str, float]:
    from thinwire.optim import Lamb, OneBitLamb

    def stepper(opt: torch.optim.Optimizer, param: torch.nn.Parameter) -> Callable[[], None]:
        def step() -> None:
            param.grad = torch.randn_like(param)
            opt.step()

        return step

    out = {}
    for name, cls, kw in (("lamb", Lamb, {}), ("onebit_lamb", OneBitLamb, {"freeze_step": 2})):
        param = torch.nn.Parameter(torch.randn(5000, 5000, device="cuda"))
        step = stepper(cls([param], lr=1e-3, **kw), param)
        for _ in range(3):  # past the freeze
            step()
        out[f"{name}_step_s"] = _timed(step, repeats, True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="cuda_check.json", help="JSON output")
    p.add_argument("--numel", default="100M", help="elements for the packing timings")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-tests", action="store_true", help="timings only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check: CUDA is not available on this machine", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    ok = True
    if not args.skip_tests:
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-k", "cuda", "tests"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
        report["tests"] = tests.stdout.strip().splitlines()[-1:] or [tests.stderr[-500:]]
        ok &= tests.returncode == 0
    numel = _count(args.numel)
    report["packing"] = packing(numel, args.repeats) | {"numel": numel}
    report["onebit_compute_64MiB"] = onebit_compute(args.repeats)
    ok &= report["onebit_compute_64MiB"]["matches_cpu"]
    report["optimizers_25M"] = optimizers(args.repeats)
    for section, values in report.items():
        print(f"{section}: {values}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
