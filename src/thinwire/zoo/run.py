"""Run zoo pieces on spawned local ranks and hold each to its uncompressed baseline."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from thinwire.zoo.loop import ASYNC_PIECES, PieceResult, train_piece
from thinwire.zoo.tasks import task

__all__ = ["Job", "run_jobs"]


@dataclass(frozen=True)
class Job:
    """One (model, piece) run."""

    model: str
    piece: str
    seed: int = 0
    steps: int = 150
    size: str = "tiny"
    batch_size: int = 64
    options: dict[str, Any] = field(default_factory=dict)


def _rank_main(
    rank: int, world: int, specs: list[dict[str, Any]], progress: bool
) -> list[dict[str, Any]]:
    del world
    out = []
    for spec in specs:
        job = Job(**spec)
        res = train_piece(
            task(job.model),
            job.piece,
            size=job.size,
            steps=job.steps,
            batch_size=job.batch_size,
            seed=job.seed,
            options=job.options,
        )
        out.append(dataclasses.asdict(res))
        if progress and rank == 0:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in res.metrics.items())
            print(
                f"  {job.model} {job.piece} seed {job.seed}: {shown} ({res.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return out


def _merge(per_rank: list[dict[str, Any]]) -> PieceResult:
    """Rank 0's result (its model was evaluated), with the busiest rank's bytes."""
    first = dict(per_rank[0])
    first["wire_bytes"] = max(r["wire_bytes"] for r in per_rank)
    return PieceResult(**first)


def run_jobs(
    jobs: list[Job], workers: int = 2, timeout_s: float = 3600.0, progress: bool = False
) -> list[PieceResult]:
    """Run ``jobs`` one after the other on ``workers`` spawned gloo ranks (one more, the
    server, for asynchronous Local-SGD); results in the order of ``jobs``. ``progress``
    prints a line per finished run on stderr."""
    from thinwire.comm.launch import spawn

    results: list[PieceResult | None] = [None] * len(jobs)
    groups = {
        workers: [i for i, j in enumerate(jobs) if j.piece not in ASYNC_PIECES],
        workers + 1: [i for i, j in enumerate(jobs) if j.piece in ASYNC_PIECES],
    }
    for world, indices in groups.items():
        if not indices:
            continue
        specs = [dataclasses.asdict(jobs[i]) for i in indices]
        per_rank = spawn(_rank_main, world, (specs, progress), timeout_s=timeout_s)
        for k, i in enumerate(indices):
            results[i] = _merge([ranks[k] for ranks in per_rank])
    return [r for r in results if r is not None]
