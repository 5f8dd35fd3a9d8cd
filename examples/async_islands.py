"""Asynchronous Local-SGD whose workers are islands of ranks, each sharding your model with FSDP2.

What it shows: ``thinwire.localsgd.run_async`` on a model of your own, where one worker's
model, gradients and optimizer state are meant for several devices. Each worker is an
island of ``--island-size`` ranks joined by a fast network (a node's GPUs): inside it
FSDP2 shards the model (each block a unit: the ``shard`` of the ``Task``) and every rank
trains on its part of the worker's batch. Across islands nothing but asynchronous
Local-SGD travels: Delayed Nesterov with Dynamic Local Updates, each island's leader
pushing its pseudo-gradient at 1 bit per element with error feedback every H steps, and
the other islands never waiting for it.

The changes against workers of one rank: ``AsyncConfig(shard_within=k)``, the Task's
``shard`` and launching ``1 + W * k`` ranks. Rank 0 serves (theta, the outer optimizer,
evaluation), ranks ``1..W`` lead the islands, the others follow their leader.

Run (5 processes on this machine: the server and 2 islands of 2 ranks)::

    torchrun --standalone --nproc_per_node 5 examples/async_islands.py
    torchrun --standalone --nproc_per_node 5 examples/async_islands.py --tiny   # seconds

It prints the evaluation loss as the run goes, each island's rounds, and the bytes
through the server against an fp32 allreduce of the whole model on every inner step.
FSDP2's traffic inside an island is not counted (it stays on the fast network).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.localsgd import AsyncConfig, Task, for_method, run_async


def make_model(width: int) -> nn.Module:
    """Any nn.Module works; each block is its own FSDP2 unit, as in a transformer."""
    torch.manual_seed(0)  # the same start on every rank
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, width), nn.GELU()),
        nn.Sequential(nn.Linear(width, width), nn.GELU()),
        nn.Linear(width, 10),
    )


def shard_blocks(model: nn.Module, mesh: object) -> None:
    """The FSDP2 units on the island's mesh; thinwire makes the root one after them."""
    for block in model:
        fully_shard(block, mesh=mesh)


def teacher() -> nn.Module:
    net = nn.Linear(32, 10)
    net.requires_grad_(False)
    torch.nn.init.normal_(net.weight, generator=torch.Generator().manual_seed(1234))
    return net


class Shard:
    """One data shard: the batch of its ``step``-th inner step depends on (shard, step)."""

    def __init__(self, index: int, batch_size: int) -> None:
        self.index, self.batch_size, self.label = index, batch_size, teacher()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1_000_003 * (self.index + 1) + step)
        x = torch.randn(self.batch_size, 32, generator=gen)
        return x, self.label(x).argmax(dim=1)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def evaluate(model: nn.Module) -> dict[str, float]:
    x, y = Shard(999, 512)(0)
    logits = model(x)
    return {
        "loss": float(F.cross_entropy(logits, y)),
        "accuracy": float((logits.argmax(1) == y).float().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--island-size", type=int, default=2, help="ranks per worker")
    ap.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    ap.add_argument("--local-steps", type=int, default=10, help="H")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64, help="per worker (split over its ranks)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.width = 40, 64

    dist.init_process_group("gloo")  # CPU here; run_async's islands take the launch's backend
    rank = dist.get_rank()
    task = Task(
        model=lambda: make_model(args.width),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        shards=lambda n: [Shard(i, args.batch_size) for i in range(n)],
        loss=loss,
        evaluate=evaluate,
        shard=shard_blocks,
    )
    cfg = for_method(
        AsyncConfig(
            steps=args.steps,
            local_steps=args.local_steps,
            warmup_steps=max(1, args.steps // 10),  # of each shard's own inner lr clock
            shard_within=args.island_size,
            compress="onebit",
            eval_interval=max(1, args.steps // 4),
            outer_lr=1.0,  # this small task takes a larger outer step than the tuned defaults
        ),
        "dn-dylu",
    )
    try:
        summary = run_async(
            task,
            cfg,
            on_eval=lambda r: print(
                f"step {r['step']:5d}  loss {r['val_loss']:.4f}  accuracy {r['accuracy']:.3f}",
                flush=True,
            ),
        )
        if rank == 0:
            workers = summary["workers"]
            print(f"{workers} islands of {args.island_size} ranks; dn-dylu across islands")
            numel = sum(p.numel() for p in make_model(args.width).parameters())
            every_step = summary["inner_steps"] * ring_allreduce_bytes(numel * 4, workers)
            sent = summary["comm_bytes"]
            print(f"updates applied: {summary['updates_applied']}")
            print(
                f"bytes through the server: {sent:,}; an fp32 allreduce of the model on every "
                f"inner step: {every_step:,} ({every_step / max(sent, 1):.1f}x more)"
            )
        else:
            print(f"rank {rank}: {summary['rounds']} rounds, {summary['steps']} inner steps")
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
