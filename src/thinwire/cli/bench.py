"""``thinwire bench allreduce``: time allreduce methods over message sizes.

Two ways to run it:

* locally: ``thinwire bench allreduce --workers 4`` spawns 4 gloo ranks on loopback;
* on real hosts: ``torchrun --nnodes 4 --nproc-per-node 1 ... -m thinwire bench
  allreduce`` (the torchrun environment is detected; ``--workers`` is then ignored).

Rank 0 prints an nccl-tests style table and, with ``--out DIR``, writes
``allreduce.json`` and ``allreduce.png`` (median time vs size per method)
(:mod:`thinwire.comm.bench`).

``thinwire bench packing`` times bit packing against numpy and the compute of one 1-bit
allreduce, in one process (:mod:`thinwire.comm.bench_packing`).

``thinwire bench optimizer`` times a 1-bit optimizer's step on a recorded job's
parameters, every rank at once (:mod:`thinwire.cli.bench_optimizer`).

``thinwire bench zoo`` holds every piece to its uncompressed baseline on a zoo of models
(:mod:`thinwire.cli.bench_zoo`).

``thinwire bench native build|status`` builds (or says whether it built) what thinwire
compiles for this machine: the packing kernels and the testbed's delay line
(:mod:`thinwire.cli.native`; ``thinwire native`` is its old spelling).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from thinwire.comm import bench, bench_packing
from thinwire.comm.launch import init_from_env, launched_by_torchrun, local_cuda_device, spawn
from thinwire.compress.packing import native_enabled
from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir
from thinwire.units import parse_count, parse_size

__all__ = ["register", "size_range"]

MAX_SIZE = 256 * 2**20
"""The largest message ``bench allreduce`` times (256 MiB)."""


def size_range(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` inclusive (both powers of two)."""
    for name, v in (("--min-size", min_bytes), ("--max-size", max_bytes)):
        if v < 4 or v & (v - 1):
            raise ConfigError(f"{name} must be a power of two of at least 4 bytes, got {v}")
    if min_bytes > max_bytes:
        raise ConfigError(f"--min-size {min_bytes} is larger than --max-size {max_bytes}")
    if max_bytes > MAX_SIZE:
        raise ConfigError(f"--max-size {max_bytes} is above the supported 256 MiB")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in bench.METHODS]
    if unknown or not names:
        raise ConfigError(
            f"unknown method {unknown[0] if unknown else text!r}; "
            f"choose from {','.join(bench.METHODS)}"
        )
    return names


def _rank_body(
    rank: int,
    world: int,
    methods: list[str],
    sizes: list[int],
    warmup: int,
    iters: int,
    cuda: bool,
    pieces: int | None,
) -> list[dict[str, Any]]:
    if cuda:
        torch.cuda.set_device(local_cuda_device())  # LOCAL_RANK: this rank, as spawned
    return bench.run_allreduce_bench(methods, sizes, warmup, iters, pieces=pieces)


def _pieces(text: str) -> int | None:
    """'auto' -> None (tuned by measuring); else a positive piece count."""
    if text.strip().lower() == "auto":
        return None
    if not text.strip().isdecimal() or int(text) < 1:
        raise ConfigError(f"--pieces takes 'auto' or a positive whole number, got {text!r}")
    return int(text)


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> None:
    print(bench.format_table(rows))
    if args.out:
        from pathlib import Path

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": command,
            "torch": torch.__version__,
            # the path this rank's packing took (native where built, unless turned off)
            "native_packing": native_enabled(torch.device("cpu")),
        }
        print(f"wrote {bench.write_json(rows, out / 'allreduce.json', meta)}")
        png = bench.plot_times(rows, out / "allreduce.png")
        print(f"wrote {png}" if png else "plot skipped: matplotlib is not installed")


def run(args: argparse.Namespace) -> int:
    methods = _methods(args.methods)
    low, high = parse_size(args.min_size, "--min-size"), parse_size(args.max_size, "--max-size")
    sizes = size_range(low, high)
    pieces = _pieces(args.pieces)
    if args.warmup < 1 or args.iters < 1:
        raise ConfigError(f"--warmup and --iters must be >= 1, got {args.warmup} and {args.iters}")
    command = "thinwire " + " ".join(sys.argv[1:]) if sys.argv else "thinwire bench allreduce"
    if args.out:
        writable_dir(args.out)  # fail before the benchmark, not after it
    if launched_by_torchrun():
        import torch.distributed as dist

        cuda = args.backend == "nccl"
        if cuda:
            torch.cuda.set_device(local_cuda_device())
        init_from_env(args.backend)
        rows = bench.run_allreduce_bench(methods, sizes, args.warmup, args.iters, pieces=pieces)
        if dist.get_rank() == 0:
            _report(rows, args, command)
        dist.destroy_process_group()
        return 0
    if args.workers < 2:
        raise ConfigError(f"--workers must be at least 2, got {args.workers}")
    cuda = args.backend == "nccl"
    if cuda and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA, which is not available here")
    results = spawn(
        _rank_body,
        args.workers,
        args=(methods, sizes, args.warmup, args.iters, cuda, pieces),
        backend=args.backend,
        timeout_s=args.timeout,
    )
    _report(results[0], args, command)
    return 0


def run_packing(args: argparse.Namespace) -> int:
    # zero passes here so that it meets the "at least 8" message below, as it always did
    numels = [
        parse_count(t, "--numel", allow_zero=True) for t in args.numel.split(",") if t.strip()
    ]
    if not numels or any(n < 8 for n in numels):
        raise ConfigError(f"--numel needs counts of at least 8 elements, got {args.numel!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch intra-op threads: {torch.get_num_threads()} (numpy: 1); clock: {args.clock}")
    print(
        f"{'op':>13} {'elements':>11} {'numpy ms':>9} {'torch ms':>9} {'native ms':>9} "
        f"{'np/torch':>9} {'np/native':>9}"
    )
    for r in bench_packing.run_packing_bench(numels, args.repeats, args.clock):
        nat, ratio = r["native_s"], r["speedup_native"]
        nat_s = "-" if nat is None else f"{nat * 1e3:.2f}"
        ratio_s = "-" if ratio is None else f"{ratio:.2f}x"
        print(
            f"{r['op']:>13} {r['numel']:>11} {r['numpy_s'] * 1e3:>9.2f} "
            f"{r['torch_s'] * 1e3:>9.2f} {nat_s:>9} {r['speedup']:>8.2f}x {ratio_s:>9}"
        )
    for n in numels:
        c = bench_packing.run_onebit_compute_bench(n, args.world, args.repeats, args.clock)
        line = (
            f"1-bit allreduce compute only, {n} fp32 elements, {args.world} ranks: "
            f"pure torch {c['compute_s'] * 1e3:.1f} ms = {c['passes']:.1f} passes"
        )
        if c["native_s"] is not None:
            line += f", native {c['native_s'] * 1e3:.1f} ms = {c['native_passes']:.1f} passes"
        print(line + f" (one fp32 copy: {c['copy_s'] * 1e3:.1f} ms)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``thinwire bench allreduce|packing|optimizer|zoo|native``, and ``native``, the hidden old
    spelling of ``bench native``, to the top-level commands."""
    from thinwire.cli.bench_optimizer import add_parser as add_optimizer_parser
    from thinwire.cli.bench_zoo import add_parser
    from thinwire.cli.native import add_native_parser

    parser = subparsers.add_parser(
        "bench", help="measure collectives, packing, the zoo; build native kernels"
    )
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _add_allreduce(sub)
    _add_packing(sub)
    add_optimizer_parser(sub)
    add_parser(sub)
    add_native_parser(sub)
    add_native_parser(subparsers, moved_to="thinwire bench native")


def _add_allreduce(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "allreduce",
        help="time allreduce methods over message sizes (nccl-tests style)",
        description=(
            "Time fp32, fp16/bf16, PowerSGD and thinwire's 1-bit allreduce over message "
            "sizes (powers of two). Under torchrun it uses the launched group; otherwise "
            "it spawns --workers local ranks."
        ),
    )
    p.add_argument("--workers", type=int, default=4, help="local ranks to spawn (default 4)")
    p.add_argument(
        "--methods",
        default=",".join(bench.METHODS),
        help=f"comma-separated subset of {','.join(bench.METHODS)} (default: all)",
    )
    p.add_argument(
        "--min-size",
        default="4KiB",
        help="smallest message, a power of two: bytes or e.g. 4KiB, 1M (K/M/G are 1024-based; "
        "default 4KiB)",
    )
    p.add_argument(
        "--max-size", default="64MiB", help="largest message, at most 256MiB (default 64MiB)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per point (default 2)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per point (default 5)")
    p.add_argument(
        "--pieces",
        default="auto",
        help="pieces per phase of the 1-bit allreduce: 'auto' (tuned by measuring, "
        "default) or a count",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo (CPU, default) or nccl (one GPU per rank)",
    )
    p.add_argument("--out", default=None, help="directory for allreduce.json and allreduce.png")
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds before local ranks are stopped"
    )
    p.set_defaults(func=run)


def _add_packing(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser(
        "packing",
        help="bit packing vs numpy, and the compute cost of one 1-bit allreduce",
        description=(
            "Time torch bit packing/unpacking against numpy.packbits/unpackbits on the same "
            "data, and one whole 1-bit allreduce without the network (in passes over memory)."
        ),
    )
    q.add_argument(
        "--numel", default="10M,100M", help="element counts, K/M/G 1000-based (default 10M,100M)"
    )
    q.add_argument("--repeats", type=int, default=5, help="timed calls per point (default 5)")
    q.add_argument("--world", type=int, default=4, help="ranks simulated in the 1-bit compute")
    q.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    q.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or process CPU time (robust on a busy shared machine)",
    )
    q.set_defaults(func=run_packing)
