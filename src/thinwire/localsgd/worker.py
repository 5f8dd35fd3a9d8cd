"""One Local-SGD worker: pull theta, run H inner AdamW steps on a data shard, push theta - theta_w.

:class:`LocalWorker` is transport-free; the multi-process runtime and the simulator both
drive it. Its inner optimizer state persists across rounds (DiLoCo keeps each worker's
AdamW moments local), except the first moment with ``inner_momentum="round"``, which
restarts at every round (see :mod:`thinwire.localsgd.inner_state`); every round starts by
loading the pulled theta into the model.

Batches depend only on ``(seed, shard, shard clock)``, never on which worker runs them,
so a run is reproducible and a shard that changes hands continues the same data stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from thinwire.localsgd.inner_state import check_inner_momentum, restart_first_moment_
from thinwire.localsgd.server import Work
from thinwire.localsgd.shards import inner_lr
from thinwire.train.data import TokenSplit

__all__ = ["LocalWorker", "RoundResult", "load_flat_"]


@torch.no_grad()
def load_flat_(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into ``params`` (``vector_to_parameters`` would make them views
    of ``flat``, so training would silently modify the pulled theta)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n


@dataclass
class RoundResult:
    """A finished round: the pseudo-gradient and what the server needs to know."""

    pseudo_grad: torch.Tensor
    steps: int
    seconds_per_step: float
    loss: float


class LocalWorker:
    """A model replica with its own inner AdamW.

    Args:
        model: this worker's replica (its values are overwritten by every pulled theta).
        shards: the data shards, indexed like the server's shard book.
        seq_len, batch_size: window length and windows per inner step.
        lr, warmup_steps, min_lr_ratio: the per-shard inner schedule (see :func:`inner_lr`).
        betas, weight_decay: AdamW settings. grad_clip: global norm clip, 0 disables.
        seed: data seed. slowdown: multiply each step's time by this factor by sleeping,
            to emulate slower hardware on one machine (1.0 = no slowdown).
        inner_momentum: ``"keep"`` (DiLoCo: the AdamW first moment persists across rounds)
            or ``"round"`` (it restarts at the start of every round; second moment and
            step count are kept). Use ``"round"`` when rounds are short (DyLU with a
            small H); runs resolve the default with
            :func:`~thinwire.localsgd.inner_state.resolve_inner_momentum`.
    """

    def __init__(
        self,
        model: nn.Module,
        shards: list[TokenSplit],
        *,
        seq_len: int,
        batch_size: int,
        lr: float,
        warmup_steps: int,
        min_lr_ratio: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.01,
        grad_clip: float = 0.0,
        seed: int = 0,
        slowdown: float = 1.0,
        inner_momentum: str = "keep",
    ) -> None:
        check_inner_momentum(inner_momentum)
        self.model = model
        self.params = list(model.parameters())
        self.device = self.params[0].device
        self.shards = shards
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.lr, self.warmup, self.min_lr_ratio = lr, warmup_steps, min_lr_ratio
        self.grad_clip = grad_clip
        self.seed = seed
        self.slowdown = slowdown
        self.inner_momentum = inner_momentum
        self._adamw = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self.opt = torch.optim.AdamW(self.params, **self._adamw)

    def reset(self) -> None:
        """Fresh inner optimizer state (after a failed round left it inconsistent)."""
        self.opt = torch.optim.AdamW(self.params, **self._adamw)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def batch(self, shard: int, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
        split = self.shards[shard]
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + shard) * 1_000_003 + clock)
        starts = torch.randint(split.num_windows(self.seq_len), (self.batch_size,), generator=g)
        x, y = split.windows(starts, self.seq_len)
        return x.to(self.device), y.to(self.device)

    def run_round(self, theta: torch.Tensor, work: Work) -> RoundResult:
        """Load ``theta``, run ``work.steps`` inner steps, return ``theta - theta_w``."""
        theta = theta.to(self.device, torch.float32)
        load_flat_(self.params, theta)
        if self.inner_momentum == "round":
            # A few-step round would otherwise mostly replay momentum built from gradients
            # at global parameters that outer updates have since moved past.
            restart_first_moment_(self.opt)
        self.model.train()
        total_loss = 0.0
        t0 = time.perf_counter()
        for i in range(work.steps):
            t_step = time.perf_counter()
            clock = work.lr_clock + i
            for group in self.opt.param_groups:
                group["lr"] = inner_lr(clock, work.planned, self.lr, self.warmup, self.min_lr_ratio)
            x, y = self.batch(work.shard, clock)
            _, loss = self.model(x, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.opt.step()
            total_loss += float(loss.detach())
            if self.slowdown > 1.0:
                # Emulated slower hardware: stretch this step to slowdown x its real time.
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t_step))
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            pseudo = theta - parameters_to_vector(self.params).float()
        steps = max(1, work.steps)
        return RoundResult(pseudo, work.steps, elapsed / steps, total_loss / steps)
