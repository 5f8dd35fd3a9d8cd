"""Time a 1-bit optimizer's step on every rank at once: ``thinwire bench optimizer``.

A recorded LAMB run knows its own update, its gradients' buckets and its compute under
the real sharing of the cores, but not what 1-bit LAMB's step would cost there: the
update of a compressing optimizer, the 1-bit codec (compress, server average,
decompress) and the exchange's waits. Timed alone, in one process, that step is 1.5-2x
too fast for a rank that shares two cores with three others (measured: the demo's
prediction missed by 13-14% on 2 runs of 3 that way). :func:`time_optimizer_step`
times it where the job runs, on every rank of the group together, on a copy of the
job's own parameter layout (:func:`layout_of_record`: the sizes of a record's
parameters; the update is elementwise and per layer, so their shapes do not matter).

Before each timed step every rank runs the job's own forward and backward passes when
the record is a ``thinwire train`` run (:mod:`thinwire.analysis.job_passes`), or else
does as much arithmetic as the record's passes took (``compute_s``), so the ranks reach
the exchange as unevenly as in training. Each timed step returns three numbers per rank:
the whole step, the exchange inside it and, of that, the time spent blocked waiting for
the network and the other ranks. The difference is compute (the update, and the codec),
which the analyzer adds to the recorded forward and backward passes; the wait is the
network's, which it predicts from the link. :func:`summarize` takes the median over each
rank's steps, then over the ranks.

Tuning: ``warmup`` (3) covers the optimizer's uncompressed steps (``freeze_step=2``) and
the buffers' allocation; untimed steps go on until the 1-bit exchange has tuned its
piece count (up to 20 more); then ``iters`` (10) timed steps. Where ranks share cores
the wait is the scheduler's as much as the network's: on the testbed (4 hosts, 2 cores)
it ranged 27-36 ms between timings of the same job, and 18-39 ms between training runs;
raise ``iters`` for a steadier median, but a single run's wait will still scatter around
it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text

if TYPE_CHECKING:
    from thinwire.analysis.recorded import Record

__all__ = [
    "OPTIMIZERS",
    "RESULT_NAME",
    "TUNING_STEPS",
    "bench_on_local_ranks",
    "layout_of_record",
    "passes_flag",
    "record_compute_s",
    "summarize",
    "time_on_this_rank",
    "time_optimizer_step",
    "time_where_the_job_runs",
    "timed_steps",
    "write_result",
]

RESULT_NAME = "optimizer.json"
"""What a timing writes in its output directory: every rank's steps and the summary."""

OPTIMIZERS = ("onebit-lamb", "onebit-adam")
"""The optimizers whose step ``bench optimizer`` times (those with an exchange inside)."""


def layout_of_record(header: dict[str, Any]) -> list[int]:
    """Elements per trainable floating-point parameter of a record's header, in order."""
    sizes = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
    out = []
    for p in header["params"]:
        width = sizes.get(str(p.get("dtype", "float32")).removeprefix("torch."))
        if p.get("trainable", True) and width and p["nbytes"] > 0:
            out.append(int(p["nbytes"]) // width)
    if not out:
        raise ConfigError("the record names no trainable floating-point parameter to time")
    return out


def _optimizer(algo: str, params: list[torch.Tensor]) -> Any:
    from thinwire.optim import OneBitAdam, OneBitLamb

    if algo == "onebit-lamb":
        return OneBitLamb(params, lr=1e-4, freeze_step=2)
    if algo == "onebit-adam":
        return OneBitAdam(params, lr=1e-4, freeze_step=2)
    raise ConfigError(
        f"bench optimizer: unknown optimizer {algo!r}; choose {', '.join(OPTIMIZERS)}"
    )


def _calibrated_rounds(compute_s: float, block: torch.Tensor) -> int:
    """How many products ``block @ block`` take ``compute_s`` on a rank while every rank
    computes at once (the cores shared as in training); the median over the ranks, so
    every rank then does the same work and only the sharing makes them differ."""
    window = max(0.2, 2 * compute_s)
    if dist.is_initialized():
        dist.barrier()
    t0, n = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - t0) < window:
        block @ block
        n += 1
    mine = n / elapsed * compute_s
    if not dist.is_initialized():
        return max(1, round(mine))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return max(1, round(statistics.median(everyone)))


def time_optimizer_step(
    algo: str,
    numels: list[int],
    warmup: int = 3,
    iters: int = 10,
    seed: int = 0,
    compute_s: float = 0.0,
) -> list[dict[str, float]]:
    """Time ``iters`` compressed steps of ``algo`` on parameters of ``numels`` elements,
    on every rank of the initialized process group at once; every rank returns its own
    steps: ``step_s``, ``exchange_s`` and ``wait_s`` each.

    ``compute_s`` stands in for the forward and backward passes: before each step every
    rank does the same amount of arithmetic, as much as takes ``compute_s`` while all
    ranks compute at once. The ranks then reach the exchange as unevenly as a training
    step leaves them, and the wait includes that skew. On the testbed (4 hosts sharing 2
    cores, the demo's GPT) the exchange waited 22-39 ms per step in three 1-bit LAMB
    runs; timed after the LAMB records' compute it waited 27-31 ms, and 12-15 ms with
    ranks that start together. With 0 the ranks start each step together (a barrier,
    not timed).

    The gradients are fresh random numbers every step, different per rank: the momentum
    settles at its steady size, as in training, instead of growing for ten steps toward
    one fixed gradient (which the stale-variance guard would read as a stale freeze).
    """
    if warmup < 2 or iters < 1:
        raise ConfigError(
            f"bench optimizer: need warmup >= 2 and iters >= 1, got {warmup}, {iters}"
        )
    if not (compute_s >= 0 and compute_s < 60):
        raise ConfigError(f"bench optimizer: compute must be 0-60 s, got {compute_s}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in numels]
    opt = _optimizer(algo, params)
    block = torch.randn(128, 128, generator=gen) / 12
    rounds = _calibrated_rounds(compute_s, block) if compute_s > 0 else 0

    def stand_in(k: int) -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        if rounds:
            for _ in range(rounds):
                block @ block
        elif dist.is_initialized():
            dist.barrier()

    return timed_steps(algo, opt, stand_in, warmup, iters)


TUNING_STEPS = 30
"""Untimed steps allowed beyond ``warmup`` for the 1-bit collective to settle its piece
count and scheme (it takes at most 20 calls, :mod:`thinwire.comm.piece_tuner`)."""


def timed_steps(
    algo: str, opt: Any, before: Callable[[int], None], warmup: int, iters: int
) -> list[dict[str, float]]:
    """Step ``opt`` ``warmup`` times and on until its 1-bit collective is tuned
    (``opt.onebit_tuned``, at most :data:`TUNING_STEPS` more), then ``iters`` timed
    steps: ``step_s``, ``exchange_s`` and ``wait_s`` each, and ``passes_s`` (what
    ``before(k)`` took: it leaves the gradients of step ``k`` in place).

    Why wait for the tuner: its calls try every piece count, the slow ones too, and ten
    steps timed right after the freeze would be the collective's 4th to 13th calls, all
    of them tuning calls. Every rank's tuner makes the same choice, so every rank stops
    tuning at the same step and the collectives stay matched.

    Raises RuntimeError when the optimizer does not compress after its warmup in a group
    of more than one rank: a timing of its warmup would pass for the compressed step."""
    k = 0
    while k < warmup or (getattr(opt, "onebit_tuned", True) is False and k < warmup + TUNING_STEPS):
        before(k)
        opt.step()
        opt.zero_grad(set_to_none=True)
        k += 1
    if dist.is_initialized() and dist.get_world_size() > 1 and not opt.compressing:
        raise RuntimeError(f"bench optimizer: {algo} did not compress after its warmup")
    steps, untimed = [], k
    for k in range(untimed, untimed + iters):
        t_passes = time.perf_counter()
        before(k)
        ex0, wait0 = opt.exchange_s, opt.exchange_wait_s
        t0 = time.perf_counter()
        opt.step()
        took = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        steps.append(
            {
                "step_s": took,
                "exchange_s": opt.exchange_s - ex0,
                "wait_s": opt.exchange_wait_s - wait0,
                "passes_s": t0 - t_passes,
            }
        )
    return steps


def summarize(per_rank: list[list[dict[str, float]]]) -> dict[str, float]:
    """Medians over each rank's steps, then over the ranks: ``step_s``, ``exchange_s``,
    ``wait_s``, and what is compute: ``update_s`` (the step without its exchange) and
    ``codec_s`` (the exchange without its waits); and ``passes_s``, what came before
    each step (the job's own passes, :mod:`thinwire.analysis.job_passes`, or the
    stand-in), when every step says."""
    keys = ("step_s", "exchange_s", "wait_s")
    if all("passes_s" in s for steps in per_rank for s in steps):
        keys += ("passes_s",)
    medians = [{k: statistics.median(s[k] for s in steps) for k in keys} for steps in per_rank]
    out = {k: statistics.median(m[k] for m in medians) for k in keys}
    out["update_s"] = statistics.median(max(0.0, m["step_s"] - m["exchange_s"]) for m in medians)
    out["codec_s"] = statistics.median(max(0.0, m["exchange_s"] - m["wait_s"]) for m in medians)
    out["ranks"] = float(len(per_rank))
    return out


def write_result(
    out: str | Path, algo: str, numels: list[int], per_rank: list[Any], command: str
) -> dict[str, float]:
    """Write ``OUT/optimizer.json`` (every rank's steps, the summary, the command that
    produced them); returns the summary."""
    summary = summarize(per_rank)
    blob = {
        "command": command,
        "algo": algo,
        "numels": numels,
        "summary": summary,
        "ranks": per_rank,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out) / RESULT_NAME, json.dumps(blob, indent=2) + "\n")
    return summary


def time_on_this_rank(
    algo: str,
    numels: list[int],
    warmup: int = 3,
    iters: int = 10,
    compute_s: float = 0.0,
    config: str | Path | None = None,
) -> list[dict[str, float]]:
    """This rank's timed steps: after the job's own passes when ``config`` (a ``thinwire
    train`` run's ``config.json``, :func:`thinwire.analysis.job_passes.job_config`) is
    given, else on ``numels`` after ``compute_s`` of stand-in arithmetic."""
    if config is not None:
        from thinwire.analysis.job_passes import time_on_job_passes

        return time_on_job_passes(algo, config, warmup, iters)
    return time_optimizer_step(algo, numels, warmup, iters, compute_s=compute_s)


def passes_flag(compute_s: float, config: str | Path | None) -> str:
    """What stood in for the passes, as ``bench optimizer``'s flags say it."""
    if config is not None:
        return f"--record {Path(config).parent}"
    return f"--compute-ms {compute_s * 1e3:.1f}"


def _rank_body(
    rank: int,
    world: int,
    algo: str,
    numels: list[int],
    counts: tuple[int, int],
    compute_s: float,
    config: str | None,
) -> list[dict[str, float]]:
    return time_on_this_rank(algo, numels, *counts, compute_s=compute_s, config=config)


def record_compute_s(rec: Record) -> float:
    """A recorded run's forward and backward passes (medians), the compute that
    :func:`time_optimizer_step` stands in for before each step."""
    from thinwire.analysis.recorded import profile_from_record

    prof = profile_from_record(rec)
    return float((prof.forward_s or 0.0) + prof.backward_s)


def bench_on_local_ranks(
    algo: str,
    numels: list[int],
    workers: int,
    out: str | Path | None = None,
    warmup: int = 3,
    iters: int = 10,
    compute_s: float = 0.0,
    config: str | Path | None = None,
) -> dict[str, float]:
    """:func:`time_on_this_rank` on ``workers`` new local gloo ranks (they share this
    machine's cores, as local training ranks do); the summary, also written to
    ``out`` when given."""
    from thinwire.comm.launch import spawn

    if workers < 2:
        raise ConfigError(f"bench optimizer: need at least 2 workers, got {workers}")
    where = None if config is None else str(config)
    args = (algo, numels, (warmup, iters), compute_s, where)
    per_rank = spawn(_rank_body, workers, args=args, timeout_s=600.0)
    if out is None:
        return summarize(per_rank)
    command = f"thinwire bench optimizer --algo {algo} --workers {workers} "
    command += passes_flag(compute_s, config)
    return write_result(out, algo, numels, per_rank, command)


def time_where_the_job_runs(
    algo: str, run_dir: str | Path, out: str | Path, cluster: Any = None, workers: int = 2
) -> dict[str, float]:
    """``algo``'s step on the recorded job, timed where the job runs: on a testbed
    ``cluster``'s hosts (``thinwire bench optimizer`` under its launcher), or on
    ``workers`` local ranks when it is None. Each timed step follows the job's own
    forward and backward passes when the record is a ``thinwire train`` run
    (:mod:`thinwire.analysis.job_passes`), else the record's compute in stand-in
    arithmetic (:func:`record_compute_s`). The summary; ``OUT/optimizer.json`` kept.

    Why not in this process: a rank shares the cores with the others, and a step timed
    alone came out 1.5-2x too fast for one that does."""
    import sys

    from thinwire.analysis.job_passes import job_config
    from thinwire.analysis.recorded import load_record

    if cluster is None:
        rec = load_record(run_dir)  # read once: its layout and its compute
        numels = layout_of_record(rec.header)
        config = job_config(run_dir)
        compute_s = record_compute_s(rec) if config is None else 0.0
        return bench_on_local_ranks(algo, numels, workers, out, compute_s=compute_s, config=config)
    argv = [sys.executable, "-m", "thinwire", "bench", "optimizer", "--algo", algo]
    argv += ["--record", str(run_dir), "--out", str(out)]
    res = cluster.run(argv, timeout_s=600.0, log_dir=Path(out) / "hosts")
    if not res.ok:
        raise RuntimeError(f"timing {algo}'s step failed on the testbed:\n{res.summary()}")
    return dict(json.loads((Path(out) / RESULT_NAME).read_text())["summary"])
