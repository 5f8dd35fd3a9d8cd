"""Check thinwire's CUDA paths on a machine with a GPU, and time them. One short run.

    PYTHONPATH=src python tools/cuda_check.py [--out cuda_check.json] [--numel 100M]
        [--skip-tests] [--train-steps 60] [--algos adamw,lamb,onebit-adam,onebit-lamb]

What it does, in order (about two minutes on one H200, half of it the training runs;
docs/results/gpu.md has its numbers):

1. the CUDA tests of the suite (``pytest -k cuda``: packing, the 1-bit allreduce's
   compute, the optimizers on CUDA tensors), which skip on machines without CUDA;
2. packing and unpacking throughput on CUDA tensors against ``numpy.packbits`` /
   ``unpackbits`` on the CPU, same data;
3. one whole 1-bit allreduce of 64 MiB without the network
   (:meth:`~thinwire.comm.onebit_allreduce.OneBitAllreduce.compute_only`, 4 simulated
   ranks) on CUDA against the CPU, and its output checked against the CPU's;
4. LAMB / 1-bit LAMB steps on a 25M-parameter problem on CUDA, and every optimizer's
   step on the ~150 tensors of an 85M-parameter GPT, against torch's AdamW, with the
   host syncs each step makes (a sync per layer stalls the GPU's stream);
5. ``thinwire train --device cuda`` under ``torchrun`` (NCCL, one rank: the optimizers
   on a GPT of about 85M parameters, with the job's own passes) for AdamW, LAMB, 1-bit
   Adam and 1-bit LAMB: throughput, final loss, and that every loss is finite.

Prints each section and writes the numbers as JSON. Exits with status 2 and one line when
CUDA is not available, 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
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


def optimizers_gpt(repeats: int) -> dict[str, dict[str, float]]:
    """Each optimizer's step alone on an 85M-parameter GPT's parameters (random
    gradients, past the 1-bit freeze), and how many host syncs one step makes."""
    import warnings

    from thinwire.optim import Lamb, OneBitAdam, OneBitLamb
    from thinwire.train.model import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=256, n_layer=12, n_head=12, n_embd=768)).cuda()
    params = list(model.parameters())
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "torch_adamw": lambda: torch.optim.AdamW(params, lr=1e-4),
        "adam_1bit": lambda: OneBitAdam(params, lr=1e-4, freeze_step=2),
        "lamb": lambda: Lamb(params, lr=1e-3),
        "lamb_1bit": lambda: OneBitLamb(params, lr=1e-3, freeze_step=2),
    }
    out: dict[str, dict[str, float]] = {"tensors": {"count": float(len(params))}}
    for name, make in makers.items():
        opt = make()

        def step(opt: torch.optim.Optimizer = opt) -> None:
            for q in params:
                q.grad = torch.randn_like(q)
            opt.step()

        for _ in range(4):  # past the freeze
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            opt.step()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        out[name] = {"step_s": _timed(step, repeats, True), "host_syncs": float(syncs)}
    return out


# GPT-2 small's shape at thinwire's character vocabulary: about 85M parameters.
_GPT = ["--n-layer", "12", "--n-head", "12", "--n-embd", "768", "--seq-len", "256"]


ALGOS = ("adamw", "lamb", "onebit-adam", "onebit-lamb")


def training(steps: int, out: Path, algos: tuple[str, ...] = ALGOS) -> dict[str, dict[str, Any]]:
    """``thinwire train --device cuda`` under torchrun, one rank, per algorithm."""
    results: dict[str, dict[str, Any]] = {}
    for algo in algos:
        run_dir = out / algo
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "1", "-m", "thinwire", "train", "--device", "cuda"]
        cmd += ["--algo", algo, "--steps", str(steps), "--batch-size", "32", *_GPT]
        cmd += ["--eval-interval", str(steps), "--no-progress", "--out", str(run_dir)]
        if algo.startswith("onebit"):
            cmd += ["--freeze-step", str(steps // 3)]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        row: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 1)}
        summary = run_dir / "summary.json"
        if res.returncode != 0 or not summary.exists():
            row["error"] = (res.stderr or res.stdout)[-800:]
        else:
            s = json.loads(summary.read_text())
            losses = [
                json.loads(line).get("loss")
                for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ]
            losses = [v for v in losses if v is not None]
            row |= {
                "parameters": s["parameters"],
                "samples_per_s": s["samples_per_s"],
                "train_time_s": s["train_time_s"],
                "final_val_loss": s["final_val_loss"],
                "losses_finite": bool(losses) and all(np.isfinite(losses)),
            }
        results[algo] = row
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="cuda_check.json", help="JSON output")
    p.add_argument("--numel", default="100M", help="elements for the packing timings")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-tests", action="store_true", help="timings only")
    p.add_argument("--train-steps", type=int, default=60, help="steps per training run (0: none)")
    p.add_argument("--algos", default=",".join(ALGOS), help="algorithms to train with")
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
    report["optimizers_gpt_85M"] = optimizers_gpt(args.repeats)
    if args.train_steps:
        with tempfile.TemporaryDirectory(prefix="cuda_check_") as runs:
            algos = tuple(a for a in args.algos.split(",") if a)
            report["train_85M"] = training(args.train_steps, Path(runs), algos)
        ok &= all(r.get("losses_finite", False) for r in report["train_85M"].values())
    for section, values in report.items():
        print(f"{section}: {values}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
