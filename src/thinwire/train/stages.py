"""What a training run measured, read back from its ``metrics.jsonl`` and summary.

The step times of the two stages of a 1-bit optimizer (warmup, compression), the final
training loss, and the bytes the collectives recorded against what the hosts' NICs
should have sent.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["accounted_total", "expected_tx_total", "final_train_loss", "stage_times"]


def _stage(steps: list[int], secs: list[float], comm: list[float], per_step: int) -> dict[str, Any]:
    if not steps:
        return {"steps": 0}
    mean = statistics.fmean(secs)
    return {
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "mean_step_s": mean,
        "median_step_s": statistics.median(secs),
        "samples_per_s": per_step / mean if mean > 0 else float("nan"),
        "wire_bytes_per_step": statistics.fmean(comm),
    }


def stage_times(
    records: Sequence[dict[str, Any]], freeze_step: int, samples_per_step: int
) -> dict[str, Any]:
    """Split per-step times of a ``metrics.jsonl`` into the warmup and compression stages.

    Per-step seconds come from differences of the cumulative ``time_s`` (exact when every
    step is logged; otherwise each step of an interval gets the interval's mean). Step
    ``s`` (1-based) is in the compression stage when ``s > freeze_step``.
    """
    train = sorted((r for r in records if "time_s" in r), key=lambda r: r["step"])
    if not train:
        raise ConfigError("metrics.jsonl holds no training records (did the run log any step?)")
    stages: dict[str, tuple[list[int], list[float], list[float]]] = {
        "warmup": ([], [], []),
        "compression": ([], [], []),
    }
    prev_step, prev_t, prev_c = 0, 0.0, 0.0
    for r in train:
        gap = r["step"] - prev_step
        if gap <= 0:
            continue
        dt = (r["time_s"] - prev_t) / gap
        dc = (r.get("comm_bytes", 0) - prev_c) / gap
        for s in range(prev_step + 1, r["step"] + 1):
            bucket = stages["compression" if s > freeze_step else "warmup"]
            bucket[0].append(s)
            bucket[1].append(dt)
            bucket[2].append(dc)
        prev_step, prev_t, prev_c = r["step"], r["time_s"], r.get("comm_bytes", 0)
    out: dict[str, Any] = {"freeze_step": freeze_step}
    for name, (steps, secs, comm) in stages.items():
        out[name] = _stage(steps, secs, comm, samples_per_step)
    # 1-bit optimizers log whether the *next* step compresses; report where that began,
    # so a reader can check the split against what the optimizer really did.
    flips = [r["step"] + 1 for r in train if r.get("compressing") == 1]
    out["first_compressing_step"] = min(flips) if flips else None
    return out


def final_train_loss(records: Sequence[dict[str, Any]], frac: float = 0.1) -> float:
    """Mean training loss over the last ``frac`` of the logged steps (one batch is noisy)."""
    losses = [r["loss"] for r in records if "loss" in r]
    k = max(1, round(len(losses) * frac))
    return statistics.fmean(losses[-k:]) if losses else float("nan")


def accounted_total(summary: dict[str, Any]) -> int:
    return sum(int(op["wire_bytes"]) for op in summary.get("comm_by_op", {}).values())


def expected_tx_total(comm_by_op: dict[str, dict[str, int]], world: int) -> float:
    """Bytes all hosts together should send, from rank 0's per-op accounting.

    Allreduces (plain and 1-bit) are symmetric, so every rank sends what rank 0 recorded.
    A broadcast records its payload on every rank, but on the wire only W-1 receivers
    must get it, whatever tree gloo uses: W-1 payloads in all, not W.
    """
    total = 0.0
    for op, stats in comm_by_op.items():
        wire = int(stats["wire_bytes"])
        total += wire * (world - 1 if op.endswith(".broadcast") else world)
    return total
