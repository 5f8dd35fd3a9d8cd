"""``--algo diloco``: synchronous DiLoCo as a trainer :class:`~thinwire.train.algorithms.Strategy`.

Its own module, referenced by name from :data:`~thinwire.train.algorithms.ALGORITHMS`,
so choosing any other algorithm never imports the Local-SGD runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from thinwire.comm.launch import world_size
from thinwire.train.algorithms import Strategy
from thinwire.train.config import TrainConfig

__all__ = ["diloco_strategy"]


def diloco_strategy(model: nn.Module, cfg: TrainConfig, replicas: Any = None) -> Strategy:
    """Synchronous DiLoCo: raw model, inner AdamW, outer sync every H steps.

    Each rank trains on Local-SGD shards, on the shard and lr clock a sync-mode server
    would give it (:class:`thinwire.localsgd.algorithm.shards.SyncSchedule`), so this run and the
    simulator's ``sync`` method see the same data in the same order. With ``replicas``
    (``--shard-within``: FSDP2 inside islands, :mod:`thinwire.train.sharding`) an island
    is one DiLoCo worker whose ranks average their gradients every inner step, and the
    outer sync averages each rank's shard across the islands.
    """
    from thinwire.localsgd import DiLoCo
    from thinwire.localsgd.algorithm.methods import TUNED

    inner = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    momentum = cfg.outer_momentum
    outer = {
        "outer_lr": TUNED["sync"].outer_lr if cfg.outer_lr is None else cfg.outer_lr,
        "outer_momentum": TUNED["sync"].outer_momentum if momentum is None else momentum,
        "compress": cfg.compress,
        "sync_initial": False,  # the trainer broadcasts rank 0's weights before this
        **({} if replicas is None else {"process_group": replicas}),
    }
    if cfg.streaming():
        return _streaming(model, cfg, inner, outer)
    diloco = DiLoCo(
        model,
        inner,
        cfg.local_steps,
        inner_momentum=cfg.resolved_inner_momentum(),
        error_feedback=cfg.error_feedback,
        **outer,
    )
    batch, lr = _sync_data(cfg)
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


def _streaming(
    model: nn.Module, cfg: TrainConfig, inner: torch.optim.Optimizer, outer: dict[str, Any]
) -> Strategy:
    """Streaming DiLoCo (``--fragments``, ``--fragment-overlap``, a quantizer): the same
    data and inner schedule as DiLoCo. After the last step every fragment syncs once more
    (:meth:`~thinwire.localsgd.StreamingDiLoCo.finish`), so the run ends, as DiLoCo's
    does, on one model that every worker's last steps went into."""
    from thinwire.localsgd import StreamingDiLoCo

    streaming = StreamingDiLoCo(
        model,
        inner,
        cfg.local_steps,
        fragments=cfg.fragments,
        overlap=cfg.fragment_overlap,
        alpha=cfg.fragment_alpha,
        error_feedback=cfg.error_feedback,
        inner_momentum=cfg.inner_momentum or "keep",
        **outer,
    )

    def after_step(step: int) -> None:
        streaming.after_inner_step(step)
        if step == cfg.steps:
            streaming.finish()

    batch, lr = _sync_data(cfg)
    return Strategy(
        model=model,
        optimizer=inner,
        after_step=after_step,
        state_dict=streaming.state_dict,
        load_state_dict=streaming.load_state_dict,
        metrics=lambda: {"fragment_syncs": float(streaming.syncs)},
        batch=batch,
        lr_at=lr,
    )


def _sync_data(cfg: TrainConfig) -> tuple[Callable[[int], Any], Callable[[int], float]]:
    """This rank's batch and inner lr of a step, on the sync schedule's shards."""
    from thinwire.comm.launch import rank
    from thinwire.localsgd.algorithm.shards import SyncSchedule, inner_lr
    from thinwire.train.data import TextData

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

    return batch, lr
