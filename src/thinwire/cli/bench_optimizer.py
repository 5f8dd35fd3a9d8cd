"""``thinwire bench optimizer``: time a 1-bit optimizer's step on a recorded job's layout.

Two ways to run it, as ``bench allreduce``:

* locally: ``thinwire bench optimizer --record runs/lamb --workers 4`` spawns 4 gloo
  ranks on loopback;
* on real hosts (or the testbed's): under ``torchrun`` it uses the launched group.

Before each timed step the ranks run the job's own forward and backward passes when the
record is a ``thinwire train`` run (:mod:`thinwire.analysis.job_passes`); for a record of
a loop of the user's own, arithmetic as long as the record's passes stands in for them.

Rank 0 prints the medians (:func:`thinwire.analysis.optimizer_step.summarize`) and, with
``--out DIR``, writes ``optimizer.json``: every rank's timed steps and the summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir

__all__ = ["add_parser"]


def _print(summary: dict[str, float], args: argparse.Namespace, numels: list[int]) -> None:
    s = summary
    before = (
        f"the job's own passes before each ({s['passes_s'] * 1e3:.0f} ms)"
        if args.config is not None
        else f"{args.compute_s * 1e3:.0f} ms of stand-in compute before each"
    )
    print(
        f"{args.algo}, {sum(numels):,} elements in {len(numels)} tensors, "
        f"{int(s['ranks'])} ranks, {before}; medians over {args.iters} steps:"
    )
    print(
        f"  step {s['step_s'] * 1e3:.1f} ms = update {s['update_s'] * 1e3:.1f} ms "
        f"+ exchange {s['exchange_s'] * 1e3:.1f} ms "
        f"(codec {s['codec_s'] * 1e3:.1f} ms, waiting {s['wait_s'] * 1e3:.1f} ms)"
    )
    if args.out:
        print(f"wrote {Path(args.out) / 'optimizer.json'}")


def _under_torchrun(args: argparse.Namespace, numels: list[int]) -> None:
    import torch.distributed as dist

    from thinwire.analysis.optimizer_step import summarize, time_on_this_rank, write_result
    from thinwire.comm.launch import init_from_env

    init_from_env("gloo")
    try:
        mine = time_on_this_rank(
            args.algo, numels, args.warmup, args.iters, args.compute_s, args.config
        )
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            command = "thinwire " + " ".join(sys.argv[1:])
            summary = (
                write_result(args.out, args.algo, numels, gathered, command)
                if args.out
                else summarize(gathered)
            )
            _print(summary, args, numels)
        # Every rank leaves together: one that tore its group down while rank 0 still
        # wrote the result aborted at exit on the testbed.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    from thinwire.analysis.job_passes import job_config
    from thinwire.analysis.optimizer_step import (
        bench_on_local_ranks,
        layout_of_record,
        record_compute_s,
    )
    from thinwire.analysis.recorded import load_record
    from thinwire.comm.launch import launched_by_torchrun

    rec = load_record(args.record)
    numels = layout_of_record(rec.header)
    # the job's own passes where the record is a thinwire train run, unless told otherwise
    args.config = job_config(args.record) if args.compute_ms is None else None
    if args.compute_ms is not None:
        args.compute_s = args.compute_ms / 1e3
    else:
        args.compute_s = record_compute_s(rec) if args.config is None else 0.0
    if args.warmup < 2 or args.iters < 1:
        raise ConfigError(
            f"--warmup must be >= 2 and --iters >= 1, got {args.warmup}, {args.iters}"
        )
    if args.out:
        writable_dir(args.out)  # fail before the benchmark, not after it
    if launched_by_torchrun():
        _under_torchrun(args, numels)
        return 0
    summary = bench_on_local_ranks(
        args.algo,
        numels,
        args.workers,
        args.out,
        args.warmup,
        args.iters,
        args.compute_s,
        args.config,
    )
    _print(summary, args, numels)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from thinwire.analysis.optimizer_step import OPTIMIZERS

    p = sub.add_parser(
        "optimizer",
        help="time a 1-bit optimizer's step on a recorded job's parameters, every rank at once",
        description=(
            "Time the compressed step of a 1-bit optimizer on the parameter sizes of a "
            "recorded run, on every rank at once: the update, the 1-bit codec and the "
            "exchange's waits. Under torchrun it uses the launched group; otherwise it "
            "spawns --workers local ranks."
        ),
    )
    p.add_argument(
        "--record",
        required=True,
        help="a recorded run (its directory or its record.jsonl) whose parameters to use",
    )
    p.add_argument("--algo", choices=OPTIMIZERS, default="onebit-lamb", help="default onebit-lamb")
    p.add_argument("--workers", type=int, default=4, help="local ranks to spawn (default 4)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (default 10)")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="time after this much arithmetic standing in for the forward and backward "
        "passes (0: the ranks start each step together). Default: the job's own passes "
        "when the record is a thinwire train run, else arithmetic for the record's compute",
    )
    p.add_argument("--out", default=None, help="directory for optimizer.json")
    p.set_defaults(func=run)
