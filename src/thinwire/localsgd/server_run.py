"""Rank 0 of an asynchronous Local-SGD run: the server with its model, data, checkpoints
and metrics around the serving loop (:func:`thinwire.localsgd.async_runtime.serve`).

:func:`run_server` builds the global model and the shards, restores the server's state
with ``--resume`` (or refuses to overwrite another run's), evaluates and checkpoints on
the run's intervals, and writes ``summary.json``: final validation loss, updates
applied and rejected, worker incarnations, samples/s and bytes.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from thinwire.comm.accounting import COUNTER
from thinwire.errors import ConfigError
from thinwire.localsgd.async_runtime import evaluate_theta, serve, shape_signature
from thinwire.localsgd.inner_state import resolve_inner_momentum
from thinwire.localsgd.server import ServerCore
from thinwire.localsgd.transport import Transport

__all__ = ["run_server"]


def run_server(cfg: Any, transport: Transport, workers: int) -> dict[str, Any]:
    from thinwire.train.checkpoint import (
        atomic_save,
        check_run_identity,
        safe_load,
        write_run_identity,
    )
    from thinwire.train.data import TextData
    from thinwire.train.metrics import MetricsWriter, atomic_write_text
    from thinwire.train.model import GPT

    world = workers + 1
    extra = cfg.extra
    gcfg = cfg.gpt_config()
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    data = TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
    shards = data.shards(int(extra.get("shards", workers)))

    out_dir = Path(cfg.out_dir)
    identity = {k: cfg.to_dict()[k] for k in cfg.IDENTITY} | {
        "workers": workers,
        "outer": cfg.outer,
    }
    core = ServerCore(
        parameters_to_vector(model.parameters()), workers=workers, local_steps=cfg.local_steps,
        total_steps=cfg.steps * workers, shard_sizes=[len(s) for s in shards], outer=cfg.outer,
        outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, c=float(extra.get("c", 0.0)),
        dylu=cfg.dylu, grace_s=float(extra.get("grace_s", 0.0)), sync=bool(extra.get("sync")),
        dylu_ema=float(extra.get("dylu_ema", 0.5)),
    )  # fmt: skip
    ckpt_path = out_dir / "localsgd_server.pt"
    resume_step = None
    if cfg.resume:
        check_run_identity(out_dir, identity)
        core.load_state_dict(safe_load(ckpt_path))
        resume_step = core.steps_applied
    else:
        if ckpt_path.exists():
            raise ConfigError(
                f"output directory {out_dir} already holds an asynchronous run; pass --resume "
                "to continue it or choose another --out"
            )
        write_run_identity(out_dir, identity)
    metrics = MetricsWriter(out_dir, True, resume_step, cfg.tensorboard)
    batches = data.val_batches(cfg.eval_sequences, cfg.batch_size)
    sent0, t0 = COUNTER.wire_bytes, time.monotonic()
    steps0 = core.steps_applied
    try:
        stats = serve(
            core, transport, list(range(1, world)), shape_signature(model),
            evaluate=lambda theta: evaluate_theta(model, theta, batches),
            eval_every_steps=cfg.eval_interval * workers, on_eval=metrics.write,
            checkpoint=lambda c: atomic_save(c.state_dict(), ckpt_path),
            checkpoint_every_steps=cfg.checkpoint_interval * workers,
            dead_after_s=float(extra.get("dead_after_s", 10.0)),
        )  # fmt: skip
    finally:
        metrics.close()
    wall = time.monotonic() - t0
    trained = (core.steps_applied - steps0) * cfg.batch_size
    summary = {
        "algo": cfg.algo,
        "world_size": world,
        "workers": workers,
        "outer": cfg.outer,
        "dylu": cfg.dylu,
        "inner_momentum": resolve_inner_momentum(cfg.inner_momentum, cfg.dylu),
        "sync": bool(extra.get("sync")),
        "steps": core.steps_applied // workers,
        "samples": core.steps_applied * cfg.batch_size,  # sequences trained on, all workers
        "inner_steps": core.steps_applied,
        "updates_applied": core.updates_applied,
        "updates_rejected": core.updates_rejected,
        "dead_workers": stats["dead_workers"],
        "incarnations": stats["incarnations"],
        "joins": stats["joins"],
        "updates_by_incarnation": stats["updates_by_incarnation"],
        "stale_messages": stats["stale_messages"],
        "parameters": model.num_parameters(),
        "final_val_loss": stats["val_loss"],
        "final_val_ppl": math.exp(min(stats["val_loss"], 50.0)),
        "train_time_s": wall,
        "samples_per_s": trained / wall if wall > 0 else float("nan"),
        "comm_bytes": COUNTER.wire_bytes - sent0 + transport.bytes_received,
        "comm_by_op": COUNTER.snapshot(),
        "out_dir": str(out_dir),
    }
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
