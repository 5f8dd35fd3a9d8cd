"""Hugging Face ``accelerate`` + thinwire's 1-bit DDP comm hook, the supported way.

What it shows: accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only
PyTorch's built-in hooks (fp16, bf16, PowerSGD), chosen from an enum. Any other hook is
registered the way PyTorch defines it: on the DDP model that ``accelerator.prepare``
returns, with ``register_comm_hook``, before the first backward. The DDP options that
accelerate does support (here the bucket size) still go through
``DistributedDataParallelKwargs``.

thinwire's hook (``thinwire.comm.onebit_hook``) averages each gradient bucket with sign
bits plus a scale per 64 elements, about 21x fewer bytes than fp32, with error feedback, after
``warmup_steps`` plain fp32 steps. It works with any optimizer (AdamW here) and with
``accelerator.accumulate`` (no bytes travel on the accumulation steps).

Run (``accelerate launch`` with a multi-process config works the same)::

    torchrun --standalone --nproc_per_node 2 examples/accelerate_onebit_hook.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate_onebit_hook.py --tiny

It prints the loss and the bytes each rank sent (``thinwire.comm.accounting``) against an
fp32 allreduce on every step. Needs ``pip install 'thinwire[hf]'``.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm.accounting import COUNTER
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook


def make_data(n: int) -> torch.utils.data.TensorDataset:
    """A learnable synthetic task: labels from one fixed random linear teacher."""
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(32, 10, generator=gen)
    x = torch.randn(n, 32, generator=gen)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))


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
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-cap-mb", type=int, default=25, help="DDP's bucket size")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.width = 20, 64
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    if not 1 <= warmup <= args.steps:
        ap.error(
            f"--warmup-steps must be between 1 and the number of steps ({args.steps}), got {warmup}"
        )

    # cpu=True on a machine without GPUs: accelerate then joins the ranks over gloo.
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_cap_mb)],
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, args.width),
        nn.GELU(),
        nn.Linear(args.width, args.width),
        nn.GELU(),
        nn.Linear(args.width, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The prepared loader gives each rank its own share of every global batch.
    loader = torch.utils.data.DataLoader(
        make_data(64 * accelerator.num_processes * args.steps), batch_size=64, shuffle=True
    )
    model, opt, loader = accelerator.prepare(model, opt, loader)

    if isinstance(model, DDP):  # one process: no DDP, nothing to compress
        model.register_comm_hook(
            OneBitHookState(process_group=None, warmup_steps=warmup), onebit_hook
        )

    model.train()
    losses: list[float] = []  # since the last print; this rank's batches
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 1 or step % max(1, args.steps // 10) == 0:
            accelerator.print(f"step {step:4d}  loss {sum(losses) / len(losses):.4f}")
            losses.clear()

    same = replicas_identical(model)  # every rank must hold the same model
    onebit = wire_bytes("onebit.")
    fp32 = wire_bytes("ddp.allreduce")  # the hook's plain allreduce during its warmup
    per_fp32 = fp32 / warmup
    sent = fp32 + onebit
    every_step = per_fp32 * args.steps
    accelerator.print(f"replicas identical: {same}")
    accelerator.print(f"fp32 warmup, steps 1-{warmup}: {per_fp32:,.0f} bytes per step per rank")
    if args.steps > warmup:
        per_1bit = onebit / (args.steps - warmup)
        accelerator.print(
            f"1-bit stage, steps {warmup + 1}-{args.steps}: {per_1bit:,.0f} bytes per step per "
            f"rank ({per_fp32 / max(per_1bit, 1):.1f}x fewer)"
        )
    accelerator.print(
        f"bytes sent per rank: {sent:,} over {args.steps} steps on {accelerator.num_processes} "
        f"ranks; an fp32 allreduce every step: {every_step:,.0f} "
        f"({every_step / max(sent, 1):.1f}x more)"
    )
    # Free what sits in reference cycles while the process group still exists: without
    # this, about 1 run in 10 of accelerate 1.15 on gloo (with or without the hook)
    # aborted at exit ("terminate called without an active exception").
    gc.collect()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
