"""Run zoo pieces on spawned local ranks and hold each to its uncompressed baseline.

A benchmark of a hundred runs takes the better part of an hour on a small machine, so
with a ``log`` every finished run is appended to a JSON-lines file as it ends, and a
second call with the same log runs only what is missing (:func:`read_log`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.zoo.loop import ASYNC_PIECES, PieceResult, train_piece
from thinwire.zoo.tasks import task

__all__ = ["Job", "read_log", "run_jobs"]

log = logging.getLogger(__name__)


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


def _key(job: Job) -> str:
    return json.dumps(dataclasses.asdict(job), sort_keys=True)


def read_log(path: Path) -> dict[str, PieceResult]:
    """The runs a log already holds, by job. A line that does not parse (a run killed
    mid-write, a hand edit) is skipped and counted in one warning: its job runs again."""
    done: dict[str, PieceResult] = {}
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                done[_key(Job(**entry["job"]))] = PieceResult(**entry["result"])
            except (ValueError, TypeError, KeyError):
                bad += 1
    if bad:
        log.warning("%s: skipped %d unreadable line(s); those runs will run again", path, bad)
    return done


def _rank_main(
    rank: int, world: int, specs: list[dict[str, Any]], progress: bool, log_path: str | None
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

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
        # rank 0's result (its model was evaluated), with the busiest rank's bytes
        busiest = torch.tensor([float(res.wire_bytes)], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        res = dataclasses.replace(res, wire_bytes=int(busiest.item()))
        out.append(dataclasses.asdict(res))
        if rank != 0:
            continue
        if log_path is not None:
            # one line, one write, flushed: a kill loses at most the run in flight
            line = json.dumps({"job": spec, "result": out[-1]}) + "\n"
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(line)
        if progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in res.metrics.items())
            print(
                f"  {job.model} {job.piece} seed {job.seed}: {shown} ({res.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return out


def run_jobs(
    jobs: list[Job],
    workers: int = 2,
    timeout_s: float = 3600.0,
    progress: bool = False,
    log: Path | None = None,
) -> list[PieceResult]:
    """Run ``jobs`` one after the other on ``workers`` spawned gloo ranks (one more, the
    server, for asynchronous Local-SGD); results in the order of ``jobs``. ``progress``
    prints a line per finished run on stderr. With ``log``, every finished run is
    appended to that JSON-lines file, and jobs the file already holds are not run again
    (their logged results are returned)."""
    from thinwire.comm.launch import spawn

    done = read_log(log) if log is not None and log.exists() else {}
    results: list[PieceResult | None] = [done.get(_key(j)) for j in jobs]
    todo = [i for i, r in enumerate(results) if r is None]
    if progress and len(todo) < len(jobs):
        print(f"  {len(jobs) - len(todo)} run(s) already in {log}, kept", file=sys.stderr)
    groups = {
        workers: [i for i in todo if jobs[i].piece not in ASYNC_PIECES],
        workers + 1: [i for i in todo if jobs[i].piece in ASYNC_PIECES],
    }
    for world, indices in groups.items():
        if not indices:
            continue
        specs = [dataclasses.asdict(jobs[i]) for i in indices]
        where = None if log is None else str(log)
        per_rank = spawn(_rank_main, world, (specs, progress, where), timeout_s=timeout_s)
        for k, i in enumerate(indices):
            results[i] = PieceResult(**per_rank[0][k])
    return [r for r in results if r is not None]
