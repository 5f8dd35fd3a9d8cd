"""Rank 0's process in an asynchronous Local-SGD run: the server around its loop.

:func:`run_server` builds the global model from the user's factory, cuts the shard book
from the user's batch sources, restores the server's state when resuming (or refuses to
overwrite another run's checkpoint, :func:`_restore`), serves
(:func:`~thinwire.localsgd.runtime.server_loop.serve`) with evaluation and checkpoints on the
configured intervals, and returns the run's summary: evaluation, updates applied and
rejected, worker incarnations, bytes, and the trained parameters (``theta``, which
:func:`~thinwire.localsgd.runtime.trained.load_trained` loads into a model).

The launch itself is one :class:`ServerRun`: the model and core it serves, what it
restored, and the clock and bytes it started from. It turns the configuration into the
loop's :class:`~thinwire.localsgd.runtime.server_loop.ServeSettings` (:meth:`ServerRun.settings`),
is the loop's checkpoint hook (:meth:`ServerRun.save`), and builds the summary from the
core and the loop's counters (:meth:`ServerRun.summary`: the run's settings, its
progress, its clock and bytes, then the loop's counters), which
:meth:`ServerRun.finish` completes with the final evaluation and how the run ended.

Checkpoint: ``checkpoint_dir/localsgd_server.pt`` holds only tensors, numbers and
strings, written to a temporary file and renamed into place, and read back with
``torch.load(weights_only=True)``, which executes nothing from the file. Besides the
server core's state it keeps the run's clock and bytes so far (``run``), so that the
summary and the evaluation times of a resumed run cover the whole run.

How a run ends, in the summary:

* ``complete``: the whole budget (``steps * W`` inner steps) was trained.
* ``stopped_after``: this launch stopped at ``stop_after`` as asked, with a checkpoint;
  a resume continues it.
* Otherwise every worker died (or was evicted) before the budget was met: the server
  checkpoints what it has and raises :class:`IncompleteRunError`, whose ``summary``
  says so; a resume finishes the run.
* ``already_done``: a resume found the budget already met. Nothing is trained, evaluated
  into ``on_eval`` or written; the workers are told to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
from thinwire.io import atomic_save
from thinwire.localsgd.algorithm.compression import PullEncoder
from thinwire.localsgd.algorithm.norm_stats import NormStats, load_norm_state_
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.runtime.auth import remove_token_file, write_token_file
from thinwire.localsgd.runtime.server_loop import ServeSettings, serve
from thinwire.localsgd.runtime.transport import Transport
from thinwire.localsgd.task import (
    Task,
    flat_parameters,
    load_flat_,
    make_sources,
    metrics_at,
    shape_signature,
    shard_sizes,
)
from thinwire.safeload import safe_load

__all__ = [
    "PRETRAIN_CHECKPOINT",
    "SERVER_CHECKPOINT",
    "IncompleteRunError",
    "ServerRun",
    "load_server_state",
    "refuse_existing",
    "run_server",
    "save_server_state",
]

SERVER_CHECKPOINT = "localsgd_server.pt"
"""The server's checkpoint file in :attr:`AsyncConfig.checkpoint_dir`."""

PRETRAIN_CHECKPOINT = "localsgd_pretrain.pt"
"""The run's pretraining as it goes, beside it (:mod:`thinwire.localsgd.runtime.pretraining`);
removed once the server's checkpoint lands."""

Evaluate = Callable[[torch.Tensor], dict[str, float]]
"""The server's evaluation of a theta: ``val_loss`` first, then any other metrics."""


class IncompleteRunError(RuntimeError):
    """Every worker died (or was evicted) before the run's budget was trained. The
    checkpoint holds what was done (resume to finish); :attr:`summary` is the run's
    summary, marked ``complete: False``."""

    def __init__(self, message: str, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


def save_server_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a temporary file, fsync, then rename over ``path``: a crash
    mid-write leaves the previous checkpoint intact."""
    atomic_save(state, path)


def load_server_state(path: Path) -> dict[str, Any]:
    """The server state saved at ``path``; a one-line ConfigError if missing or damaged."""
    if not path.exists():
        raise ConfigError(f"checkpoint file {path} is missing: nothing to resume")
    state = safe_load(path)  # plain data only: a planted pickle runs nothing
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
    token_to_keep: bytes | None = None,
) -> dict[str, Any]:
    """Serve ``workers`` workers (ranks 1..W) until the budget is spent; the summary.

    ``on_start(resumed_steps)`` runs once the checkpoint (if any) is restored and before
    the first message: ``resumed_steps`` is the inner steps restored, None for a fresh
    run. ``on_eval(record)`` receives every evaluation record. ``token_to_keep``: a token
    rank 0 generated, kept in ``checkpoint_dir/run.token`` (mode 0600) while the run is
    served, for workers that rejoin on this host.

    Raises:
        IncompleteRunError: every worker was gone before the budget was met.
    """
    model = task.model()
    sources = make_sources(task, cfg.resolved_shards(workers))
    norms = NormStats(model, sources, task.loss, cfg.norm_batches)
    norms.warn()
    core = ServerCore.from_config(flat_parameters(model), cfg, workers, shard_sizes(sources))
    ckpt = Path(cfg.checkpoint_dir) / SERVER_CHECKPOINT if cfg.checkpoint_dir else None
    resumed, before = _restore(core, cfg, ckpt, norms)
    _stop_after(core, cfg, workers)
    idle = resumed is not None and core.steps_applied >= core.total_steps
    if on_start is not None:
        on_start(resumed)
    evaluate = _evaluator(task, norms, core)
    run = ServerRun(cfg, workers, norms, core, transport, ckpt, before, idle, evaluate)
    if token_to_keep is not None and cfg.checkpoint_dir:
        write_token_file(cfg.checkpoint_dir, token_to_keep)
    try:
        ranks = list(range(1, workers + 1))
        stats = serve(core, transport, ranks, shape_signature(model), run.settings(on_eval))
    finally:
        if token_to_keep is not None and cfg.checkpoint_dir:
            remove_token_file(cfg.checkpoint_dir)
    return run.finish(stats)


def _restore(
    core: ServerCore, cfg: AsyncConfig, ckpt: Path | None, norms: NormStats
) -> tuple[int | None, dict[str, Any]]:
    """Restore ``core`` (and the model's normalization statistics) from ``ckpt`` when
    resuming (or refuse to overwrite another run's checkpoint); the inner steps restored
    (None: a fresh run) and the earlier launches' clock and bytes (``elapsed_s``,
    ``comm_bytes``)."""
    resumed, before = None, {"elapsed_s": 0.0, "comm_bytes": 0}
    if cfg.resume and ckpt is not None:
        state = load_server_state(ckpt)
        core.load_state_dict(state)
        if state.get("norm_stats") and norms.active:
            # theta's own statistics, as saved with it: nothing to recompute until it moves
            load_flat_(list(norms.model.parameters()), core.theta.detach())
            load_norm_state_(norms.model, state["norm_stats"])
            norms.mark(core.version)
        resumed = core.steps_applied
        before |= state.get("run", {})
    elif ckpt is not None:
        refuse_existing(ckpt)
        ckpt.parent.mkdir(parents=True, exist_ok=True)
    return resumed, before


def refuse_existing(ckpt: Path) -> None:
    """A fresh run does not overwrite another: a one-line ConfigError when ``ckpt`` (the
    server's checkpoint, or its pretraining's save) is there."""
    if ckpt.exists():
        what = "an asynchronous run" + (
            "'s pretraining" if ckpt.name == PRETRAIN_CHECKPOINT else ""
        )
        raise ConfigError(
            f"{ckpt.parent} already holds {what} ({ckpt.name}); resume it or choose another "
            "checkpoint directory"
        )


def _stop_after(core: ServerCore, cfg: AsyncConfig, workers: int) -> None:
    """End this launch at ``cfg.stop_after`` steps per worker, if set."""
    if cfg.stop_after is not None:
        if core.steps_applied > cfg.stop_after * workers:
            raise ConfigError(
                f"the checkpoint is at {core.steps_applied // workers} steps per worker, past "
                f"stop_after {cfg.stop_after}"
            )
        core.end_at(cfg.stop_after * workers)


def _evaluator(task: Task, norms: NormStats, core: ServerCore) -> Evaluate | None:
    """``task.evaluate`` of theta loaded into the server's model, its normalization
    statistics recomputed for it; None if the task has none."""
    if task.evaluate is None:
        return None
    metric = task.evaluate

    def evaluate_theta(theta: torch.Tensor) -> dict[str, float]:
        return metrics_at(norms.model, theta, metric, lambda _: norms.refresh(core.version))

    return evaluate_theta


_FROM_LOOP = (
    "dead_workers",
    "evicted_workers",
    "incarnations",
    "joins",
    "updates_by_incarnation",
    "stale_messages",
    "malformed_messages",
    "unauthenticated_messages",
    "refused_rejoins",
    "push_bytes",  # pseudo-gradient payloads received
)
"""The summary's keys taken as they are from :func:`serve`'s counters, in order."""


@dataclass
class ServerRun:
    """This launch of rank 0: the model and core it serves, what it restored, and the
    clock and bytes it started from. Checkpoints (:meth:`save`) and the summary
    (:meth:`summary`, :meth:`finish`) are built from it."""

    cfg: AsyncConfig
    workers: int
    norms: NormStats
    """The server's model (:attr:`NormStats.model`) and its normalization statistics."""
    core: ServerCore
    transport: Transport
    ckpt: Path | None
    """The server's checkpoint file (None: no checkpoint directory, nothing kept)."""
    before: dict[str, Any]
    """Earlier launches' clock and bytes (``elapsed_s``, ``comm_bytes``)."""
    idle: bool
    """A resume found the budget already met: nothing is trained, evaluated or written."""
    evaluate: Evaluate | None
    sent0: int = field(init=False)
    """Bytes this process had sent when the launch began serving."""
    t0: float = field(init=False)
    """When the launch began serving (``time.monotonic``)."""
    steps0: int = field(init=False)
    """Inner steps applied when the launch began serving (restored ones)."""

    def __post_init__(self) -> None:
        self.sent0, self.t0, self.steps0 = (
            COUNTER.wire_bytes,
            time.monotonic(),
            self.core.steps_applied,
        )

    def totals(self) -> dict[str, Any]:
        # The whole run's clock and bytes: earlier launches' plus this one's.
        return {
            "elapsed_s": self.before["elapsed_s"] + time.monotonic() - self.t0,
            "comm_bytes": int(self.before["comm_bytes"])
            + COUNTER.wire_bytes
            - self.sent0
            + self.transport.bytes_received,
        }

    @property
    def model(self) -> torch.nn.Module:
        return self.norms.model

    def norm_stats(self) -> dict[str, Any]:
        """``{"norm_stats": ...}``, theta's normalization statistics (recomputed if theta
        moved since they last were), for a checkpoint or the summary; ``{}`` without
        such layers."""
        if not self.norms.active:
            return {}
        if not self.norms.holds(self.core.version):  # else theta is in the model already
            load_flat_(list(self.model.parameters()), self.core.theta.detach())
            self.norms.refresh(self.core.version)
        return {"norm_stats": self.norms.state()}

    def save(self, core: ServerCore) -> None:
        """The checkpoint hook: ``core``'s state, theta's normalization statistics and
        the run's totals, to :attr:`ckpt`."""
        assert self.ckpt is not None
        state = core.state_dict() | self.norm_stats() | {"run": self.totals()}
        save_server_state(state, self.ckpt)
        # The pretraining is in theta now: its save only takes space (3x the model).
        (self.ckpt.parent / PRETRAIN_CHECKPOINT).unlink(missing_ok=True)

    def settings(self, on_eval: Callable[[dict[str, Any]], None] | None) -> ServeSettings:
        """How :func:`serve` runs this launch, from :attr:`cfg`."""
        cfg, workers = self.cfg, self.workers
        return ServeSettings(
            evaluate=None if self.idle else self.evaluate,
            eval_every_steps=cfg.eval_interval * workers,
            on_eval=on_eval,
            checkpoint=None if self.ckpt is None or self.idle else self.save,
            checkpoint_every_steps=cfg.checkpoint_interval * workers,
            dead_after_s=cfg.dead_after_s,
            hung_after_min_s=cfg.hung_after_s,
            hung_after_factor=cfg.hung_after_factor,
            elapsed_s=self.before["elapsed_s"],
            pull=PullEncoder(cfg.compress_pull),
        )

    def summary(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The run's summary from the core and ``stats`` (:func:`serve`'s counters),
        before the final evaluation and how the run ended."""
        run = self.before if self.idle else self.totals()
        summary = _settings_summary(self.cfg, self.workers) | self._progress()
        summary |= {
            "train_time_s": run["elapsed_s"],
            "comm_bytes": int(run["comm_bytes"]),
            "comm_by_op": COUNTER.snapshot(),
            # The global parameters as they end (the ones the final evaluation saw and the
            # final checkpoint holds): the trained model, for load_trained. No copy: nothing
            # changes theta once serving has ended.
            "theta": self.core.theta.detach(),
        }
        summary |= self.norm_stats()
        summary |= {k: stats[k] for k in _FROM_LOOP}
        pulled = summary["comm_by_op"].get("localsgd.pull", {})
        summary["pull_bytes"] = pulled.get("payload_bytes", 0)
        return summary

    def _progress(self) -> dict[str, Any]:
        """The summary's steps, updates and refusals."""
        core, workers = self.core, self.workers
        return {
            "steps": core.steps_applied // workers,
            "inner_steps": core.steps_applied,
            "inner_steps_this_run": core.steps_applied - self.steps0,
            "planned_inner_steps": core.planned_steps,
            "complete": core.steps_applied >= core.planned_steps,
            "updates_applied": core.updates_applied,
            "updates_rejected": core.updates_rejected,
            "pushes_refused": core.pushes_refused,
            "push_refusals": dict(core.guard.refused),
            "updates_dropped": core.updates_dropped,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def finish(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The summary, with the final evaluation and how the run ended (``already_done``,
        ``stopped_after``); raises :class:`IncompleteRunError` if every worker is gone."""
        core, workers = self.core, self.workers
        summary = self.summary(stats)
        if self.idle:
            summary["already_done"] = True
            if self.evaluate is not None:
                metrics = self.evaluate(core.theta.detach())
                summary["final_val_loss"], summary["final_metrics"] = metrics["val_loss"], metrics
            return summary
        if "val_loss" in stats:
            summary["final_val_loss"] = stats["val_loss"]
            summary["final_metrics"] = stats["metrics"]
        if not summary["complete"] and core.steps_applied >= core.total_steps:
            summary["stopped_after"] = core.steps_applied // workers
        elif not summary["complete"]:
            gone = ", ".join(str(w) for w in stats["dead_workers"])
            raise IncompleteRunError(
                f"the run is incomplete: every worker is gone (dead or stopped: {gone}) after "
                f"{core.steps_applied // workers} of {self.cfg.steps} steps per worker; "
                + (
                    "the checkpoint keeps them: resume to finish it"
                    if self.ckpt
                    else "no checkpoint was kept"
                ),
                summary | {"incomplete": "every worker is gone"},
            )
        return summary


def _settings_summary(cfg: AsyncConfig, workers: int) -> dict[str, Any]:
    """The summary's account of how the run was set up."""
    return {
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
        "start": cfg.start().describe(),
    }
