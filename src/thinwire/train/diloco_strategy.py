"""``--algo diloco``: synchronous DiLoCo as a trainer :class:`~thinwire.train.algorithms.Strategy`.

Its own module, referenced by name from :data:`~thinwire.train.algorithms.ALGORITHMS`,
so choosing any other algorithm never imports the Local-SGD runtime.
"""

from __future__ import annotations

import torch
from torch import nn

from thinwire.comm.launch import world_size
from thinwire.train.algorithms import Strategy
from thinwire.train.config import TrainConfig

__all__ = ["diloco_strategy"]


def diloco_strategy(model: nn.Module, cfg: TrainConfig) -> Strategy:
    """Synchronous DiLoCo: raw model, inner AdamW, outer sync every H steps.

    Each rank trains on Local-SGD shards, on the shard and lr clock a sync-mode server
    would give it (:class:`thinwire.localsgd.algorithm.shards.SyncSchedule`), so this run and the
    simulator's ``sync`` method see the same data in the same order.
    """
    from thinwire.comm.launch import rank
    from thinwire.localsgd import DiLoCo
    from thinwire.localsgd.algorithm.inner_state import resolve_inner_momentum
    from thinwire.localsgd.algorithm.methods import TUNED
    from thinwire.localsgd.algorithm.shards import SyncSchedule, inner_lr
    from thinwire.train.data import TextData

    inner = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    momentum = cfg.outer_momentum
    diloco = DiLoCo(
        model,
        inner,
        cfg.local_steps,
        outer_lr=TUNED["sync"].outer_lr if cfg.outer_lr is None else cfg.outer_lr,
        outer_momentum=TUNED["sync"].outer_momentum if momentum is None else momentum,
        compress=cfg.compress,
        sync_initial=False,  # the trainer broadcasts rank 0's weights before this
        inner_momentum=resolve_inner_momentum(cfg.inner_momentum),
    )
    world = world_size()
    data = TextData(cfg.data, cfg.gpt_config().seq_len, cfg.val_fraction, cfg.seed)
    sources = data.shard_batches(world, cfg.batch_size, cfg.shard_layout)
    plan = SyncSchedule(
        [len(s) for s in sources],
        world,
        cfg.local_steps,
        cfg.steps,
        cfg.shard_sampling or "least-progress",
        cfg.seed,
    )
    me = rank() + 1

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, clock = plan.at(me, step)
        return sources[shard](clock)

    def lr(step: int) -> float:
        shard, clock = plan.at(me, step)
        planned = plan.book.planned[shard]
        return inner_lr(clock, planned, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)

    return Strategy(
        model=model,
        optimizer=inner,
        after_step=lambda step: diloco.after_inner_step(step),
        state_dict=diloco.state_dict,
        load_state_dict=diloco.load_state_dict,
        metrics=lambda: {"outer_steps": float(diloco.outer_steps)},
        batch=batch,
        lr_at=lr,
    )
