"""How far healthy pushes stay from the server's push-norm bound (``max_push_ratio``).

    python tools/push_norms.py [--local-steps 10] [--methods dn-dylu,dn] [--steps 100]

Simulates the tiny GPT (:func:`thinwire.localsgd.simulate` with the trainer's
``gpt_task``) at the paper's speeds (0.58 / 0.75 / 1.51 / 3.33 s per step), and records,
for every push the server's :class:`~thinwire.localsgd.PushGuard` checks once it is
warm, the ratio it compares with ``max_push_ratio``: the push's norm per inner step over
the median of the last ``push_history`` accepted pushes. Prints the largest ratio per
method; a healthy run should stay well below the default bound of 20.
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire.localsgd import SimClock, for_method, simulate
from thinwire.localsgd.algorithm import push_guard as pg
from thinwire.train.async_task import async_config, gpt_task
from thinwire.train.config import TrainConfig


def measure(method: str, local_steps: int, steps: int, seed: int) -> dict[str, Any]:
    ratios: list[float] = []
    check = pg.PushGuard.check

    def recording(self: pg.PushGuard, *args: Any, **kw: Any) -> tuple[str | None, float]:
        warm = len(self.norms) >= self.warmup
        out = check(self, *args, **kw)
        if warm:
            ratios.append(self.last_ratio)
        return out

    pg.PushGuard.check = recording  # type: ignore[method-assign]
    try:
        cfg = TrainConfig(
            algo="async-diloco",
            model="tiny",
            steps=steps,
            local_steps=local_steps,
            batch_size=8,
            eval_sequences=8,
            seed=seed,
        )
        sim = simulate(
            gpt_task(cfg),
            for_method(async_config(cfg), method),
            SimClock(seconds_per_step=(0.58, 0.75, 1.51, 3.33), eval_points=1),
        )
    finally:
        pg.PushGuard.check = check  # type: ignore[method-assign]
    return {"method": method, "H": local_steps, "pushes": sim["updates"], "max": max(ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--methods", default="dn-dylu,dn")
    p.add_argument("--steps", type=int, default=100, help="inner steps per worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print("| H | method | pushes | largest ratio |\n|---|---|---:|---:|")
    for method in args.methods.split(","):
        r = measure(method, args.local_steps, args.steps, args.seed)
        print(f"| {r['H']} | {r['method']} | {r['pushes']} | {r['max']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
