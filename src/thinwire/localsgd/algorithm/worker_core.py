"""One Local-SGD worker: pull theta, run H inner steps on a data shard, push theta - theta_w.

:class:`LocalWorker` is transport-free; the multi-process runtime and the simulator both
drive it. It trains the user's model with the user's inner optimizer and loss on the
user's batch sources (:class:`~thinwire.localsgd.task.Task`). What its inner optimizer
state carries from one round into the next is the run's inner-state rule
(:mod:`thinwire.localsgd.algorithm.inner_state`); every round starts by loading the pulled theta
into the model.

The inner lr follows the shard's own clock (:func:`~thinwire.localsgd.algorithm.shards.inner_lr`)
with the optimizer's initial lr of each parameter group as the peak. Batches come from
``source(clock)`` of the shard the server assigned, so a run is as reproducible as the
user's batch sources are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from thinwire.localsgd.algorithm.inner_state import DEFAULT_INNER_STATE, InnerStateRule
from thinwire.localsgd.algorithm.island_params import gather_difference, scatter_theta_
from thinwire.localsgd.algorithm.shards import inner_lr
from thinwire.localsgd.messages import Work
from thinwire.localsgd.task import BatchSource, batch_part, load_flat_, to_device

__all__ = ["IslandPart", "LocalWorker", "RoundResult", "load_flat_"]


@dataclass
class RoundResult:
    """A finished round: the pseudo-gradient and what the server needs to know."""

    pseudo_grad: torch.Tensor | None
    """``theta - theta_w``; None on an island's ranks other than its leader."""
    steps: int
    seconds_per_step: float
    loss: float


@dataclass(frozen=True)
class IslandPart:
    """This rank's place in a worker that is an island of ranks (FSDP2 inside it): it
    trains on part ``index`` of ``parts`` of every batch, and the round's loss is
    averaged over ``group``, the island's process group."""

    index: int = 0
    parts: int = 1
    group: dist.ProcessGroup | None = None


class LocalWorker:
    """A model replica with its own inner optimizer.

    Args:
        model: this worker's replica (its values are overwritten by every pulled theta).
        optimizer: ``optimizer(params)`` builds the inner optimizer (again by :meth:`reset`).
        shards: the batch sources, indexed like the server's shard book.
        loss: ``loss(model, batch)``, the scalar to backpropagate.
        warmup_steps, min_lr_ratio: the per-shard inner schedule (see :func:`inner_lr`).
        grad_clip: global norm clip, 0 disables.
        slowdown: multiply each step's time by this factor by sleeping, to emulate slower
            hardware on one machine (1.0 = no slowdown).
        inner_momentum: the inner-state rule, ``keep``, ``round``, ``restart`` or
            ``fresh`` (see :mod:`thinwire.localsgd.algorithm.inner_state`).
        part: this rank's part of an island's batches (a model sharded by FSDP2 over
            the island); ``None``: a whole worker.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        shards: Sequence[BatchSource],
        loss: Callable[[nn.Module, Any], torch.Tensor],
        *,
        warmup_steps: int,
        min_lr_ratio: float,
        grad_clip: float = 0.0,
        slowdown: float = 1.0,
        inner_momentum: str = DEFAULT_INNER_STATE,
        part: IslandPart | None = None,
    ) -> None:
        self.rule = InnerStateRule(inner_momentum)
        self.model = model
        self.params = list(model.parameters())
        self.device = self.params[0].device
        self.shards = shards
        self.loss = loss
        self.warmup, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.grad_clip = grad_clip
        self.slowdown = slowdown
        self.inner_momentum = inner_momentum
        self.part = part or IslandPart()
        self._make_optimizer = optimizer
        self.reset()

    def reset(self) -> None:
        """Fresh inner optimizer state (after a failed round left it inconsistent)."""
        self.opt = self._make_optimizer(self.params)
        # The factory's lr is the peak of every shard's schedule.
        self.peak_lrs = [float(g["lr"]) for g in self.opt.param_groups]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def batch(self, shard: int, clock: int) -> Any:
        """The batch of inner step ``clock`` of ``shard``, on this worker's device."""
        whole = self.shards[shard](clock)
        return to_device(batch_part(whole, self.part.index, self.part.parts), self.device)

    def run_round(self, theta: torch.Tensor | None, work: Work) -> RoundResult:
        """Load ``theta``, run ``work.steps`` inner steps, return ``theta - theta_w``.

        On an island (a model sharded by FSDP2) the leader passes theta and gets the
        pseudo-gradient back; the others pass None and get None: they receive only their
        shards of theta and give theirs to the gathered whole."""
        if theta is not None:
            theta = theta.to(self.device, torch.float32)
        self._load(theta)
        self.rule.begin_round(self.opt)
        self.model.train()
        total_loss = 0.0
        step_times: list[float] = []
        for i in range(work.steps):
            t_step = time.perf_counter()
            clock = work.lr_clock + i
            for group, peak in zip(self.opt.param_groups, self.peak_lrs, strict=True):
                group["lr"] = inner_lr(clock, work.planned, peak, self.warmup, self.min_lr_ratio)
            loss = self.loss(self.model, self.batch(work.shard, clock))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.rule.before_step(self.opt)
            self.opt.step()
            self.rule.after_step(self.opt)
            total_loss += float(loss.detach())
            if self.slowdown > 1.0:
                # Emulated slower hardware: stretch this step to slowdown x its real time.
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t_step))
            step_times.append(time.perf_counter() - t_step)
        with torch.no_grad():
            pseudo = self._difference(theta)
        steps = max(1, work.steps)
        if self.part.group is not None:  # the island's loss, not this rank's part's
            total = torch.tensor([total_loss / self.part.parts], device=self.device)
            dist.all_reduce(total, group=self.part.group)
            total_loss = float(total)
        # The median, not the mean: a round's first step pays one-off costs (allocations,
        # a cold cache) that would make a short calibration round look slow to DyLU.
        return RoundResult(pseudo, work.steps, _median(step_times), total_loss / steps)

    def _load(self, theta: torch.Tensor | None) -> None:
        part = self.part
        if part.group is None:
            assert theta is not None  # a whole worker always pulls theta
            load_flat_(self.params, theta)
        else:  # each rank of the island its own shards, from the leader's theta
            scatter_theta_(self.params, theta, part.group, part.index, part.parts)

    def _difference(self, theta: torch.Tensor | None) -> torch.Tensor | None:
        part = self.part
        if part.group is None:
            assert theta is not None
            return theta - parameters_to_vector(self.params).float()
        return gather_difference(self.params, theta, part.group, part.index, part.parts)


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
