"""Profile a job the way its workers will run: several processes sharing one machine's cores.

:func:`thinwire.analysis.measure.profile_gpt` times one process on an otherwise idle
machine (the paper's method). When the workers of the job share the cores (the emulated
testbed's hosts, or local ranks over loopback) each of them computes more slowly than a
lone process, and a prediction built from the lone profile is optimistic.
:func:`profile_processes` starts the workers' number of processes at once, each with the
threads a worker gets (:func:`host_threads`), times the same steps in all of them
together and returns their mean (:func:`merge_profiles`).

Tuning and reading the numbers:

* Sessions matter. Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``)
  shares the CPU fairly between sessions, not processes: 4 profile processes left in
  one session took 4.3-4.8x the alone step on the 2-core machine, in 4 sessions 2.1x, and
  the testbed's hosts (``start_new_session``) took 2.1x as well. Profile with
  ``own_session=True`` for testbed hosts, and with ``own_session=False`` for ranks that
  :func:`thinwire.comm.launch.spawn` starts in the caller's session.
* A machine shared with other work drifts within minutes: profile right before (and,
  to bracket a run, right after) what the profile predicts, and merge the two.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from thinwire.analysis.profile import Profile, load_profile
from thinwire.comm.start_method import context
from thinwire.errors import ConfigError

__all__ = ["host_threads", "merge_profiles", "profile_processes"]


def host_threads(hosts: int) -> int:
    """Threads per host, as the testbed sets ``OMP_NUM_THREADS``."""
    return max(1, (os.cpu_count() or 1) // hosts)


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """Mean of several profiles of the same model: step times and each gradient's ready time.

    Used for the co-located processes (each saw its own share of the cores) and for the
    profiles before and after a run (the machine's load drifts).
    """
    if not profiles:
        raise ConfigError("no profiles to merge")
    first = profiles[0]
    shape = [(p.name, p.nbytes) for p in first.params]
    for other in profiles[1:]:
        if [(p.name, p.nbytes) for p in other.params] != shape:
            raise ConfigError(
                f"profiles of {first.model!r} and {other.model!r} differ in parameters"
            )

    def mean(vals: Sequence[float | None]) -> float | None:
        got = [v for v in vals if v is not None]
        return statistics.fmean(got) if got else None

    params = [
        replace(p, ready_s=mean([q.params[i].ready_s for q in profiles]))
        for i, p in enumerate(first.params)
    ]
    merged = replace(
        first,
        iteration_s=statistics.fmean(p.iteration_s for p in profiles),
        backward_s=statistics.fmean(p.backward_s for p in profiles),
        forward_s=mean([p.forward_s for p in profiles]),
        optimizer_s=mean([p.optimizer_s for p in profiles]),
        params=params,
        meta={**first.meta, "merged": len(profiles)},
    )
    for key in ("onebit_codec_s_per_byte", "onebit_optimizer_s"):
        vals = [p.meta.get(key) for p in profiles]
        if all(v is not None for v in vals):
            merged.meta[key] = statistics.fmean(vals)  # type: ignore[arg-type]
        else:
            merged.meta.pop(key, None)
    return merged


@dataclass(frozen=True)
class _ProfileJob:
    """What each process of :func:`profile_processes` profiles, and how: its arguments
    (see there), sent to the fresh processes in one piece."""

    model: str
    batch_size: int
    threads: int
    hosts: int
    warmup: int
    steps: int
    observe_ddp: bool
    own_session: bool
    onebit_algo: str | None


def _profile_worker(rank: int, barrier: Any, job: _ProfileJob, path: str) -> None:
    import torch

    from thinwire.analysis.costs import measure_codec_cost
    from thinwire.analysis.measure import profile_gpt
    from thinwire.analysis.profile import save_profile

    model, batch_size, warmup, steps = job.model, job.batch_size, job.warmup, job.steps
    # A session of its own, as every testbed host gets: with the kernel's autogroup
    # scheduling (on by default on desktop and many cloud kernels) CPU time is shared
    # fairly between sessions, so processes left in one session would split one share.
    if job.own_session:
        os.setsid()
    torch.set_num_threads(job.threads)
    # Observing DDP's buckets makes a one-rank process group; only one process does it,
    # before the barrier, so the timed steps of all processes start together.
    observed = None
    if job.observe_ddp and rank == 0:
        observed = profile_gpt(model, batch_size, warmup=0, steps=1, observe_ddp=True)
    barrier.wait()
    prof = profile_gpt(model, batch_size, warmup=warmup, steps=steps)
    barrier.wait()  # the codec is timed under the same sharing as the steps
    prof.meta["onebit_codec_s_per_byte"] = measure_codec_cost(world_size=job.hosts)
    if job.onebit_algo is not None:  # its compression-stage update, instead of AdamW's
        barrier.wait()
        extra = profile_gpt(
            model, batch_size, warmup=warmup, steps=steps, optimizer=job.onebit_algo
        )
        prof.meta["onebit_optimizer_s"] = extra.optimizer_s
    if observed is not None:
        prof.observed_buckets = observed.observed_buckets
    save_profile(prof, path)


def profile_processes(
    model: str,
    batch_size: int,
    processes: int,
    threads: int,
    hosts: int,
    out_dir: Path,
    *,
    warmup: int = 2,
    steps: int = 6,
    observe_ddp: bool = False,
    timeout_s: float = 1200.0,
    own_session: bool = True,
    onebit_algo: str | None = None,
) -> Profile:
    """Profile GPT preset ``model`` in ``processes`` fresh processes at once; their mean.

    Each process uses ``threads`` threads and also measures the 1-bit compute for
    ``hosts`` ranks (``meta["onebit_codec_s_per_byte"]``). One process is the paper's
    one-worker profile; ``hosts`` processes reproduce the CPU sharing of ``hosts``
    workers on this machine. Each process writes ``out_dir/profile-<i>.json``.

    Args:
        warmup: untimed steps per process (allocator growth, first-touch pages).
        steps: timed steps per process; medians, so 5-10 resist one slow step.
        observe_ddp: record DDP's real buckets (one process, before the timed steps).
        timeout_s: for all processes together.
        own_session: put each process in a session of its own, as the testbed does
            with its hosts (see the module docstring); False for ranks that share the
            caller's session, as :func:`thinwire.comm.launch.spawn`'s do.
        onebit_algo: also time this 1-bit optimizer's compression-stage update, under
            the same sharing (``meta["onebit_optimizer_s"]``): the 1-bit stage's step
            runs it instead of AdamW's.

    Raises:
        RuntimeError: a process failed or did not finish within ``timeout_s``.
    """
    job = _ProfileJob(
        model, batch_size, threads, hosts, warmup, steps, observe_ddp, own_session, onebit_algo
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # Forks of thinwire's warm fork server (torch already imported), as spawn's ranks are:
    # a fresh interpreter per process took about 5 s of CPU to import before it timed
    # anything, 4 processes per point on 2 cores.
    ctx = context()
    barrier = ctx.Barrier(processes)
    paths = [str(out_dir / f"profile-{i}.json") for i in range(processes)]
    procs = [
        ctx.Process(target=_profile_worker, args=(i, barrier, job, paths[i]))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"profiling process(es) {bad} failed or timed out ({timeout_s:.0f} s)")
    profs = [load_profile(p) for p in paths]
    merged = merge_profiles(profs)
    merged.observed_buckets = profs[0].observed_buckets
    merged.meta.update(processes=processes, threads=threads)
    return merged
