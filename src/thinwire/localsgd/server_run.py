"""Rank 0 of an asynchronous Local-SGD run: the server around its loop.

:func:`run_server` builds the global model from the user's factory, cuts the shard book
from the user's batch sources, restores the server's state when resuming (or refuses to
overwrite another run's checkpoint), serves (:func:`~thinwire.localsgd.server_loop.serve`)
with evaluation and checkpoints on the configured intervals, and returns the run's
summary: evaluation, updates applied and rejected, worker incarnations, bytes.

Checkpoint: ``checkpoint_dir/localsgd_server.pt`` holds only tensors, numbers and
strings, written to a temporary file and renamed into place, and read back with
``torch.load(weights_only=True)``, which executes nothing from the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
from thinwire.localsgd.compression import PullEncoder
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.server import ServerCore
from thinwire.localsgd.server_loop import serve
from thinwire.localsgd.task import (
    Task,
    evaluate_at,
    flat_parameters,
    make_sources,
    shape_signature,
    shard_sizes,
)
from thinwire.localsgd.transport import Transport

__all__ = ["SERVER_CHECKPOINT", "load_server_state", "run_server", "save_server_state"]

SERVER_CHECKPOINT = "localsgd_server.pt"
"""The server's checkpoint file in :attr:`AsyncConfig.checkpoint_dir`."""


def save_server_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``: a crash
    mid-write leaves the previous checkpoint intact."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_server_state(path: Path) -> dict[str, Any]:
    """The server state saved at ``path``; a one-line ConfigError if missing or damaged."""
    if not path.exists():
        raise ConfigError(f"checkpoint file {path} is missing: nothing to resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged or foreign files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"checkpoint file {path} is corrupt or unreadable ({reason})") from None
    if not isinstance(state, dict) or "theta" not in state:
        raise ConfigError(f"checkpoint file {path} is not an asynchronous Local-SGD server's")
    return state


def run_server(
    task: Task,
    cfg: AsyncConfig,
    transport: Transport,
    workers: int,
    *,
    on_start: Callable[[int | None], None] | None = None,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Serve ``workers`` workers (ranks 1..W) until the budget is spent; the summary.

    ``on_start(resumed_steps)`` runs once the checkpoint (if any) is restored and before
    the first message: ``resumed_steps`` is the inner steps restored, None for a fresh
    run. ``on_eval(record)`` receives every evaluation record.
    """
    model = task.model()
    sources = make_sources(task, cfg.resolved_shards(workers))
    core = ServerCore.from_config(flat_parameters(model), cfg, workers, shard_sizes(sources))
    ckpt = Path(cfg.checkpoint_dir) / SERVER_CHECKPOINT if cfg.checkpoint_dir else None
    resumed = None
    if cfg.resume and ckpt is not None:
        core.load_state_dict(load_server_state(ckpt))
        resumed = core.steps_applied
    elif ckpt is not None:
        if ckpt.exists():
            raise ConfigError(
                f"{ckpt.parent} already holds an asynchronous run ({ckpt.name}); resume "
                "it or choose another checkpoint directory"
            )
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(resumed)
    evaluate: Callable[[torch.Tensor], float] | None = None
    if task.evaluate is not None:
        metric = task.evaluate

        def evaluate_theta(theta: torch.Tensor) -> float:
            return evaluate_at(model, theta, metric)

        evaluate = evaluate_theta

    sent0, t0, steps0 = COUNTER.wire_bytes, time.monotonic(), core.steps_applied
    stats = serve(
        core,
        transport,
        list(range(1, workers + 1)),
        shape_signature(model),
        evaluate=evaluate,
        eval_every_steps=cfg.eval_interval * workers,
        on_eval=on_eval,
        checkpoint=None if ckpt is None else (lambda c: save_server_state(c.state_dict(), ckpt)),
        checkpoint_every_steps=cfg.checkpoint_interval * workers,
        dead_after_s=cfg.dead_after_s,
        hung_after_min_s=cfg.hung_after_s,
        hung_after_factor=cfg.hung_after_factor,
        pull=PullEncoder(cfg.compress_pull),
    )
    wall = time.monotonic() - t0
    summary = {
        "workers": workers,
        "outer": cfg.outer,
        "method": cfg.method,
        "outer_lr": cfg.resolved_outer_lr(),
        "outer_momentum": cfg.resolved_outer_momentum(),
        "dylu": cfg.dylu,
        "inner_momentum": cfg.resolved_inner_momentum(),
        "compress": cfg.compress,
        "compress_pull": cfg.compress_pull,
        "sync": cfg.sync,
        "steps": core.steps_applied // workers,
        "inner_steps": core.steps_applied,
        "inner_steps_this_run": core.steps_applied - steps0,
        "updates_applied": core.updates_applied,
        "updates_rejected": core.updates_rejected,
        "updates_dropped": core.updates_dropped,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_time_s": wall,
        "comm_bytes": COUNTER.wire_bytes - sent0 + transport.bytes_received,
        "comm_by_op": COUNTER.snapshot(),
    }
    kept = ("dead_workers", "incarnations", "joins", "updates_by_incarnation")
    summary |= {k: stats[k] for k in (*kept, "stale_messages", "malformed_messages")}
    summary["push_bytes"] = stats["push_bytes"]  # pseudo-gradient payloads received
    summary["pull_bytes"] = summary["comm_by_op"].get("localsgd.pull", {}).get("payload_bytes", 0)
    if "val_loss" in stats:
        summary["final_val_loss"] = stats["val_loss"]
    return summary
