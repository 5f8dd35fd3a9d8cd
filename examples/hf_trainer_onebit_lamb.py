"""Hugging Face ``transformers.Trainer`` + thinwire's 1-bit LAMB, under torchrun.

What it shows: a GPT-2 built from a ``GPT2Config`` (random init, nothing downloaded)
trained by the stock ``Trainer`` on raw bytes of text (no tokenizer), with
``thinwire.optim.OneBitLamb`` as its optimizer. Three things make it right:

1. The optimizer is created after ``TrainingArguments``: building the arguments sets up
   the process group (through accelerate), and the optimizer needs it to broadcast
   rank 0's parameters. The model is moved to ``args.device`` first, so the optimizer
   holds the parameters the Trainer will train.
2. The Trainer wraps the model in DDP only inside ``train()``. A ``TrainerCallback``
   registers the optimizer with that DDP model at ``on_train_begin`` (before the first
   backward): DDP then averages the gradients only during the optimizer's fp32 warmup,
   and the optimizer does not average them again.
3. ``max_grad_norm=0``: after the freeze the gradients are each rank's own, and clipping
   them would scale every rank differently; LAMB's trust ratio already bounds each
   layer's step.

Run::

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_onebit_lamb.py
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_onebit_lamb.py --tiny

It prints the Trainer's losses and the bytes each rank sent (``thinwire.comm.accounting``)
against an fp32 gradient allreduce on every step. Needs ``pip install 'thinwire[hf]'``.
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
from thinwire.optim import OneBitLamb


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


class RegisterWithDDP(TrainerCallback):
    """Hands the Trainer's DDP model to a thinwire optimizer before the first step."""

    def __init__(self, trainer: Trainer, optimizer: OneBitLamb) -> None:
        self.trainer, self.optimizer, self.done = trainer, optimizer, False

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        wrapped = self.trainer.model_wrapped  # the outermost model: DDP when distributed
        if isinstance(wrapped, DDP) and not self.done:
            self.optimizer.register_ddp(wrapped)
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
    ap.add_argument("--freeze-step", type=int, default=None, help="default: 20%% of --steps")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default=None, help="Trainer output_dir (default: a temp dir)")
    ap.add_argument("--data", default=None, help="a text file (default: bundled Shakespeare)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: for tests")
    args = ap.parse_args()
    size = (
        dict(n_layer=1, n_embd=32, n_head=2) if args.tiny else dict(n_layer=4, n_embd=128, n_head=4)
    )
    steps = 12 if args.tiny else args.steps
    freeze = args.freeze_step if args.freeze_step is not None else max(1, steps // 5)
    if not 1 <= freeze <= steps:
        ap.error(f"--freeze-step must be between 1 and the number of steps ({steps}), got {freeze}")

    out = args.out or tempfile.mkdtemp(prefix="hf-onebit-lamb-")
    targs = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
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
    # The process group exists now (TrainingArguments set it up).
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0, **size)
    model = GPT2LMHeadModel(cfg).to(targs.device)
    opt = OneBitLamb(model.parameters(), lr=args.lr, freeze_step=freeze, bias_correction=True)
    after_setup = wire_bytes()  # the optimizer's start-up broadcast is not per step

    data = ByteBlocks(corpus(args.data), block=64)
    trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, None))
    trainer.add_callback(RegisterWithDDP(trainer, opt))
    result = trainer.train()
    same = replicas_identical(model)  # every rank must hold the same model

    onebit = wire_bytes("onebit.")
    fp32 = wire_bytes() - after_setup - onebit
    per_fp32 = fp32 / freeze
    sent = fp32 + onebit
    every_step = per_fp32 * steps
    if trainer.is_world_process_zero():
        print(f"final training loss {result.training_loss:.4f} (mean over the run)")
        print(f"replicas identical: {same}")
        print(f"fp32 warmup, steps 1-{freeze}: {per_fp32:,.0f} bytes per step per rank")
        if steps > freeze:
            per_1bit = onebit / (steps - freeze)
            print(
                f"1-bit stage, steps {freeze + 1}-{steps}: {per_1bit:,.0f} bytes per step per "
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
