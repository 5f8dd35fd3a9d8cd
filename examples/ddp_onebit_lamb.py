"""Plain PyTorch DDP + thinwire's 1-bit LAMB, launched by torchrun.

What it shows: an ordinary DDP training loop that switches its optimizer to
``thinwire.optim.OneBitLamb`` and changes nothing else but one line,
``opt.register_ddp(ddp)``. That call replaces DDP's gradient allreduce with a comm hook
that averages the fp32 gradients during the optimizer's warmup (``freeze_step`` steps)
and sends nothing after it; from then on the optimizer itself exchanges the momentum in
ONE 1-bit allreduce per step. Without it, DDP would average the gradients and the
optimizer would average them again: twice the bytes in warmup, and fp32 gradients on
the wire for the whole run.

Run (2 processes on this machine; ``torchrun`` and ``python -m torch.distributed.run``
are the same program)::

    torchrun --standalone --nproc_per_node 2 examples/ddp_onebit_lamb.py
    torchrun --standalone --nproc_per_node 2 examples/ddp_onebit_lamb.py --tiny   # seconds

It prints the loss, the bytes each rank sent (thinwire's own byte accounting,
``thinwire.comm.accounting``) in the fp32 warmup and in the 1-bit stage, and what an fp32
gradient allreduce on every step would have sent.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm.accounting import COUNTER
from thinwire.optim import OneBitLamb


def make_model(width: int) -> nn.Module:
    """Any nn.Module works; this is a small classifier."""
    return nn.Sequential(
        nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


def batches(rank: int, batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own shard: inputs drawn per rank, labels from one fixed random teacher."""
    teacher = nn.Linear(32, 10)
    teacher.requires_grad_(False)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, 32, generator=gen)
        out.append((x, teacher(x).argmax(dim=1)))
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


def wire_bytes(prefix: str = "") -> int:
    """Bytes this rank put on the wire in thinwire's collectives whose name starts so."""
    return sum(s["wire_bytes"] for op, s in COUNTER.snapshot().items() if op.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze-step", type=int, default=None, help="default: 20%% of --steps")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.width = 30, 64
    freeze = args.freeze_step if args.freeze_step is not None else max(1, args.steps // 5)
    if not 1 <= freeze <= args.steps:
        ap.error(
            f"--freeze-step must be between 1 and the number of steps ({args.steps}), got {freeze}"
        )

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT; NCCL on GPUs, gloo on CPUs.
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)
        model = make_model(args.width).to(device)
        ddp = DDP(model, device_ids=[device] if cuda else None)
        # After init_process_group: the optimizer broadcasts rank 0's parameters.
        # bias_correction=True suits short runs (see docs/optimizers.md).
        opt = OneBitLamb(model.parameters(), lr=args.lr, freeze_step=freeze, bias_correction=True)
        opt.register_ddp(ddp)  # once, before the first backward: gradients averaged once
        after_setup = wire_bytes()  # the optimizer's start-up broadcast is not per step

        losses: list[float] = []  # since the last print; rank 0's shard
        for step, (x, y) in enumerate(batches(rank, args.batch_size, args.steps), start=1):
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if rank == 0 and (step == 1 or step % max(1, args.steps // 10) == 0):
                print(f"step {step:4d}  loss {sum(losses) / len(losses):.4f}", flush=True)
                losses.clear()

        # The replicas must agree: the 1-bit stage gives every rank the same momentum.
        same = replicas_identical(model)

        onebit = wire_bytes("onebit.")
        fp32 = wire_bytes() - after_setup - onebit
        per_fp32 = fp32 / freeze
        sent = fp32 + onebit
        every_step = per_fp32 * args.steps
        if rank == 0:
            print(f"replicas identical: {same}")
            print(f"fp32 warmup, steps 1-{freeze}: {per_fp32:,.0f} bytes per step per rank")
            if args.steps > freeze:
                per_1bit = onebit / (args.steps - freeze)
                print(
                    f"1-bit stage, steps {freeze + 1}-{args.steps}: {per_1bit:,.0f} bytes per "
                    f"step per rank ({per_fp32 / max(per_1bit, 1):.1f}x fewer)"
                )
            print(
                f"bytes sent per rank: {sent:,} over {args.steps} steps on {world} ranks; an fp32 "
                f"allreduce every step: {every_step:,.0f} ({every_step / max(sent, 1):.1f}x more)"
            )
    finally:
        # Free what holds the group and collect it now, while the interpreter is whole:
        # a gloo worker thread that drops its last work during interpreter exit needs
        # the GIL, cannot have it, and aborts the process (torch 2.13, ~1 run in 6
        # under load, measured with plain DDP too).
        model = ddp = opt = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
