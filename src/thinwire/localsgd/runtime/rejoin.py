"""Bring a killed worker of an asynchronous Local-SGD run back, in a fresh process.

:func:`rejoin_async` takes the same :class:`~thinwire.localsgd.task.Task` and
:class:`~thinwire.localsgd.config.AsyncConfig` as the run (the example trainer's
``--rejoin RANK`` calls it). The new process needs only the run's
store address (``MASTER_ADDR`` and ``MASTER_PORT`` of rank 0). It opens its own two-rank
link to the server, is checked against the run (rank, model, shard count, settings)
before it says hello, and is admitted as a new *incarnation* of its rank; whatever the
old process left in flight is ignored. See :mod:`thinwire.localsgd.runtime.launch` for
the run itself.

It needs the run's token (``THINWIRE_RUN_TOKEN``, a token file, or, on the server's
host, the ``run.token`` rank 0 keeps in the run's checkpoint directory), which it checks
against the server's published verifier before it says anything; and it replaces only
a worker the server considers dead, unless forced.
"""

from __future__ import annotations

import os
from typing import Any

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.messages import RunInfo
from thinwire.localsgd.runtime.auth import RunKey, read_token
from thinwire.localsgd.runtime.launch import make_worker
from thinwire.localsgd.runtime.transport import Transport
from thinwire.localsgd.runtime.worker_loop import LoopSettings, work_loop
from thinwire.localsgd.task import Task, shape_signature

__all__ = ["rejoin_async"]


def rejoin_async(
    task: Task,
    cfg: AsyncConfig,
    rank: int,
    *,
    host: str | None = None,
    port: int | str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Run worker ``rank`` again, in a fresh process, inside a running asynchronous run.

    For a worker process that was killed (or its machine rebooted): start a new process
    with the run's task and config. It needs only the run's store, ``host:port``
    (default: the ``MASTER_ADDR`` and ``MASTER_PORT`` the run was launched with, i.e.
    rank 0's), and never joins the launch's process group, whose rendezvous is long
    over. The server admits it as a new incarnation of worker ``rank`` and ignores
    anything the old process still had in flight. If the old process is in fact alive,
    the rejoin is refused, unless ``force``: then the old one is cut off and fails.

    The token: ``cfg.token_file``, ``THINWIRE_RUN_TOKEN``, ``THINWIRE_RUN_TOKEN_FILE``,
    else ``cfg.checkpoint_dir/run.token`` (where rank 0 keeps a token it generated).

    Returns the worker's counts (rounds, inner steps, restarts) with its ``worker``
    rank and ``incarnation``.

    Raises:
        ConfigError: no address, nothing served there, no token or not the run's, the
            run has finished, ``rank`` is not a worker of the run, ``cfg.shard_within``
            above 1 (an island is several processes), or the model, the shard
            count or other settings differ from the run's.
            All are checked before this process says hello, so the run is not disturbed.
            After the hello: the server refused it (its worker is alive, or its model
            differs).
    """
    if cfg.shard_within > 1:
        raise ConfigError(
            f"cannot rejoin a worker of {cfg.shard_within} ranks (shard_within): a rejoin "
            "brings back one process; restart the whole run with resume instead"
        )
    host, port = _store_address(host, port)
    if rank < 1:
        raise ConfigError(
            f"cannot rejoin as rank {rank}: rank 0 is the server (restart the whole run with "
            "resume); workers are ranks 1..W"
        )
    cfg.validate()
    token = read_token(cfg.token_file, run_dir=cfg.checkpoint_dir)
    transport = Transport.rejoin(
        host,
        port,
        rank,
        None if token is None else RunKey.from_token(token),
        connect_timeout_s=cfg.connect_timeout_s,
        timeout_s=cfg.link_timeout_s,
    )
    info = transport.run_info()
    if info.finished:
        raise ConfigError(f"the asynchronous run served at {host}:{port} has finished")
    if rank > info.workers:
        raise ConfigError(
            f"cannot rejoin as rank {rank}: the run at {host}:{port} has workers "
            f"1..{info.workers} (rank 0 is the server)"
        )
    cfg.validate(info.workers)
    # Read on after the pretraining, as the run's launched workers do (the weights come
    # from the server's theta).
    worker = make_worker(cfg.start().continued(task), cfg, rank, info.workers)
    _check_like_the_run(worker, info)
    settings = LoopSettings(
        compress=cfg.compress,
        heartbeat_s=cfg.heartbeat_s,
        max_restarts=cfg.max_restarts,
        late=True,
        force=force,
    )
    out = work_loop(worker, transport, settings)
    return out | {"worker": rank, "incarnation": transport.incarnation}


def _store_address(host: str | None, port: int | str | None) -> tuple[str, int]:
    """The run's store address: the arguments, else ``MASTER_ADDR:MASTER_PORT``."""
    host = host or os.environ.get("MASTER_ADDR")
    port = port or os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError(
            "rejoining needs the run's store address: set MASTER_ADDR and MASTER_PORT to "
            "those of the run's rank 0"
        )
    try:
        port = int(port)
    except ValueError:
        raise ConfigError(f"MASTER_PORT must be a port number, got {port!r}") from None
    return host, port


def _check_like_the_run(worker: LocalWorker, info: RunInfo) -> None:
    """The rejoining worker's model and shard count are the run's (before its hello)."""
    numel, crc = shape_signature(worker.model)
    if (numel, crc) != (info.numel, info.checksum):
        raise ConfigError(
            f"this worker's model has {numel} parameters (shape checksum {crc}), the run's "
            f"has {info.numel} (checksum {info.checksum}); rejoin with the run's model settings"
        )
    if len(worker.shards) != info.shards:
        raise ConfigError(
            f"this worker cuts the data into {len(worker.shards)} shards, the run into "
            f"{info.shards}; rejoin with the run's shard count (--shards)"
        )
