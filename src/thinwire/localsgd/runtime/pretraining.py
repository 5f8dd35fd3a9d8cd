"""An asynchronous run's pretraining, kept as it goes so that a stop in it is not lost.

A run that starts from N steps of ordinary training (``pretrain_steps``) spends them
before the server's first checkpoint; the paper's setting is 24k of them. With a
``checkpoint_dir`` the server keeps that pretraining in
``checkpoint_dir/localsgd_pretrain.pt`` (the model, the inner optimizer, the step and the
random generators) every ``checkpoint_interval`` pretraining steps, and after its last
step (with ``checkpoint_interval=0``: after its last step only). ``resume`` on a run that
stopped there goes on from that save, and the pretraining ends with the very weights an
unstopped one reaches; once the server's own checkpoint lands the file goes.

Every rank runs a pretraining at once (see :func:`start_run`), so rank 0 tells the
others where its own resumes: a worker then trains only the steps that are left, and
every rank reaches the rendezvous at about the same time, as in an unstopped run.

A save of other settings (steps, shards, warmup, clip, seed or model), or a damaged
one, is said in one line on a resume, removed, and the pretraining starts over (the
task's data and lr are not in the save: ``thinwire train`` checks the run's identity,
its data included, against ``run.json`` before it goes on, and an lr may change on a
resume, as on every resume); a fresh run (no ``resume``) into a directory
that holds one is refused in one line, as one into a directory holding a server
checkpoint is: nothing is overwritten.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.pretrain import Start
from thinwire.localsgd.algorithm.sim_checkpoint import SimCheckpoint
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.runtime.server_process import (
    PRETRAIN_CHECKPOINT,
    SERVER_CHECKPOINT,
    refuse_existing,
)
from thinwire.localsgd.task import Task

__all__ = ["pretraining_checkpoint", "start_run"]


def pretraining_checkpoint(cfg: AsyncConfig) -> SimCheckpoint | None:
    """Where rank 0 keeps ``cfg``'s pretraining as it goes (None: the run has no
    ``checkpoint_dir`` or no pretraining)."""
    if not cfg.checkpoint_dir or not cfg.pretrain_steps:
        return None
    return SimCheckpoint(
        Path(cfg.checkpoint_dir) / PRETRAIN_CHECKPOINT,
        every_s=math.inf,  # saved by step count (save_every), not by the clock
        tag=f"asynchronous Local-SGD pretraining, seed {cfg.seed}",
    )


def start_run(task: Task, cfg: AsyncConfig, rank: int, workers: int) -> tuple[Task, AsyncConfig]:
    """``task`` from where ``cfg`` starts, on rank ``rank`` (collective on the launch's
    group when the run pretrains into a ``checkpoint_dir``); and ``cfg`` as the run
    goes on: a ``resume`` that finds only a pretraining save is a fresh run whose
    pretraining goes on from it.

    Every rank runs a pretraining, at once: only the server's weights become theta
    (workers pull theirs), but ranks that waited for it would wait at the transport's
    rendezvous, whose timeout is not the pretraining's length. A start file is read by
    the server alone (workers on other hosts need not hold it); a resumed run takes
    theta from its checkpoint and only reads the data on after the pretraining.
    """
    start = cfg.start()
    ckpt = pretraining_checkpoint(cfg)
    if ckpt is None:
        if cfg.resume or (rank != 0 and not start.pretrain_steps):
            return start.continued(task), cfg
        return start.apply(task, cfg.resolved_shards(workers)), cfg
    shards = cfg.resolved_shards(workers)
    resume, first = _agree(rank, lambda: _decide(cfg, ckpt, start, shards, task))
    cfg = replace(cfg, resume=resume)
    if resume:
        return start.continued(task), cfg
    if rank != 0 and first:  # the steps rank 0 has left, on weights no one reads
        if first < start.pretrain_steps:
            replace(start, pretrain_steps=start.pretrain_steps - first).pretrained(task, shards)
        return start.continued(task), cfg
    if rank != 0:  # the whole pretraining, as rank 0's (its buffers: the model's own)
        return start.apply(task, shards), cfg
    save_every = cfg.checkpoint_interval or start.pretrain_steps
    state = start.pretrained(task, shards, checkpoint=ckpt, save_every=save_every)
    return start.apply(task, shards, state=state), cfg


def _agree(rank: int, decide: Callable[[], tuple[bool, int]]) -> tuple[bool, int]:
    """Rank 0 decides (``decide()``: whether the run resumes from the server's checkpoint,
    and the pretraining step it starts at); every rank learns it. A failure is raised on
    every rank, so none is left waiting. Sent on a gloo group (the launch's when it is
    gloo, else one of its own): the decision is a CPU tensor, and NCCL takes none."""
    decision = torch.zeros(3, dtype=torch.int64)  # ok, resume, first step
    error: BaseException | None = None
    if rank == 0:
        try:
            resume, first = decide()
            decision[:] = torch.tensor([1, int(resume), first])
        except Exception as exc:  # any: told to every rank, then raised here
            error = exc
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.broadcast(decision, src=0, group=group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    if error is not None:
        raise error
    if decision[0].item() != 1:
        raise ConfigError("rank 0 could not start the run (see its error)")
    return bool(decision[1].item()), int(decision[2].item())


def _decide(
    cfg: AsyncConfig, ckpt: SimCheckpoint, start: Start, shards: int, task: Task
) -> tuple[bool, int]:
    """Rank 0: ``(resume from the server's checkpoint, pretraining step to start at)``."""
    server = ckpt.path.parent / SERVER_CHECKPOINT
    if cfg.resume and server.exists():
        return True, 0
    if not cfg.resume:  # said before the pretraining, not after it
        refuse_existing(server)
        refuse_existing(ckpt.path)
        return False, 0
    if not ckpt.path.exists():
        return True, 0  # nothing to resume: the server says so, as ever
    first = start.saved_step(ckpt, shards, task.model())
    total = start.pretrain_steps
    if first == total:
        _say(f"the pretraining was done: its weights come from {ckpt.path}")
    elif first:
        _say(f"the pretraining goes on from {ckpt.path} at step {first:,} of {total:,}")
    else:  # removed, so that the pretraining does not read it again
        _say(
            f"warning: {ckpt.path} is not this run's pretraining (other steps, shards, "
            f"warmup, clip, seed or model, or damaged); it is removed and the pretraining "
            f"({total:,} steps) starts over"
        )
        ckpt.discard()
    return False, first


def _say(line: str) -> None:
    print(f"thinwire: {line}", file=sys.stderr, flush=True)
