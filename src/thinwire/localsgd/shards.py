"""Data shards for Local-SGD workers: least-progress selection and per-shard lr clocks.

The training split is cut into ``n`` contiguous shards. Each shard has a planned number
of inner steps (the run's inner-step budget shared in proportion to shard size) and a
clock counting the inner steps spent on it. When a worker needs work it takes the free
shard with the least progress ``clock / planned`` (the paper's rule), and the shard of a
dead worker is picked up by the next free worker.

A shard is held by one worker at a time, so with as many shards as workers (the
runtime's default) a returning worker's only free shard is the one it just returned:
each worker keeps its shard, and a fast worker's shard runs past its plan (at the
floor lr) while a slow worker's stays short of it. Measured at the paper's toy speeds
(0.58 / 0.75 / 1.51 / 3.33 s per step, 200 planned steps per shard) the shards end at
340 / 267 / 133 / 60 steps, with or without DyLU. Give the run more shards than
workers (``--shards``) for the least-progress rule to balance them: with 4 per worker
every shard ended within 47-55 of its 50 planned steps, and Delayed Nesterov without
DyLU ended at a 7% lower loss (docs/benchmarks.md).

The inner learning rate follows the *shard's* clock: linear warmup, then cosine decay to
a floor ``min_lr_ratio * lr``. A worker that changes shard continues that shard's
schedule, so every shard is trained with one warmup and one decay no matter who works
on it. The floor keeps late rounds useful when DyLU or a dead worker makes a shard run
past its plan.
"""

from __future__ import annotations

import math
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["ShardBook", "inner_lr"]


def inner_lr(clock: int, planned: int, lr: float, warmup: int, min_lr_ratio: float) -> float:
    """Warmup+cosine learning rate at step ``clock`` of a shard planned for ``planned`` steps."""
    floor = lr * min_lr_ratio
    if warmup > 0 and clock < warmup:
        return lr * (clock + 1) / warmup
    span = max(1, planned - warmup)
    progress = min(1.0, (clock - warmup) / span)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


class ShardBook:
    """Which worker holds which shard, and each shard's lr clock.

    Args:
        sizes: tokens per shard (only the proportions matter).
        total_steps: inner-step budget of the whole run, shared among the shards.
    """

    def __init__(self, sizes: list[int], total_steps: int) -> None:
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"shards must be non-empty, got sizes {sizes}")
        total = sum(sizes)
        self.planned = [max(1, round(total_steps * s / total)) for s in sizes]
        self.clock = [0] * len(sizes)
        self.holder: list[int | None] = [None] * len(sizes)
        self._reserved: dict[int, tuple[int, int]] = {}  # worker -> (shard, steps)

    def __len__(self) -> int:
        return len(self.planned)

    def progress(self, shard: int) -> float:
        return self.clock[shard] / self.planned[shard]

    def take(self, worker: int, steps: int) -> tuple[int, int]:
        """Give ``worker`` the free shard with least progress; returns ``(shard, lr_clock)``.

        The shard's clock is advanced by ``steps`` now, so the next worker on this shard
        continues the schedule where this round will end.
        """
        self.release(worker)
        free = [i for i, h in enumerate(self.holder) if h is None]
        candidates = free or list(range(len(self.planned)))  # more workers than shards
        shard = min(candidates, key=lambda i: (self.progress(i), i))
        start = self.clock[shard]
        self.clock[shard] += steps
        self.holder[shard] = worker
        self._reserved[worker] = (shard, steps)
        return shard, start

    def release(self, worker: int, completed: bool = True) -> None:
        """``worker`` returned its round (or died: ``completed=False`` rewinds the clock)."""
        res = self._reserved.pop(worker, None)
        if res is None:
            return
        shard, steps = res
        if self.holder[shard] == worker:
            self.holder[shard] = None
        if not completed:
            self.clock[shard] = max(0, self.clock[shard] - steps)

    def state_dict(self) -> dict[str, Any]:
        # Rounds in flight are not saved: a restored server never applies them (they are
        # rejected as stale), so their steps are rewound.
        clock = list(self.clock)
        for shard, steps in self._reserved.values():
            clock[shard] = max(0, clock[shard] - steps)
        return {"planned": list(self.planned), "clock": clock}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["planned"]) != len(self.planned):
            raise ConfigError(
                f"checkpoint has {len(state['planned'])} shards, this run has {len(self.planned)}"
            )
        self.planned = [int(x) for x in state["planned"]]
        self.clock = [int(x) for x in state["clock"]]
        self.holder = [None] * len(self.planned)
        self._reserved = {}
