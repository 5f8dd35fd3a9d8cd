"""Data shards for Local-SGD workers: which shard a round trains on, and per-shard lr clocks.

The training data is cut into ``n`` shards. Each shard has a planned number of inner
steps (the run's inner-step budget shared in proportion to shard size) and a clock
counting the inner steps handed out on it. Two rules pick a round's shard
(``sampling``):

* ``"least-progress"`` (the default): the *free* shard with the least progress
  ``clock / planned``, ties by index; a shard is held by one worker at a time.
* ``"paper"`` (Liu et al., 2024, Eq. 2): shard ``i`` is drawn at random with probability
  proportional to ``max(|D_i| / sum |D| - n_i / sum n, 0)``, ``n_i`` its clock: only
  shards behind their share can be drawn, and two workers may train on one shard at once
  (the clock advances at dispatch, so they get different batches). Before any step, or
  if no shard is behind, the draw is proportional to size. Seeded, so runs repeat.

A shard is held by one worker at a time, so with as many shards as workers (the
runtime's default) a returning worker's only free shard is the one it just returned:
each worker keeps its shard, and a fast worker's shard runs past its plan (at the
floor lr) while a slow worker's stays short of it. Measured at the paper's toy speeds
(0.58 / 0.75 / 1.51 / 3.33 s per step, 200 planned steps per shard) the shards end at
340 / 267 / 133 / 60 steps, with or without DyLU. Give the run more shards than
workers (``--shards``) for the least-progress rule to balance them: with 4 per worker
every shard ended within 47-55 of its 50 planned steps, and Delayed Nesterov without
DyLU ended at a 7% lower loss (one seed, at the former defaults: outer lr 0.7 and
contiguous shards; not re-measured since).

With ``paper`` sampling the shards stay within a round of their shares whatever the
speeds. It is meant for shards that are alike (the example trainer's striped shards):
on contiguous shards of one text a random shard order is also a random curriculum.

The inner learning rate follows the *shard's* clock: linear warmup, then cosine decay to
a floor ``min_lr_ratio * lr``. A worker that changes shard continues that shard's
schedule, so every shard is trained with one warmup and one decay no matter who works
on it. The floor keeps late rounds useful when DyLU or a dead worker makes a shard run
past its plan.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from thinwire.errors import ConfigError

__all__ = ["SAMPLING_CHOICES", "ShardBook", "SyncSchedule", "inner_lr"]

SAMPLING_CHOICES = ("least-progress", "paper")


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
        sampling: ``"least-progress"`` or ``"paper"`` (see the module docstring).
        seed: seeds ``paper`` sampling.
    """

    def __init__(
        self, sizes: list[int], total_steps: int, sampling: str = "least-progress", seed: int = 0
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ConfigError(f"shards must be non-empty, got sizes {sizes}")
        if sampling not in SAMPLING_CHOICES:
            raise ConfigError(
                f"unknown shard sampling {sampling!r}; choose one of {SAMPLING_CHOICES}"
            )
        self.sampling = sampling
        self.sizes = [int(x) for x in sizes]
        self._rng = torch.Generator().manual_seed(int(seed) + 104_729)
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
        """Give ``worker`` a shard by the sampling rule; returns ``(shard, lr_clock)``.

        The shard's clock is advanced by ``steps`` now, so the next worker on this shard
        continues the schedule where this round will end.
        """
        self.release(worker)
        if self.sampling == "paper":
            shard = self._draw()
        else:
            free = [i for i, h in enumerate(self.holder) if h is None]
            candidates = free or list(range(len(self.planned)))  # more workers than shards
            shard = min(candidates, key=lambda i: (self.progress(i), i))
        start = self.clock[shard]
        self.clock[shard] += steps
        self.holder[shard] = worker
        self._reserved[worker] = (shard, steps)
        return shard, start

    def weights(self) -> list[float]:
        """Eq. 2's unnormalised probabilities of each shard for the next draw."""
        size_total, used = sum(self.sizes), sum(self.clock)
        share = [s / size_total for s in self.sizes]
        if used == 0:
            return share
        behind = [max(q - n / used, 0.0) for q, n in zip(share, self.clock, strict=True)]
        return behind if sum(behind) > 0 else share

    def _draw(self) -> int:
        w = torch.tensor(self.weights(), dtype=torch.float64)
        return int(torch.multinomial(w, 1, generator=self._rng))

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
        return {"planned": list(self.planned), "clock": clock, "rng": self._rng.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["planned"]) != len(self.planned):
            raise ConfigError(
                f"checkpoint has {len(state['planned'])} shards, this run has {len(self.planned)}"
            )
        self.planned = [int(x) for x in state["planned"]]
        self.clock = [int(x) for x in state["clock"]]
        self.holder = [None] * len(self.planned)
        self._reserved = {}
        if "rng" in state:
            self._rng.set_state(state["rng"])

    def snapshot(self) -> dict[str, Any]:
        """Everything, rounds in flight included (their clocks advanced, their shards
        held): for the same run to go on from here (:meth:`restore`), where
        :meth:`state_dict` is for a relaunch that hands those rounds out again."""
        return {
            "planned": list(self.planned),
            "clock": list(self.clock),
            "holder": list(self.holder),
            "reserved": [(w, shard, steps) for w, (shard, steps) in self._reserved.items()],
            "rng": self._rng.get_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`snapshot`."""
        self.load_state_dict(state)
        self.holder = [None if h is None else int(h) for h in state["holder"]]
        self._reserved = {int(w): (int(f), int(n)) for w, f, n in state["reserved"]}


class SyncSchedule:
    """The shards and lr clocks of synchronous rounds, as a sync-mode server hands them out.

    A server in sync mode (``AsyncConfig.sync``) answers every worker at once, in worker
    order, with rounds of ``H`` steps (fewer once the budget runs out). This replays that
    schedule with the server's own :class:`ShardBook`, so a synchronous DiLoCo run that
    has no server (``thinwire train --algo diloco``) trains every worker on the very
    shards and lr clocks the simulator's ``sync`` method uses: every rank computes the
    same schedule on its own.

    Args:
        sizes: tokens per shard. workers: W (ids 1..W). local_steps: H.
        steps: inner steps per worker (a multiple of H, for every round to be whole).
        sampling, seed: as :class:`ShardBook`.
    """

    def __init__(
        self,
        sizes: list[int],
        workers: int,
        local_steps: int,
        steps: int,
        sampling: str = "least-progress",
        seed: int = 0,
    ) -> None:
        self.book = ShardBook(sizes, steps * workers, sampling, seed)
        self.workers, self.local_steps = workers, local_steps
        self.remaining = steps * workers
        self.rounds: list[dict[int, tuple[int, int]]] = []

    def at(self, worker: int, step: int) -> tuple[int, int]:
        """``(shard, lr_clock)`` of inner step ``step`` (0-based) of ``worker`` (1..W)."""
        k, i = divmod(step, self.local_steps)
        while len(self.rounds) <= k:
            for w in range(1, self.workers + 1):
                self.book.release(w)
            plan = {}
            for w in range(1, self.workers + 1):
                n = min(self.local_steps, self.remaining)
                if n <= 0:
                    break
                self.remaining -= n
                plan[w] = self.book.take(w, n)
            self.rounds.append(plan)
        if worker not in self.rounds[k]:
            raise IndexError(f"worker {worker} has no round {k}: the budget is spent")
        shard, clock = self.rounds[k][worker]
        return shard, clock + i
