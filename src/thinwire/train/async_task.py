"""``--algo async-diloco``: the example trainer as one user of asynchronous Local-SGD.

The trainer hands :func:`thinwire.localsgd.run_async` its own pieces through the public
API, exactly as any user would: thinwire's GPT as the model factory, AdamW as the inner
optimizer, its text shards as batch sources, the GPT's cross-entropy as the loss and the
validation loss as the evaluation (:func:`gpt_task`). :func:`async_config` hands a
:class:`~thinwire.train.config.TrainConfig`'s Local-SGD section (the fields it shares with
:class:`~thinwire.localsgd.AsyncConfig`) and its run settings to the runtime. Around the
run it keeps what only the trainer has: the run identity in ``run.json``,
``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.io import atomic_write_text
from thinwire.localsgd import (
    AsyncConfig,
    AsyncSettings,
    IncompleteRunError,
    Task,
    rejoin_async,
    run_async,
)
from thinwire.localsgd.runtime.auth import read_token
from thinwire.localsgd.runtime.island import workers_of
from thinwire.localsgd.runtime.run_store import server_address
from thinwire.localsgd.runtime.trained import load_trained
from thinwire.localsgd.settings import STREAMING
from thinwire.train.checkpoint import check_run_identity, write_run_identity
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import CONFIG_NAME, write_config_file
from thinwire.train.data import TextData
from thinwire.train.metrics import MetricsWriter
from thinwire.train.model import GPT
from thinwire.train.outdir import read_summary
from thinwire.train.trainer import parameter_digest, pick_device

__all__ = [
    "async_config",
    "check_async_config",
    "gpt_loss",
    "gpt_task",
    "gpt_units",
    "rejoin",
    "run",
]


def async_config(cfg: TrainConfig) -> AsyncConfig:
    """The asynchronous Local-SGD settings of a trainer run: its Local-SGD section as it
    is (less Streaming DiLoCo's knobs, which only ``--algo diloco`` reads), and the run's
    budget, schedule, start and checkpoints."""
    section = {
        f.name: getattr(cfg, f.name) for f in fields(AsyncSettings) if f.name not in STREAMING
    }
    return AsyncConfig(
        **section,
        steps=cfg.steps,
        seed=cfg.seed,
        warmup_steps=cfg.warmup_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        grad_clip=cfg.grad_clip,
        pretrain_steps=cfg.pretrain_steps or 0,
        init_from=cfg.init_from,
        eval_interval=cfg.eval_interval,
        checkpoint_dir=cfg.out_dir,
        checkpoint_interval=cfg.checkpoint_interval,
        resume=cfg.resume,
        stop_after=cfg.stop_after,
        shard_within=cfg.shard_within,
    )


def check_async_config(cfg: TrainConfig, workers: int) -> None:
    """Every bad setting of an asynchronous trainer run, as a one-line ConfigError
    (a token given in the environment that is too short or unreadable included, and a
    server address that is not one of this host's, such as ``0.0.0.0``)."""
    cfg.validate()
    acfg = async_config(cfg)
    acfg.validate(workers)
    read_token(acfg.token_file)
    if not dist.is_initialized() or dist.get_rank() == 0:
        server_address(acfg.bind_addr)  # where rank 0 will listen; a worker's host differs


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The GPT's next-token cross-entropy on ``(inputs, targets)``."""
    x, y = batch
    return model(x, y)[1]


def gpt_task(
    cfg: TrainConfig, data: TextData | None = None, device: torch.device | None = None
) -> Task:
    """thinwire's GPT, AdamW, text shards and validation loss as a Local-SGD task.

    ``data``: a corpus to share between tasks (its seed draws the shards' batches);
    None reads ``cfg.data`` on first use. ``device``: where the models live (CPU).
    """
    gcfg = cfg.gpt_config()
    val: list[tuple[torch.Tensor, torch.Tensor]] = []

    @functools.cache
    def text() -> TextData:  # read on first use: a rejoin checks the address first
        return (
            data
            if data is not None
            else TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
        )

    def model() -> nn.Module:
        torch.manual_seed(cfg.seed)  # the same initial theta on every rank and every run
        return GPT(gcfg).to(device or "cpu")

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def shards(n: int) -> list[Any]:
        return list(text().shard_batches(n, cfg.batch_size, cfg.shard_layout))

    def evaluate(m: nn.Module) -> float:
        if not val:  # built on first use: only the server evaluates
            val.extend(text().val_batches(cfg.eval_sequences, cfg.batch_size))
        dev = next(m.parameters()).device
        total, n = 0.0, 0
        for x, y in val:
            total += float(gpt_loss(m, (x.to(dev), y.to(dev)))) * len(x)
            n += len(x)
        return total / max(n, 1)

    return Task(
        model=model,
        optimizer=optimizer,
        shards=shards,
        loss=gpt_loss,
        evaluate=evaluate,
        shard=gpt_units,
    )


def gpt_units(model: nn.Module, mesh: Any) -> None:
    """The GPT's FSDP2 units on an island's mesh: each transformer block, as in
    torchtitan (the root is made a unit by the runtime)."""
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh)


def _worker_device(cfg: TrainConfig) -> torch.device:
    device = pick_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Trainer runner for ``--algo async-diloco``; call on every rank of a process group.

    Returns the run summary on rank 0 (final validation loss and perplexity, updates
    applied and rejected, pushes refused, inner steps, samples/s, bytes, which worker
    incarnations pushed how much, and ``param_sha256``, the trained parameters' digest;
    also written to ``summary.json``) and the worker's
    counts elsewhere. Times and bytes cover the whole run, across resumes. A run whose
    every worker died returns its summary with ``incomplete`` set (the command exits
    non-zero; ``--resume`` finishes it); resuming a finished run returns its saved summary
    with a ``note`` and changes no file.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = workers_of(world, cfg.shard_within)
    check_async_config(cfg, workers)
    acfg = async_config(cfg)
    if rank != 0:
        return run_async(gpt_task(cfg, device=_worker_device(cfg)), acfg)
    out_dir = Path(cfg.out_dir)
    identity = {k: cfg.to_dict()[k] for k in cfg.IDENTITY} | {
        "workers": workers,
        "outer": cfg.outer,
    }
    writers: list[MetricsWriter] = []
    # Said before the pretraining, which may take hours: a fresh run's identity is kept
    # from the start (a stop in its pretraining is resumed), a resumed run's is checked.
    if cfg.resume and (out_dir / "run.json").is_file():
        check_run_identity(out_dir, identity)
    elif not cfg.resume:
        _write_identity(cfg, out_dir, identity)

    def on_start(resumed: int | None) -> None:
        if resumed is not None:
            check_run_identity(out_dir, identity)
        elif not (out_dir / "run.json").is_file():
            _write_identity(cfg, out_dir, identity)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port:  # what a restarted worker needs (--rejoin)
            print(f"thinwire: asynchronous run served at {addr}:{port}", file=sys.stderr)
        if resumed is None and cfg.resume:  # on from the pretraining's save: from step 0
            resumed = -1  # (what a stop after the pretraining had logged is dropped)
        if resumed is None or resumed < min(cfg.steps, cfg.stop_after or cfg.steps) * workers:
            writers.append(MetricsWriter(out_dir, True, resumed, cfg.tensorboard))

    def on_eval(record: dict[str, Any]) -> None:
        # "step" counts inner steps over all workers; samples as the trainer counts them
        for w in writers:
            w.write(record | {"samples": record["step"] * cfg.batch_size})

    try:
        s = run_async(gpt_task(cfg), acfg, on_start=on_start, on_eval=on_eval)
    except IncompleteRunError as exc:
        s = exc.summary | {
            "incomplete": f"{str(exc).split('; the', 1)[0]}; its checkpoint is kept: run the "
            "same command with --resume to finish it"
        }
    finally:
        for w in writers:
            w.close()
    if s.get("already_done"):
        saved = _saved_summary(out_dir, s["inner_steps"])
        if saved is not None:
            return saved | {
                "note": f"the run in {out_dir} already reached step {s['steps']}; nothing "
                "was changed (raise --steps to train further)"
            }
    summary = _summary(cfg, world, s)
    # The trained parameters' digest, as the synchronous trainer writes it: equal digests
    # mean bit-identical models (a --sync run stopped and resumed against one that never
    # stopped, two runs of one seed).
    summary["param_sha256"] = parameter_digest(load_trained(gpt_task(cfg).model(), s["theta"]))
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _write_identity(cfg: TrainConfig, out_dir: Path, identity: dict[str, Any]) -> None:
    """Keep what the run is (``run.json``) and its settings (``config.json``)."""
    write_run_identity(out_dir, identity)
    write_config_file(replace(cfg, resume=False), out_dir / CONFIG_NAME)


def _summary(cfg: TrainConfig, world: int, s: dict[str, Any]) -> dict[str, Any]:
    wall = s["train_time_s"]
    keys = ("workers", "outer", "dylu", "inner_momentum", "sync", "start", "steps", "complete")
    summary = {
        "algo": cfg.algo,
        "world_size": world,
        "shard_within": cfg.shard_within,
        **{k: s[k] for k in keys},
        "samples": s["inner_steps"] * cfg.batch_size,  # sequences trained on, all workers
        **{k: s[k] for k in ("inner_steps", "updates_applied", "updates_rejected")},
        **{k: s[k] for k in ("pushes_refused", "push_refusals")},
        **{k: s[k] for k in ("dead_workers", "evicted_workers", "incarnations", "joins")},
        "updates_by_incarnation": s["updates_by_incarnation"],
        **{k: s[k] for k in ("stale_messages", "malformed_messages", "parameters")},
        **{k: s[k] for k in ("unauthenticated_messages", "refused_rejoins")},
        "final_val_loss": s.get("final_val_loss", math.nan),
        "final_val_ppl": math.exp(min(s.get("final_val_loss", math.nan), 50.0)),
        "train_time_s": wall,  # the whole run's, across resumes
        "samples_per_s": s["inner_steps"] * cfg.batch_size / wall if wall > 0 else math.nan,
        "comm_bytes": s["comm_bytes"],
        "comm_by_op": s["comm_by_op"],
        "push_bytes": s["push_bytes"],
        "pull_bytes": s["pull_bytes"],
        **{k: s[k] for k in ("method", "outer_lr", "outer_momentum", "updates_dropped")},
        "out_dir": str(cfg.out_dir),
    }
    for key in ("stopped_after", "incomplete"):
        if key in s:
            summary[key] = s[key]
    return summary


def _saved_summary(out_dir: Path, inner_steps: int) -> dict[str, Any] | None:
    """The summary a finished run wrote, if it is that run's (same inner steps)."""
    saved = read_summary(out_dir)  # read with a limit; unreadable means rebuilt
    if saved is None or type(saved.get("inner_steps")) is not int:
        return None
    if saved["inner_steps"] != inner_steps:
        return None
    saved["out_dir"] = str(out_dir)  # where the run is now, if it was moved
    return saved


def rejoin(
    cfg: TrainConfig,
    rank: int,
    *,
    host: str | None = None,
    port: int | str | None = None,
    connect_timeout_s: float | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """``thinwire train ... --rejoin RANK``: worker ``rank`` of a running trainer run comes
    back in this process (see :func:`thinwire.localsgd.rejoin_async`); ``force``
    (``--force-rejoin``) replaces it even if the server considers it alive."""
    cfg.validate()
    acfg = async_config(cfg)
    if connect_timeout_s is not None:
        acfg = replace(acfg, connect_timeout_s=connect_timeout_s)
    task = gpt_task(cfg, device=_worker_device(cfg))
    return rejoin_async(task, acfg, rank, host=host, port=port, force=force)
