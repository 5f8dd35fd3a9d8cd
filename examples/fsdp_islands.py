"""FSDP2 inside islands, thinwire across them (1-bit LAMB or DiLoCo), launched by torchrun.

What it shows: a model too big for one device is sharded with FSDP2's ``fully_shard``
inside an island (ranks joined by fast links), and replicated across islands (joined by
a slow one). FSDP2 keeps its full-precision reduce-scatter inside the island; across
islands, thinwire sends each rank's shard:

* ``--algo onebit-lamb`` (default): ``thinwire.optim.OneBitLamb`` averages each shard of
  the gradients in its warmup, then sends each shard's momentum at ~1 bit per element
  with error feedback, every step;
* ``--algo diloco``: ``thinwire.localsgd.DiLoCo`` around the inner AdamW sends each
  shard's pseudo-gradient once every ``--sync-every`` steps;
* ``--algo lamb``: ``thinwire.optim.Lamb`` averages each shard's gradient across the
  islands in fp32 every step: the uncompressed baseline of 1-bit LAMB.

The changes to an FSDP2 loop: the mesh's island dimension goes to ``fully_shard``, its
replica dimension to thinwire as ``process_group``.

Run (4 processes on this machine: 2 islands of 2 ranks)::

    torchrun --standalone --nproc_per_node 4 examples/fsdp_islands.py
    torchrun --standalone --nproc_per_node 4 examples/fsdp_islands.py --algo diloco
    torchrun --standalone --nproc_per_node 4 examples/fsdp_islands.py --tiny   # seconds

On several machines, ranks ``[i * k, (i + 1) * k)`` form island ``i`` (``--island-size
k``): start one island per machine, e.g. ``torchrun --nnodes 2 --nproc_per_node 2``.

It prints the loss, whether every island holds the same model, and the bytes each rank
sent across islands (thinwire's own accounting, ``thinwire.comm.accounting``): for 1-bit
LAMB in the fp32 warmup and in the 1-bit stage, for DiLoCo per sync against an fp32
gradient allreduce every step. FSDP2's traffic inside an island is not counted.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from thinwire.comm.accounting import COUNTER, ring_allreduce_bytes
from thinwire.localsgd import DiLoCo
from thinwire.optim import Lamb, OneBitLamb


def make_model(width: int) -> nn.Module:
    """Any nn.Module works; each block is its own FSDP2 unit, as in a transformer."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, width), nn.GELU()),
        nn.Sequential(nn.Linear(width, width), nn.GELU()),
        nn.Linear(width, 10),
    )


def batches(rank: int, batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data: inputs drawn per rank, labels from one fixed random teacher."""
    teacher = nn.Linear(32, 10)
    teacher.requires_grad_(False)
    torch.nn.init.normal_(teacher.weight, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, 32, generator=gen)
        out.append((x, teacher(x).argmax(dim=1)))
    return out


def islands_identical(model: nn.Module) -> bool:
    """True if every island holds island 0's model (whole tensors gathered from the
    shards; plain torch collectives, not counted)."""
    flat = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor(float(torch.equal(flat, ref)), device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def wire_bytes(prefix: str = "") -> int:
    """Bytes this rank put on the wire in thinwire's collectives whose name starts so."""
    return sum(s["wire_bytes"] for op, s in COUNTER.snapshot().items() if op.startswith(prefix))


def train(
    model: nn.Module, step_fn: object, rank: int, args: argparse.Namespace, device: object
) -> None:
    """The user's loop: forward, backward, ``step_fn()``; rank 0 prints the loss."""
    losses: list[float] = []
    for step, (x, y) in enumerate(batches(rank, args.batch_size, args.steps), start=1):
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step_fn()  # type: ignore[operator]
        losses.append(loss.item())
        if rank == 0 and (step == 1 or step % max(1, args.steps // 10) == 0):
            print(f"step {step:4d}  loss {sum(losses) / len(losses):.4f}", flush=True)
            losses.clear()


def run_onebit_lamb(
    model: nn.Module, replicas: object, rank: int, args: argparse.Namespace, device: object
) -> None:
    freeze = args.freeze_step if args.freeze_step is not None else max(1, args.steps // 5)
    opt = OneBitLamb(
        model.parameters(),
        lr=args.lr or 1e-2,
        freeze_step=freeze,
        process_group=replicas,  # across islands: the slow link
    )
    after_setup = wire_bytes()  # the optimizer's start-up broadcast is not per step

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    train(model, step, rank, args, device)
    onebit = wire_bytes("onebit.")
    per_fp32 = (wire_bytes() - after_setup - onebit) / freeze
    if rank == 0:
        print(f"fp32 warmup, steps 1-{freeze}: {per_fp32:,.0f} bytes per step")
        if args.steps > freeze:
            per_1bit = onebit / (args.steps - freeze)
            print(
                f"1-bit stage, steps {freeze + 1}-{args.steps}: {per_1bit:,.0f} bytes per "
                f"step ({per_fp32 / max(per_1bit, 1):.1f}x fewer)"
            )


def run_lamb(
    model: nn.Module, replicas: object, rank: int, args: argparse.Namespace, device: object
) -> None:
    opt = Lamb(model.parameters(), lr=args.lr or 1e-2, process_group=replicas)
    after_setup = wire_bytes()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    train(model, step, rank, args, device)
    if rank == 0:
        print(f"fp32, every step: {(wire_bytes() - after_setup) / args.steps:,.0f} bytes per step")


def run_diloco(
    model: nn.Module, replicas: object, rank: int, args: argparse.Namespace, device: object
) -> None:
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3)
    with DiLoCo(model, inner, sync_every=args.sync_every, process_group=replicas) as diloco:
        after_setup = wire_bytes()  # DiLoCo's start-up broadcast is not per step

        def step() -> None:
            inner.step()  # every sync_every-th call also syncs across islands
            inner.zero_grad(set_to_none=True)

        train(model, step, rank, args, device)
    sent = wire_bytes() - after_setup
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    every_step = args.steps * ring_allreduce_bytes(shard_bytes, dist.get_world_size(replicas))
    if rank == 0:
        syncs = diloco.outer_steps
        print(f"{syncs} syncs: {sent / max(syncs, 1):,.0f} bytes per sync")
        print(
            f"bytes sent over {args.steps} steps: {sent:,}; an fp32 gradient allreduce every "
            f"step: {every_step:,} ({every_step / max(sent, 1):.1f}x more)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", choices=("onebit-lamb", "lamb", "diloco"), default="onebit-lamb")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze-step", type=int, default=None, help="default: 20%% of --steps")
    ap.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    ap.add_argument("--island-size", type=int, default=2, help="ranks per island")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=None, help="1e-2 ((1-bit) LAMB), 1e-3 (AdamW)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.width = 30, 64
    if args.freeze_step is not None and not 1 <= args.freeze_step <= args.steps:
        ap.error(f"--freeze-step must be between 1 and --steps ({args.steps})")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world, k = dist.get_rank(), dist.get_world_size(), args.island_size
    if k < 1 or world % k or world // k < 2:
        dist.destroy_process_group()
        ap.error(f"--island-size {k} must split the {world} ranks into 2 or more islands")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    model = None
    try:
        mesh = init_device_mesh(
            "cuda" if cuda else "cpu", (world // k, k), mesh_dim_names=("replicate", "shard")
        )
        torch.manual_seed(0)
        model = make_model(args.width).to(device)
        for block in model:  # inside the island only: FSDP2 never crosses the slow link
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        if rank == 0:
            print(f"{world // k} islands of {k} ranks; {args.algo} across islands")
        run = {"onebit-lamb": run_onebit_lamb, "lamb": run_lamb, "diloco": run_diloco}[args.algo]
        run(model, mesh.get_group("replicate"), rank, args, device)
        same = islands_identical(model)
        if rank == 0:
            print(f"islands identical: {same}")
            print("(bytes: sent by each rank across islands; FSDP2's inside an island not counted)")
    finally:
        # Collect what holds the group while the interpreter is whole (see
        # examples/ddp_onebit_lamb.py: gloo can abort a process at exit otherwise).
        model = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
