"""Where a run of the example trainer starts: from scratch, from a model file, or after
N steps of ordinary training.

Compression and Local-SGD are methods for the long middle of a training run, and both
behave differently there than from random weights: 1-bit LAMB's automatic freeze reads
Adam's second moment, which settles far sooner once the loss has stopped falling fast,
and DiLoCo's outer momentum was tuned on a pretrained model. ``--pretrain-steps N`` (or
``TrainConfig.pretrain_steps``) puts a run there::

    thinwire train --algo onebit-lamb --pretrain-steps 1000 --steps 3000
    thinwire train --algo diloco --init-from base.pt

* ``pretrain_steps=N``: ``N`` steps of ordinary data-parallel AdamW on this run's ranks,
  at AdamW's tuned peak lr (:data:`~thinwire.train.algorithms.DEFAULT_LR`, whatever
  ``--lr`` the algorithm trains at, so that every algorithm of a comparison starts from
  the same weights), the run's betas, weight decay and gradient clip, the learning rate
  warming up over ``--warmup-steps`` and then held at its peak. The run's own algorithm
  then starts
  on those weights with a fresh optimizer and its own warmup and schedule, and reads the
  training stream on from step ``N``: no batch of the pretraining comes back as new.
  The pretraining's bytes are not counted in the run's (it is the same for every
  algorithm compared).
* ``init_from=PATH``: a file holding the model's ``state_dict``, or a dict with it
  under ``"model"`` (a checkpoint's ``model.pt`` or the simulator's cached start), read
  on rank 0 alone (on several machines only the first needs it) and checked against
  the model's names and shapes in one line before the run writes anything.

Only a fresh run starts: a resumed run's weights come from its checkpoint, so the start
is part of the run's identity (``run.json``). A run stopped in its pretraining, or
before its first checkpoint, goes on from the pretraining's last save
(:mod:`thinwire.train.pretrain_checkpoint`). The summary's ``"start"`` says which start
a run used.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.allreduce import sum_small_
from thinwire.comm.launch import rank as get_rank
from thinwire.comm.launch import world_size as get_world_size
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.pretrain import Start, load_start_state
from thinwire.train import pretrain_checkpoint as saves
from thinwire.train.algorithms import default_lr
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import Progress

__all__ = ["data_offset", "read_start_file", "run_start", "start_of"]


def start_of(cfg: TrainConfig) -> Start:
    """The run's start, checked (a one-line ConfigError for a bad combination)."""
    return Start(
        pretrain_steps=cfg.pretrain_steps or 0,
        init_from=cfg.init_from,
        warmup_steps=cfg.warmup_steps,
        grad_clip=cfg.grad_clip,
    )


def data_offset(cfg: TrainConfig) -> int:
    """Training-stream steps the start used: the run reads its step ``s`` at ``s + this``."""
    return cfg.pretrain_steps or 0


def read_start_file(cfg: TrainConfig, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Rank 0 reads and checks ``cfg.init_from`` against ``model``; every rank learns of
    an error (one line, raised everywhere, so no rank is left waiting). The weights on
    rank 0, None elsewhere and without a file. Called before the run claims its output
    directory's identity, so a wrong path leaves nothing behind to ``--resume``."""
    if cfg.init_from is None:
        return None
    state, error = None, None
    if get_rank() == 0:
        try:
            state = load_start_state(Path(cfg.init_from), model)
        except ConfigError as exc:
            error = str(exc)
    if get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return state


def run_start(
    model: nn.Module,
    data: TextData,
    cfg: TrainConfig,
    device: torch.device,
    state: dict[str, torch.Tensor] | None = None,
    run_id: str | None = None,
) -> str:
    """Bring ``model`` (fresh, the same on every rank) to the run's start; returns
    :meth:`Start.describe`. Call on every rank of the group, before the algorithm wraps
    the model; the trainer then broadcasts rank 0's weights. ``state``: what
    :func:`read_start_file` read before the run's identity was written (a fresh run);
    a resumed run that had not saved a checkpoint yet reads the file here, or goes on
    from its pretraining's last save (``run_id``: the run's, which the saves carry)."""
    start = start_of(cfg)
    if start.init_from is not None:
        if cfg.resume:  # the same on every rank: all of them take part in the read
            state = read_start_file(cfg, model)
        if state is not None:  # rank 0; the others receive its weights
            model.load_state_dict(state)
    elif start.pretrain_steps:
        _pretrain(model, data, cfg, start, device, run_id)
    return start.describe()


def _pretrain(
    model: nn.Module,
    data: TextData,
    cfg: TrainConfig,
    start: Start,
    device: torch.device,
    run_id: str | None,
) -> None:
    rank, world = get_rank(), get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    peak = default_lr("adamw")
    opt = torch.optim.AdamW(params, lr=peak, betas=cfg.betas, weight_decay=cfg.weight_decay)
    out_dir, steps = Path(cfg.out_dir), start.pretrain_steps
    # What the pretraining trains with beyond the run's identity: a save must match it.
    settings = {
        "warmup_steps": start.warmup_steps,
        "grad_clip": start.grad_clip,
        "lr": peak,
        "betas": list(cfg.betas),
        "weight_decay": cfg.weight_decay,
        "world": world,
    }
    # A resumed run that stopped in its pretraining goes on from the last save.
    first, last = (0, 0.0)
    if cfg.resume:
        first, last = saves.resume(out_dir, run_id, steps, settings, model, opt)
    bar = Progress(steps, first, cfg.progress and rank == 0, desc="pretraining")
    loss = torch.tensor(last)  # the loss of the last step taken, here or before the stop
    try:
        for step in range(first, steps):
            ramp = (step + 1) / start.warmup_steps if step < start.warmup_steps else 1.0
            for group in opt.param_groups:
                group["lr"] = peak * ramp
            x, y = data.batch(step, cfg.batch_size, rank, world)
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            _average_gradients(params, world)
            if start.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), start.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if _due(step + 1, steps, cfg.checkpoint_interval):
                mean = _mean(loss, world)  # every rank: the save's loss is the ranks' mean
                if rank == 0:
                    saves.save(out_dir, step + 1, run_id, settings, model, opt, mean)
            bar.update(1, loss=f"{float(loss.detach()):.3f}")
    finally:
        bar.close()
    # Every rank learns a divergence, so none is left waiting; resumed at the end, each
    # holds the saved mean already.
    final = _mean(loss, world) if first < steps else last
    if not math.isfinite(final):
        raise ConfigError(
            f"pretraining diverged within its {start.pretrain_steps} steps (loss "
            f"{final}): raise --warmup-steps or set --grad-clip"
        )
    if rank == 0:
        print(
            f"thinwire: {cfg.algo} starts {start.describe()} (AdamW, final loss {final:.3f})",
            file=sys.stderr,
            flush=True,
        )


def _mean(loss: torch.Tensor, world: int) -> float:
    """The ranks' mean of this step's ``loss``; call on every rank."""
    total = loss.detach().float().cpu().view(1)
    if world > 1:
        sum_small_(total, op_name="trainer.pretrain_loss")  # a trainer op: not the job's bytes
    return float(total[0]) / world


def _due(done: int, steps: int, interval: int) -> bool:
    """A save after ``done`` pretraining steps: every ``interval`` steps and at the end
    (``interval`` 0: the end alone, as the run's own checkpoints)."""
    return done == steps or (interval > 0 and done % interval == 0)


def _average_gradients(params: list[nn.Parameter], world: int) -> None:
    """What DDP does, in one flat allreduce: no DDP wrapper is left hooked on the model
    when the algorithm wraps it afterwards."""
    if world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
