"""DiLoCo around your own training loop: communicate once every H steps, not every step.

What it shows: ``thinwire.localsgd.DiLoCo`` wrapped around an ordinary single-process
loop (no DDP). Every rank trains its own replica on its own data with its own AdamW for
``H`` steps; then the ranks average their *pseudo-gradients* (how far each replica moved)
in one allreduce, and an outer Nesterov step moves the shared parameters. DiLoCo hooks
itself onto the inner optimizer (``register_step_post_hook``), so the loop stays
``loss.backward(); inner.step(); inner.zero_grad()``.

Run::

    torchrun --standalone --nproc_per_node 2 examples/diloco_own_loop.py
    torchrun --standalone --nproc_per_node 2 examples/diloco_own_loop.py --compress bf16
    torchrun --standalone --nproc_per_node 2 examples/diloco_own_loop.py --tiny

It prints the loss and the bytes each rank sent (``thinwire.comm.accounting``) against
the fp32 gradient allreduce DDP would send on every step.

Tuning: H = 20-50 to start (the paper uses up to 500 on large models). The outer lr
defaults to thinwire's ``DEFAULT_OUTER_LR`` (0.2) with momentum 0.9: DiLoCo's 0.7 comes
from large models at large H, and on small models at H = 10 it stalled in thinwire's
sweeps (docs/results/localsgd.md). The outer step amplifies whatever the
inner steps do, so the inner lr wants to be a notch lower than for a single worker: on
this task, inner AdamW at 1e-3 made the loss climb again after ~100 steps, 3e-4 did not. ``--compress bf16`` halves the bytes of
each sync, ``onebit`` divides them by ~28 (see docs/localsgd.md).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import COUNTER, ring_allreduce_bytes
from thinwire.localsgd import DiLoCo
from thinwire.localsgd.algorithm.diloco import DEFAULT_OUTER_LR


def batches(rank: int, batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own shard: inputs drawn per rank, labels from one fixed random teacher."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, 32, generator=gen)
        out.append((x, (x @ teacher).argmax(dim=1)))
    return out


def replicas_identical(model: nn.Module) -> bool:
    """True if every rank holds rank 0's parameters (plain torch collectives, not counted)."""
    if not dist.is_initialized():
        return True
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor(float(torch.equal(flat, ref)), device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sync-every", type=int, default=20, help="H, inner steps per sync")
    ap.add_argument("--compress", default="none", choices=("none", "fp16", "bf16", "onebit"))
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=3e-4, help="inner AdamW lr")
    ap.add_argument("--outer-lr", type=float, default=DEFAULT_OUTER_LR, help="outer Nesterov lr")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.sync_every, args.width = 40, 10, 64
    if args.sync_every < 1 or args.steps % args.sync_every:
        ap.error("--steps must be a multiple of --sync-every >= 1, so the run ends on a sync")

    dist.init_process_group("gloo")  # torchrun sets the environment
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(rank)  # replicas may start apart: DiLoCo broadcasts rank 0's
        model = nn.Sequential(
            nn.Linear(32, args.width),
            nn.GELU(),
            nn.Linear(args.width, args.width),
            nn.GELU(),
            nn.Linear(args.width, 10),
        )
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
        diloco = DiLoCo(
            model, inner, sync_every=args.sync_every, outer_lr=args.outer_lr, compress=args.compress
        )
        with diloco:
            start = COUNTER.wire_bytes  # after DiLoCo's one-time broadcast of the start
            losses: list[float] = []  # over the round; rank 0's shard
            for step, (x, y) in enumerate(batches(rank, args.batch_size, args.steps), start=1):
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                inner.step()  # every H-th step also averages and takes the outer step
                inner.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if rank == 0 and (step == 1 or step % args.sync_every == 0):
                    print(f"step {step:4d}  loss {sum(losses) / len(losses):.4f}", flush=True)
                    losses.clear()

        same = replicas_identical(model)  # right after a sync, all ranks hold theta

        sent = COUNTER.wire_bytes - start
        syncs = args.steps // args.sync_every
        grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        # What DDP's fp32 gradient allreduce sends per step (the same ring formula).
        every_step = ring_allreduce_bytes(grad_bytes, world) * args.steps
        if rank == 0:
            print(f"replicas identical after the last sync: {same}")
            print(
                f"{syncs} syncs ({args.compress}): {sent / max(syncs, 1):,.0f} bytes per sync "
                f"per rank"
            )
            print(
                f"bytes sent per rank: {sent:,} over {args.steps} steps on {world} ranks; an "
                f"fp32 allreduce every step: {every_step:,} ({every_step / max(sent, 1):.1f}x more)"
            )
    finally:
        # Free what holds the group and collect it now, while the interpreter is whole:
        # a gloo worker thread that drops its last work during interpreter exit needs
        # the GIL, cannot have it, and aborts the process (torch 2.13, ~1 run in 6
        # under load, measured with plain DDP too).
        model = inner = diloco = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
