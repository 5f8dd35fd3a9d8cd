"""What a simulated run's checkpoints cost: the size of a save and the time it takes.

Runs one short simulation that saves after every arrival (``every_s=0``) and prints the
median and largest save time and the file's size; the default ``--checkpoint-every`` of
600 s divides the time into the run's share::

    python tools/sim_checkpoint_cost.py --model mini --method dn-dylu --steps 40
    python tools/sim_checkpoint_cost.py --model tiny --method sync --compress onebit

The file is written where a sweep writes it (a temporary directory here), then renamed,
as in a real run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from thinwire.localsgd import (
    HETEROGENEITY,
    AsyncConfig,
    SimCheckpoint,
    SimClock,
    for_method,
    simulate,
)
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData


class _Timed(SimCheckpoint):
    """A checkpoint that notes how long each save took (gathering the state included:
    the clock starts when the simulator asks whether a save is due) and its size."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seconds: list[float] = []
        self.sizes: list[int] = []
        self._asked = 0.0

    def due(self) -> bool:
        self._asked = time.perf_counter()
        return super().due()

    def save(self, state: dict[str, Any]) -> None:
        super().save(state)
        self.seconds.append(time.perf_counter() - self._asked)
        self.sizes.append(os.path.getsize(self.path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini", help="GPT preset (tiny, mini, small, base)")
    p.add_argument("--method", default="dn-dylu")
    p.add_argument("--steps", type=int, default=40, help="inner steps per worker")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--compress", default="none", help="push codec (onebit keeps a residual)")
    p.add_argument("--data", default="shakespeare")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = TrainConfig(model=args.model)
    data = TextData(args.data, model.gpt_config().seq_len, model.val_fraction, 0)
    cfg = AsyncConfig(local_steps=args.local_steps, steps=args.steps, compress=args.compress)
    clock = SimClock(HETEROGENEITY["very"], eval_points=1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _Timed(Path(tmp) / "run.partial.pt", every_s=0)
        run = simulate(gpt_task(model, data), for_method(cfg, args.method), clock, checkpoint=ckpt)
    print(
        f"{args.model} ({run['parameters']:,} parameters), {args.method}, "
        f"{len(clock.seconds_per_step)} workers: "
        f"{len(ckpt.seconds)} saves, median {statistics.median(ckpt.seconds):.3f} s, "
        f"largest {max(ckpt.seconds):.3f} s; file {statistics.median(ckpt.sizes) / 1e6:.1f} MB "
        f"(largest {max(ckpt.sizes) / 1e6:.1f} MB); every 600 s: "
        f"{100 * statistics.median(ckpt.seconds) / 600:.3f}% of a run's time"
    )


if __name__ == "__main__":
    main()
