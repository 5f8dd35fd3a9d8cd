"""Is the network the bottleneck of *your* training loop? Record it, then ask.

What it shows: one line, ``record_run(ddp, optimizer, path)``, put after building an
ordinary DDP model and its optimizer, records the loop while it trains: each step's
compute, when each gradient became ready, each DDP bucket's bytes and timing
(:mod:`thinwire.comm.step_record`). The loop itself is unchanged. Rank 0 writes
``OUT/record.jsonl``; then the analyzer predicts the job's scaling on other networks
from that record, no separate profiling run::

    torchrun --standalone --nproc_per_node 2 examples/record_own_loop.py --out runs/mine
    thinwire analyze run runs/mine --bandwidth-gbps 0.1 --workers 8

The recipe also calls the analyzer as a library at the end (rank 0), at the link rate
given with ``--gbps``, and prints the verdict.

Tuning: the recorder keeps every step of the first 50 and one in 10 after them
(``dense_steps``, ``every``); ``thinwire analyze run --skip`` leaves out warmup steps
(DDP's first step reduces in another bucket layout).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.step_record import RECORD_NAME, record_run


def make_model(width: int) -> nn.Module:
    """A ReLU MLP classifier: the kind of model a user brings, not thinwire's GPT."""
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--out", default=None, help="where record.jsonl goes (runs/record-own-loop)")
    ap.add_argument("--gbps", type=float, default=0.1, help="link rate the verdict is for")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.width = 20, 256
    if args.out is None:  # --tiny (a test) writes nothing into the working directory
        args.out = (
            tempfile.mkdtemp(prefix="thinwire-record-") if args.tiny else "runs/record-own-loop"
        )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / RECORD_NAME).unlink(missing_ok=True)  # a fresh record for this run
    dist.barrier()

    ddp = DistributedDataParallel(make_model(args.width))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    recorder = record_run(ddp, opt, out / RECORD_NAME, meta={"batch_size": args.batch_size})

    gen = torch.Generator().manual_seed(rank)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):  # an ordinary loop: nothing here knows of the recorder
        x = torch.randn(args.batch_size, 64, generator=gen)
        loss = nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(dim=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % max(1, args.steps // 5) == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    recorder.close()
    dist.barrier()

    if rank == 0:
        from thinwire.analysis.recorded import analyze_record, load_record
        from thinwire.analysis.report import recommend

        rec = load_record(out)
        study = analyze_record(rec, bandwidth_gbps=args.gbps)
        seen = study["recorded"]
        print(f"recorded {len(rec.steps)} steps on {rec.world_size} ranks in {rec.path}")
        print(
            f"measured step {seen['step_s'] * 1e3:.1f} ms, compute {seen['compute_s'] * 1e3:.1f} ms"
        )
        verdict, advice = recommend(study)
        print(f"at {args.gbps:g} Gbit/s: {verdict}")
        print(f"fix: {advice}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
