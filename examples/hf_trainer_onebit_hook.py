"""Hugging Face ``transformers.Trainer`` with its own AdamW + thinwire's 1-bit DDP comm hook.

What it shows: keep the Trainer exactly as it is (its AdamW, its scheduler, its DDP) and
compress only what DDP sends. ``thinwire.comm.onebit_hook`` plugs into DDP's own
extension point, ``register_comm_hook``: each gradient bucket is averaged with sign bits
plus a scale per 64 elements (~21x fewer bytes than fp32), and what the compression loses is
fed back into the next step (error feedback). The first ``warmup_steps`` steps use the
plain fp32 allreduce.

The Trainer builds its DDP model only inside ``train()``, so a ``TrainerCallback``
registers the hook at ``on_train_begin``, on ``trainer.model_wrapped`` (the DDP model),
before the first backward. The model is a GPT-2 built from a ``GPT2Config`` (random
init, nothing downloaded) trained on raw bytes of text (no tokenizer).

Run::

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_onebit_hook.py
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_onebit_hook.py --tiny

It prints the Trainer's losses and the bytes each rank sent (``thinwire.comm.accounting``)
against an fp32 allreduce on every step. Needs ``pip install 'thinwire[hf]'``.

Tuning: 1-bit gradients suit AdamW at moderate learning rates; if the loss stalls after
the warmup, lengthen ``--warmup-steps`` or lower the lr, or compress the momentum
instead (``hf_trainer_onebit_lamb.py``). Larger DDP buckets (``ddp_bucket_cap_mb``)
pay fewer latencies: every bucket costs three collectives here.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import tempfile
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from thinwire.comm.accounting import COUNTER
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook


def corpus(path: str | None) -> bytes:
    """Your text file, or the works of Shakespeare bundled with thinwire (public domain)."""
    if path:
        return Path(path).read_bytes()
    return gzip.decompress((resources.files("thinwire") / "data/shakespeare.txt.gz").read_bytes())


class ByteBlocks(torch.utils.data.Dataset):
    """Fixed-length blocks of raw bytes: a tokenizer-free language-modelling dataset."""

    def __init__(self, data: bytes, block: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.blocks = ids[: len(ids) // block * block].view(-1, block)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class OneBitCommHook(TrainerCallback):
    """Registers thinwire's 1-bit comm hook on the Trainer's DDP model before step 1."""

    def __init__(self, trainer: Trainer, state: OneBitHookState) -> None:
        self.trainer, self.state, self.done = trainer, state, False

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        wrapped = self.trainer.model_wrapped  # the outermost model: DDP when distributed
        if isinstance(wrapped, DDP) and not self.done:
            wrapped.register_comm_hook(self.state, onebit_hook)
            self.done = True


def replicas_identical(model: torch.nn.Module) -> bool:
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
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="Trainer output_dir (default: a temp dir)")
    ap.add_argument("--data", default=None, help="a text file (default: bundled Shakespeare)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    size = (
        dict(n_layer=1, n_embd=32, n_head=2) if args.tiny else dict(n_layer=4, n_embd=128, n_head=4)
    )
    steps = 12 if args.tiny else args.steps
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    if not 1 <= warmup <= steps:
        ap.error(
            f"--warmup-steps must be between 1 and the number of steps ({steps}), got {warmup}"
        )

    out = args.out or tempfile.mkdtemp(prefix="hf-onebit-hook-")
    targs = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=args.lr,
        logging_steps=max(1, steps // 6),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        # On a machine without GPUs accelerate joins the ranks only when told to use
        # the CPU (gloo); otherwise each rank silently trains alone.
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # GPT-2 uses every parameter
    )
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0, **size)
    model = GPT2LMHeadModel(cfg)
    data = ByteBlocks(corpus(args.data), block=64)

    # process_group=None: the default group, the one the Trainer's DDP uses.
    hook_state = OneBitHookState(process_group=None, warmup_steps=warmup)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.add_callback(OneBitCommHook(trainer, hook_state))
    result = trainer.train()
    same = replicas_identical(model)  # every rank must hold the same model

    onebit = wire_bytes("onebit.")
    fp32 = wire_bytes("ddp.allreduce")  # the hook's plain allreduce during its warmup
    per_fp32 = fp32 / warmup
    sent = fp32 + onebit
    every_step = per_fp32 * steps
    if trainer.is_world_process_zero():
        print(f"final training loss {result.training_loss:.4f} (mean over the run)")
        print(f"replicas identical: {same}")
        print(f"fp32 warmup, steps 1-{warmup}: {per_fp32:,.0f} bytes per step per rank")
        if steps > warmup:
            per_1bit = onebit / (steps - warmup)
            print(
                f"1-bit stage, steps {warmup + 1}-{steps}: {per_1bit:,.0f} bytes per step per "
                f"rank ({per_fp32 / max(per_1bit, 1):.1f}x fewer)"
            )
        print(
            f"bytes sent per rank: {sent:,} over {steps} steps on {targs.world_size} ranks; an "
            f"fp32 allreduce every step: {every_step:,.0f} ({every_step / max(sent, 1):.1f}x more)"
        )
        ops = ", ".join(f"{op} {s['wire_bytes']:,}" for op, s in COUNTER.snapshot().items())
        print(f"by collective: {ops}")
    if dist.is_initialized():
        # Free what sits in reference cycles while the group still exists: without this,
        # about 1 run in 10 aborted at exit ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
