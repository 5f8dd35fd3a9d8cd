"""One asynchronous Local-SGD run: :class:`AsyncConfig`, the
:class:`~thinwire.localsgd.settings.AsyncSettings` plus the run's budget, seed, start and
checkpoints. The multi-process runtime (:func:`thinwire.localsgd.run_async`), a
rejoining worker (:func:`thinwire.localsgd.rejoin_async`) and the simulator
(:func:`thinwire.localsgd.simulate`) all read this one config, so a setting means the
same everywhere and its default is written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import CODECS
from thinwire.localsgd.algorithm.pretrain import Start
from thinwire.localsgd.algorithm.push_guard import PushGuard
from thinwire.localsgd.settings import AsyncSettings

__all__ = ["COMPRESS", "AsyncConfig"]

COMPRESS: dict[str, torch.dtype] = CODECS
"""Payload dtype of each :attr:`AsyncConfig.compress` choice (uint8: 1-bit)."""


@dataclass
class AsyncConfig(AsyncSettings):
    """One asynchronous Local-SGD run: rank 0 serves, ranks 1..W train. Its settings are
    those of :class:`~thinwire.localsgd.settings.AsyncSettings` (and of
    :class:`~thinwire.localsgd.settings.LocalSGDSettings`) and the fields below.

    Step counts (``steps``, ``eval_interval``, ``checkpoint_interval``) are inner steps
    *per worker*; the server counts them summed over the W workers.
    """

    # --- budget, seed and the inner lr schedule ----------------------------------------
    steps: int = 300
    """Inner-step budget per worker. The run ends after ``steps * W`` inner steps, however
    they are spread over the workers: the same compute as synchronous DiLoCo's ``steps``."""
    seed: int = 0
    """Seeds the server's random choices (``paper`` shard sampling)."""
    warmup_steps: int = 20
    """Inner lr warmup, in steps of a shard's own clock. The inner optimizer's lr is the
    peak; it then decays by cosine over the shard's planned steps (``steps * W /
    shards``): check the warmup against that length if the loss stalls early."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``peak * min_lr_ratio``; the floor keeps rounds useful
    after a shard ran past its plan. ``warmup_steps=0, min_lr_ratio=1`` keeps the inner
    optimizer's lr constant."""
    grad_clip: float = 0.0
    """Clip each inner step's global gradient norm to this value; 0 disables clipping."""

    # --- where the run starts ----------------------------------------------------------
    pretrain_steps: int = 0
    """Steps of ordinary synchronous data-parallel training (over the W shards, inner
    optimizer and ``warmup_steps``) before Local-SGD begins; Local-SGD's shards then read
    on after them. The regime Local-SGD is for, and the asynchronous paper's: its methods
    start from 24k ordinary steps. 0: from scratch (or ``init_from``). See
    :mod:`thinwire.localsgd.algorithm.pretrain`."""
    init_from: str | None = None
    """Start from this model state file (``torch.save(model.state_dict())``, or a dict
    with it under ``"model"``) instead; not together with ``pretrain_steps``."""

    # --- workers of several ranks -----------------------------------------------------
    shard_within: int = 1
    """Ranks per worker. Above 1 each worker is an island of this many ranks joined by a
    fast network, its inner model sharded over them by FSDP2 (``Task.shard`` names the
    units), and only its first rank talks to the server: launch ``1 + W * shard_within``
    ranks. Take it when the model, its gradients and its inner optimizer's state do not
    fit one device; see :mod:`thinwire.localsgd.runtime.island` for what it does and does
    not do (a failed round ends the island; no rejoin)."""

    # --- evaluation and checkpoints ----------------------------------------------------
    eval_interval: int = 0
    """Inner steps per worker between evaluations on the server (0: only at the start and
    the end). The server answers no worker while it evaluates: keep evaluation cheap."""
    norm_batches: int = 16
    """Training batches the server runs through theta to recompute its normalization
    layers' running statistics (BatchNorm's ``running_mean``/``running_var``) before each
    evaluation and checkpoint and for the trained model: theta never runs a forward pass
    of its own, so without them it would keep a fresh model's. More batches, less noisy
    statistics, at one forward pass each on the server (which answers no worker
    meanwhile). Costs nothing for a model without such layers; 0 turns it off (with a
    warning). See :mod:`thinwire.localsgd.algorithm.norm_stats`."""
    checkpoint_dir: str | None = None
    """Where the server keeps ``localsgd_server.pt`` (theta, outer state, shard clocks,
    speeds); ``None``: no checkpoints."""
    checkpoint_interval: int = 0
    """Inner steps per worker between checkpoints (0: only at the end)."""
    resume: bool = False
    """Continue from ``checkpoint_dir``'s checkpoint, in a new server epoch: updates
    computed from the old server's theta are rejected."""
    stop_after: int | None = None
    """Stop this launch after this many inner steps per worker, with a checkpoint;
    ``resume`` continues to ``steps`` (the lr schedules are planned for ``steps``)."""

    def validate(self, workers: int | None = None, *, simulated: bool = False) -> None:
        """Raise a one-line :class:`ConfigError` for the first impossible setting.

        ``workers``: W when known (rank 0 serves, so W is the world size minus one);
        it bounds ``c`` and sizes ``slowdown``. ``simulated``: a run of the simulator,
        whose ``sync`` method may be Streaming DiLoCo (fragments, the quantizers).
        """
        if workers is not None and workers < 1:
            raise ConfigError(
                "asynchronous Local-SGD needs at least 2 ranks: rank 0 is the server, "
                "ranks 1.. are workers"
            )
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if not isinstance(self.shard_within, int) or self.shard_within < 1:
            raise ConfigError(f"shard_within must be an integer >= 1, got {self.shard_within!r}")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "norm_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        self.check_async(workers, simulated=simulated)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"grad_clip must be a finite number >= 0, got {self.grad_clip}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs the checkpoint_dir of the run to continue")
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"stop-after must be >= 1, got {self.stop_after}")
        if self.stop_after is not None and not self.checkpoint_dir:
            raise ConfigError("stop_after needs a checkpoint_dir to keep the run in")
        self.start()  # pretrain-steps and init-from

    def push_guard(self) -> PushGuard:
        """The server's checks of every push, with this config's bound and lr schedule."""
        return PushGuard(
            self.max_push_ratio,
            self.push_history,
            self.push_warmup,
            self.max_refused_pushes,
            lr_warmup=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def starts_trained(self) -> bool:
        """``pretrain_steps`` or ``init_from`` set (it picks the inner-state default)."""
        return not Start(pretrain_steps=self.pretrain_steps, init_from=self.init_from).from_scratch

    def start(self) -> Start:
        """Where this run starts (:class:`~thinwire.localsgd.algorithm.pretrain.Start`)."""
        return Start(
            pretrain_steps=self.pretrain_steps,
            init_from=self.init_from,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")
