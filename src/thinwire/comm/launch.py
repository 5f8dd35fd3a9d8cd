"""Process groups: join the one torchrun made, or spawn W local ranks on loopback.

thinwire never invents a transport: every rank is a process in a ``torch.distributed``
process group (gloo on CPU, NCCL on GPU). There are two ways to get there.

* **Launched by torchrun** (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``): :func:`init_from_env` joins that group. If a group
  already exists it is used as it is, never re-initialised.
* **Spawned locally**: :func:`spawn` starts ``nprocs`` processes (forked from a warm
  fork server that has imported torch, or fresh interpreters:
  :mod:`thinwire.comm.start_method`), gives them a free loopback port, runs
  ``fn(rank, world_size, *args)`` in each, returns each rank's result, and always
  destroys the process group. If one rank fails or the deadline passes, the others are
  terminated instead of being left to hang in a collective, and the error names the rank
  (a rank killed from outside, not the peers that lost their connection to it). The
  ranks end with the launcher, even when it is killed (:mod:`thinwire.comm.lifeline`).

Tuning: on a machine with fewer cores than ranks, each rank gets
``max(1, cores // nprocs)`` intra-op threads so ranks do not fight for cores.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.lifeline import set_process_name, tie_to_launcher
from thinwire.comm.rendezvous import join_store
from thinwire.comm.start_method import context
from thinwire.errors import ConfigError
from thinwire.safeload import safe_loads

__all__ = [
    "DistributedError",
    "default_backend",
    "free_port",
    "init_from_env",
    "launched_by_torchrun",
    "local_cuda_device",
    "rank",
    "spawn",
    "world_size",
]

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A rank failed, or the ranks did not finish before the deadline."""


def launched_by_torchrun() -> bool:
    """True when the environment describes a process group (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_cuda_device() -> torch.device:
    """This process's GPU: ``LOCAL_RANK`` (set by torchrun and by :func:`spawn`) modulo
    the GPUs present, so the ranks of one host spread over its GPUs, one each."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def default_backend(device: torch.device | None = None) -> str:
    """NCCL when the ranks compute on CUDA, gloo otherwise."""
    if device is not None and device.type == "cuda":
        return "nccl"
    return "gloo"


def rank() -> int:
    """This process's rank, 0 outside a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The group size, 1 outside a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group described by the environment; return True if one exists.

    An already-initialised group is kept as it is. Without ``RANK``/``WORLD_SIZE`` in the
    environment nothing is initialised and False is returned (a single-process run).
    Ranks started without torchrun meet within ``THINWIRE_JOIN_TIMEOUT_S`` (default 300 s)
    or fail with a one-line ConfigError (:mod:`thinwire.comm.rendezvous`).
    """
    if dist.is_initialized():
        return True
    if not launched_by_torchrun():
        return False
    store = join_store(timeout_s)  # all ranks are there (or a one-line error) from here on
    if store is None:  # under a torchrun agent, which has gathered the ranks already
        dist.init_process_group(
            backend=backend or default_backend(),
            init_method="env://",
            timeout=timedelta(seconds=timeout_s),
        )
        return True
    dist.init_process_group(
        backend=backend or default_backend(),
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _threads_per_rank(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // nprocs)


def _encode(obj: Any) -> bytes:
    # torch.save pickles tensors by value; queue transfer of live tensors would share
    # memory with a process that is about to exit.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(data: bytes, rank: int) -> Any:
    # Plain data only (tensors, numbers, strings, containers): a result never runs code.
    try:
        return safe_loads(data, f"the result of rank {rank}")
    except ConfigError as exc:
        raise DistributedError(
            f"{exc}; return tensors, numbers, strings, lists and dicts from a rank"
        ) from None


@dataclass(frozen=True)
class _Launch:
    """What every rank of one :func:`spawn` starts with (pickled to each new process)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs: int
    backend: str
    master_addr: str
    master_port: int
    timeout_s: float
    env: dict[str, str]
    """The whole environment of each rank: the launcher's at launch, plus ``spawn``'s ``env``."""
    launcher_pid: int


def _worker(local_rank: int, launch: _Launch, results: Any) -> None:
    nprocs = launch.nprocs
    set_process_name(f"thinwire-rank{local_rank}")
    tie_to_launcher(launch.launcher_pid)  # a killed launcher takes its ranks with it
    # The launcher's environment as it is now, not the fork server's from when it started.
    os.environ.clear()
    os.environ.update(launch.env)
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": launch.master_addr,
            "MASTER_PORT": str(launch.master_port),
        }
    )
    torch.set_num_threads(_threads_per_rank(nprocs))
    try:
        dist.init_process_group(
            backend=launch.backend,
            init_method="env://",
            rank=local_rank,
            world_size=nprocs,
            timeout=timedelta(seconds=launch.timeout_s),
        )
        out = launch.fn(local_rank, nprocs, *launch.args)
        results.put((local_rank, True, _encode(out)))
    except SystemExit:
        raise  # stopped by the launcher, or orphaned: nobody waits for a report
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        msg = f"{type(exc).__name__}: {exc}"
        results.put((local_rank, False, _encode((msg, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Reported (or not): a SIGTERM from the launcher's clean-up now just ends the
        # process, instead of raising into the interpreter's exit handlers.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _blame_the_dead(procs: list[Any], failed: int, msg: str, accounted: set[int]) -> None:
    """A rank killed from outside makes its peers fail with "connection reset" first;
    name the dead rank, not the symptom (waiting briefly for its exit to show)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i != failed and i not in accounted and p.exitcode not in (None, 0):
                first = msg.strip().splitlines()[0][:200] if msg.strip() else "an error"
                raise DistributedError(
                    f"rank {i} exited with code {p.exitcode} before reporting (rank {failed} "
                    f"then failed: {first})"
                ) from None
        time.sleep(0.05)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    master_addr: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    may_fail: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` new local ranks; return their results.

    ``fn`` must be importable by name (a module-level function): the ranks are new
    processes (:mod:`thinwire.comm.start_method`) with the launcher's environment, working
    directory and ``sys.path``, named ``thinwire-rank<r>`` (as ``ps -e``, ``top`` and
    ``pgrep`` show them), that exit when the launcher does, even when it is killed with SIGKILL
    (:mod:`thinwire.comm.lifeline`). Results travel back through ``torch.save`` and are
    loaded as plain data (tensors, numbers, strings, lists, dicts), never as code.

    ``may_fail``: ranks whose death or exception does not end the run (e.g. the workers
    of asynchronous Local-SGD, whose server carries on without them). Such a failure is
    reported on stderr in one line and the rank's result is None; the other ranks keep
    running until they report.

    Raises:
        DistributedError: a rank not in ``may_fail`` raised (its message and traceback
            are included) or died without a result, or ranks were still running after
            ``timeout_s``. Remaining ranks are terminated first, so nothing hangs.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    port = free_port(master_addr)
    environment = {**os.environ, **(env or {})}
    launch = _Launch(
        fn, args, nprocs, backend, master_addr, port, timeout_s, environment, os.getpid()
    )
    ranks = _Ranks(launch, may_fail)
    ranks.start()
    deadline = time.monotonic() + timeout_s
    try:
        ranks.collect(deadline)
    finally:
        ranks.close()
    return [ranks.outputs.get(r) for r in range(nprocs)]


class _Ranks:
    """The processes of one :func:`spawn` and what they have reported so far."""

    def __init__(self, launch: _Launch, may_fail: Collection[int]) -> None:
        ctx = context()
        self.launch = launch
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, launch, self.results),
                daemon=False,
                name=f"thinwire-rank{r}",
            )
            for r in range(launch.nprocs)
        ]
        self.tolerated = set(may_fail)
        self.failed: set[int] = set()
        self.outputs: dict[int, Any] = {}

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def pending(self) -> bool:
        """Some rank has neither reported nor failed in a tolerated way."""
        return len(self.outputs) + len(self.failed) < self.launch.nprocs

    def tolerate(self, rank: int, why: str) -> bool:
        """True (and one line on stderr, once) when ``rank`` may fail."""
        if rank not in self.tolerated:
            return False
        if rank not in self.failed:
            self.failed.add(rank)
            print(
                f"thinwire: rank {rank} {why}; the run continues without it "
                f"(MASTER_ADDR={self.launch.master_addr} MASTER_PORT={self.launch.master_port})",
                file=sys.stderr,
            )
        return True

    def collect(self, deadline: float) -> None:
        """Wait for every rank's report; raise as :func:`spawn` says."""
        while self.pending():
            try:
                r, ok, payload = self.results.get(timeout=0.1)
            except queue.Empty:
                self._check_silent(deadline)
                continue
            if not ok:
                msg, tb = _decode(payload, r)
                if not self.tolerate(r, f"failed: {msg}"):
                    accounted = set(self.outputs) | self.failed | self.tolerated
                    _blame_the_dead(self.procs, r, msg, accounted)
                    raise DistributedError(f"rank {r} failed: {msg}\n{tb}")
                continue
            self.outputs[r] = _decode(payload, r)

    def _check_silent(self, deadline: float) -> None:
        """No report came: a rank that died without one, or the deadline, ends the run."""
        procs = self.procs
        dead = [
            i
            for i, p in enumerate(procs)
            if i not in self.outputs
            and i not in self.failed
            and p.exitcode is not None
            and p.exitcode != 0
        ]
        for i in dead:
            why = f"exited with code {procs[i].exitcode} before reporting"
            if not self.tolerate(i, why):
                raise DistributedError(f"rank {i} {why}") from None
        if time.monotonic() > deadline:
            missing = sorted(set(range(self.launch.nprocs)) - set(self.outputs))
            raise DistributedError(
                f"ranks {missing} did not finish within {self.launch.timeout_s:.0f} s"
            ) from None

    def close(self) -> None:
        """Terminate the ranks still running (unless all reported), reap every one."""
        for p in self.procs:
            if p.is_alive() and self.pending():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.results.close()
