"""Asynchronous Local-SGD on torch.distributed: rank 0 serves, ranks 1..W train.

:func:`run_async` is the entry point: call it on every rank with the user's
:class:`~thinwire.localsgd.task.Task` and one :class:`~thinwire.localsgd.config.AsyncConfig`.
**Rank 0 is the server** (global parameters, outer optimizer, evaluation, checkpoints)
and does no training; ranks 1..W are the W workers. Under torchrun the same holds across
machines: put rank 0 where the links to the others are best. The example trainer's
``--algo async-diloco`` is one user of this API (with thinwire's GPT and text shards).

Per round a worker pulls theta (fp32), runs ``H`` (or DyLU's ``H_w``) inner steps of the
user's optimizer on the shard the server gave it, and pushes ``theta - theta_w`` (fp32,
or fp16/bf16 with ``compress``). The server applies each push on arrival
(:class:`~thinwire.localsgd.algorithm.server_core.ServerCore`). What the inner optimizer
carries from one round into the next is the run's inner-state rule (``inner_momentum``),
the same for every method. ``compress`` and ``compress_pull`` shrink pushes and pulls to
fp16, bf16 or 1 bit (:mod:`~thinwire.localsgd.algorithm.compression`).

The pieces: :mod:`~thinwire.localsgd.runtime.server_process` (rank 0's process),
:mod:`~thinwire.localsgd.runtime.server_loop` (its loop),
:mod:`~thinwire.localsgd.runtime.worker_loop` (a worker's loop),
:mod:`~thinwire.localsgd.runtime.transport` (links and the store) and
:mod:`~thinwire.localsgd.messages` (what goes over them).

Fault tolerance:

* A worker that dies is noticed when a send to it fails, or when its heartbeat (a store
  counter bumped by a background thread every ``heartbeat_s``) stops for
  ``dead_after_s``: independent of the round length, so nothing to tune for the model
  size. The run continues with the others.
* A worker whose round fails with an exception reports nothing, rebuilds its inner
  optimizer and joins again (a new hello); the server re-admits it.
* A worker *process* that was killed comes back with
  :func:`~thinwire.localsgd.runtime.rejoin.rejoin_async`: every worker talks to the server over a
  two-rank gloo link of its own, never over the launch's process group, so a fresh
  process needs only the store's address. It is a new *incarnation* of its rank; the
  server admits it as a worker that joined late and ignores what the old incarnation
  left in flight. Launch each rank as its own process for this (the local launcher
  keeps serving when a worker dies; torchrun stops the whole group when one rank dies).
* The server checkpoints ``theta, m, Delta, t``, shard progress, lr clocks and speeds
  every ``checkpoint_interval`` inner steps per worker; ``resume`` continues from it in a
  new epoch and rejects updates computed before the restart. Each launched worker keeps
  its inner optimizer state (and push error feedback, and random generator) across a
  stop in ``checkpoint_dir/localsgd_worker<rank>.pt`` on its own host
  (:mod:`thinwire.localsgd.runtime.worker_loop`): with it a ``sync`` run stopped
  (``stop_after``) and resumed ends bit-identical to one that never stopped.
* A run's pretraining (``pretrain_steps``) is kept as it goes beside the server's
  checkpoint, and ``resume`` goes on from it
  (:mod:`~thinwire.localsgd.runtime.pretraining`).

The trained model: rank 0's summary carries the final theta;
:func:`~thinwire.localsgd.runtime.trained.load_trained` copies it (or a checkpoint's) into a
module of the task's.

Rank 0 hosts the launch's store and the run's: garbage sent to their ports would make
PyTorch write a C++ stack trace per request into its stderr, so rank 0 raises the C++ log
level to errors unless ``TORCH_CPP_LOG_LEVEL`` is set
(:func:`~thinwire.localsgd.runtime.run_store.quiet_store_warnings`); what reaches the run's own
queue is counted and summarised in one line a second at most.

Admission (:func:`open_transport`): rank 0 takes the user's token or generates one and
hands the run key to the launched workers (:mod:`thinwire.localsgd.runtime.keyshare`); it hosts
the run's store on the address the user named (:mod:`thinwire.comm.bind`); every
message is sealed (:mod:`thinwire.localsgd.runtime.auth`) and every push checked
(:mod:`thinwire.localsgd.algorithm.push_guard`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from thinwire.comm.launch import init_from_env
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.worker_core import IslandPart, LocalWorker
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.runtime.auth import RunKey, new_token, read_token
from thinwire.localsgd.runtime.island import Island, join_island, shard_worker_model, workers_of
from thinwire.localsgd.runtime.keyshare import share_run_key
from thinwire.localsgd.runtime.pretraining import start_run
from thinwire.localsgd.runtime.run_store import quiet_store_warnings, server_address
from thinwire.localsgd.runtime.server_process import run_server
from thinwire.localsgd.runtime.transport import Transport
from thinwire.localsgd.runtime.worker_loop import LoopSettings, follow_loop, work_loop
from thinwire.localsgd.task import Task, make_sources

__all__ = ["make_worker", "open_transport", "run_async", "worker_state_path"]

_LAUNCHES = itertools.count()
"""Runs this process has started in its process group, counted alike on every rank, so
that a second ``run_async`` in the same group finds its own server, not the first's."""


def worker_state_path(cfg: AsyncConfig, rank: int) -> Path | None:
    """Where worker ``rank`` keeps its inner state across a stop, on its own host
    (``checkpoint_dir/localsgd_worker<rank>.pt``); None without a checkpoint directory."""
    return Path(cfg.checkpoint_dir) / f"localsgd_worker{rank}.pt" if cfg.checkpoint_dir else None


def make_worker(
    task: Task, cfg: AsyncConfig, rank: int, workers: int, island: Island | None = None
) -> LocalWorker:
    """Worker ``rank``'s replica of ``task`` under ``cfg`` (``workers``: W); with an
    ``island``, this rank's part of that worker: the model sharded over the island."""
    model = task.model()
    part = None
    # In an island only the leader sleeps (slowdown): the others wait for it at the next
    # collective, so the island's step stretches once. Were every rank to sleep in
    # proportion to its own step, which includes waiting for the others, it would compound.
    leads = island is None or island.leader
    slowdown = cfg.slowdown[rank - 1] if cfg.slowdown and leads else 1.0
    if island is not None:
        island.device = next(model.parameters()).device  # where its orders travel
        shard_worker_model(model, island, task.shard)
        part = IslandPart(island.position, island.size, island.group)
    return LocalWorker(
        model,
        task.optimizer,
        make_sources(task, cfg.resolved_shards(workers)),
        task.loss,
        warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        grad_clip=cfg.grad_clip,
        slowdown=slowdown,
        inner_momentum=cfg.resolved_inner_momentum(),
        part=part,
    )


def open_transport(
    cfg: AsyncConfig, *, follower: bool = False
) -> tuple[Transport | None, bytes | None]:
    """This rank's transport, with the run key; call on every rank of the launch's group.

    Rank 0 reads the user's token (:func:`~thinwire.localsgd.runtime.auth.read_token`) or
    generates one, hands the run key to every launched worker without sending it in
    clear (:func:`~thinwire.localsgd.runtime.keyshare.share_run_key`) and hosts the run's store
    on ``cfg.bind_addr`` / ``THINWIRE_BIND_ADDR`` / ``MASTER_ADDR``. A worker that holds a
    token of its own checks that it is rank 0's. Returns the transport and, on rank 0,
    the token it generated (None when the user gave one, and on workers).
    ``follower``: a rank of an island other than its leader takes part in handing out
    the key, and opens no link (its transport is None).

    Raises:
        ConfigError: an unreadable or too short token, a worker token that differs from
            rank 0's, an address that cannot be listened on (on every rank).
    """
    rank = dist.get_rank()
    launch = next(_LAUNCHES)  # every rank counts the same runs
    launch_store = dist.distributed_c10d._get_default_store()
    key: RunKey | None = None
    generated: bytes | None = None
    error: ConfigError | None = None
    address = ""
    if rank == 0:
        try:
            address = server_address(cfg.bind_addr)  # before any worker is told where to go
            token = read_token(cfg.token_file)
        except ConfigError as exc:
            token, error = None, exc
        if token is None and error is None:
            token = generated = new_token()
        key = RunKey.from_token(token) if token is not None else None
    # The exchange runs on a gloo group: the launch's when it is gloo, else its own.
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        key = share_run_key(key, group)  # every rank raises if rank 0 has no key
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    if error is not None:
        raise error
    if follower:
        return None, None
    timeouts = {"connect_timeout_s": cfg.connect_timeout_s, "timeout_s": cfg.link_timeout_s}
    if rank == 0:
        return Transport.host(launch_store, key, address, launch, **timeouts), generated
    own = read_token(cfg.token_file)
    if own is not None and RunKey.from_token(own) != key:
        raise ConfigError(
            f"rank {rank}'s run token is not rank 0's: give every rank the same "
            "THINWIRE_RUN_TOKEN (or token file)"
        )
    return Transport.launched(launch_store, rank, key, launch, **timeouts), None


def run_async(
    task: Task,
    cfg: AsyncConfig,
    *,
    on_start: Callable[[int | None], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``task`` with asynchronous Local-SGD; call it on every rank.

    Needs a process group: the caller's, one described by torchrun's environment
    (joined here, and left again on return), or the one
    :func:`thinwire.comm.launch.spawn` makes. Only the start and run key go over it: then
    workers use links of their own, so a rank that dies leaves nothing in it to wait for.

    Args:
        task: the model factory, inner-optimizer factory, batch sources, loss and
            optional evaluation (:class:`~thinwire.localsgd.task.Task`).
        cfg: every knob of the run (:class:`~thinwire.localsgd.config.AsyncConfig`).
        on_start: rank 0 only; ``on_start(resumed_steps)`` once the server's state is
            restored (None for a fresh run), before any worker is answered.
        on_eval: rank 0 only; receives each evaluation record (``step``, ``updates``,
            ``rejected``, ``time_s``, ``val_loss``, and the other metrics when
            ``task.evaluate`` returns a dict, under their own names).

    Returns:
        On rank 0 the run's summary: ``theta``, the server's final global parameters
        (a flat fp32 CPU tensor, the ones the final evaluation saw), and ``norm_stats``
        with BatchNorm layers (not JSON: drop both before ``json.dumps``), which
        :func:`~thinwire.localsgd.runtime.trained.load_trained` loads into a model::

            summary = run_async(task, cfg)
            if rank == 0:
                model = load_trained(task.model(), summary)

        and ``final_val_loss`` and ``final_metrics`` (``val_loss`` and any other
        metrics) when ``task.evaluate`` is set, ``inner_steps``,
        ``updates_applied``/``updates_rejected``, ``dead_workers``, worker
        ``incarnations`` and ``updates_by_incarnation``, ``comm_bytes``, ...; the same
        for a resumed run. On a worker its ``rounds``, ``steps`` and ``restarts``.

    Raises:
        ConfigError: a bad setting (on every rank, before any message), no process group,
            a bad token, a worker whose model differs from the server's, or (rank 0) an
            evaluation result that is not a loss or a dict naming one.
        IncompleteRunError: rank 0 only; every worker died before the budget was met
            (the checkpoint keeps what was done; its ``summary`` says so, and carries
            that ``theta``).
    """
    created = _join_group()
    restore_log_level = None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        workers = workers_of(world, cfg.shard_within)
        cfg.validate(workers)
        if rank == 0:  # it hosts the stores: garbage sent to them must not flood its stderr
            restore_log_level = quiet_store_warnings()
        task, cfg = start_run(task, cfg, rank, workers)
        island = join_island(workers, cfg.shard_within, cfg.link_timeout_s)
        transport, generated = open_transport(cfg, follower=bool(island and not island.leader))
        if rank != 0:
            return _work(task, cfg, workers, transport, island)
        assert transport is not None
        try:
            return run_server(
                task,
                cfg,
                transport,
                workers,
                on_start=on_start,
                on_eval=on_eval,
                token_to_keep=generated,
            )
        finally:
            transport.mark_finished()  # late joiners are turned away, even after a failure
            transport.close()
    finally:
        if created:
            dist.destroy_process_group()
            if restore_log_level is not None:
                restore_log_level()  # no store of ours is listening any more
        # A caller's process group outlives the run, and its store keeps listening: the
        # level stays raised for as long as this process hosts it.


def _join_group() -> bool:
    """Join the process group torchrun's environment describes, unless there is one
    already; True when this call created it (and the run leaves it again)."""
    if dist.is_initialized():
        return False
    if not init_from_env():
        raise ConfigError(
            "run_async needs a process group of 2 or more ranks: launch with torchrun, "
            "or with thinwire.comm.launch.spawn"
        )
    return True


def _work(
    task: Task, cfg: AsyncConfig, workers: int, transport: Transport | None, island: Island | None
) -> Any:
    """A worker's part of :func:`run_async` (or its island's, with ``island``): rounds
    until the server says stop."""
    rank = dist.get_rank()
    worker = make_worker(task, cfg, rank, workers, island)
    state_path = worker_state_path(cfg, rank)
    if island is not None and not island.leader:
        return follow_loop(worker, island, state_path, cfg.resume)
    assert transport is not None
    settings = LoopSettings(
        compress=cfg.compress,
        heartbeat_s=cfg.heartbeat_s,
        max_restarts=cfg.max_restarts,
        state_path=state_path,
        resume=cfg.resume,
        island=island,
    )
    return work_loop(worker, transport, settings)
