"""Time a 1-bit optimizer's step after the recorded job's own forward and backward passes.

:func:`thinwire.analysis.optimizer_step.time_optimizer_step` times the step on the
record's parameter sizes, with arithmetic standing in for the passes. On the demo's
testbed (4 hosts sharing 2 cores) that stand-in biased the step: its update came out
1.7x and its exchange's wait 1.9x what the 1-bit run's own record showed, and the
prediction missed by +17% on 40 timed steps. Arithmetic on a 128 x 128 block does not
crowd the cores, the caches or the allocator as the model's passes do.

When the record is a ``thinwire train`` run (its directory holds ``config.json``), this
module rebuilds the job itself: the same model, data, batch size and algorithm settings,
under the same DDP wrapper ``thinwire train`` would use for ``algo``. Every timed step
is then a real training step of the job: forward and backward on the rank's batch, the
gradient clipping, and the optimizer's compressed step, timed with its exchange and
waits. The model starts from the run's newest checkpoint (:func:`trained_weights`), at
the lr its schedule had there: the job as its compressed steps will find it, not a fresh
model whose gradients still change fast.

Tuning: as for the stand-in, ``warmup`` (3) covers the uncompressed steps
(``freeze_step=2``) and the buffers' allocation, untimed steps go on until the exchange
has tuned its piece count (:func:`~thinwire.analysis.optimizer_step.timed_steps`), and
``iters`` (10) steps are timed. A sharded run (``shard_within``) is not rebuilt: its
optimizer averages across islands only, which the stand-in times on the full layout.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from thinwire.analysis.optimizer_step import timed_steps
from thinwire.errors import ConfigError

__all__ = ["job_config", "time_on_job_passes", "trained_weights"]

CONFIG_NAME = "config.json"


def job_config(record: str | Path) -> Path | None:
    """The ``config.json`` beside a record (its run directory, or its ``record.jsonl``)
    when it is an unsharded ``thinwire train`` run that can be rebuilt; None otherwise."""
    import json

    from thinwire.train.config import TrainConfig

    path = Path(record)
    run_dir = path if path.is_dir() else path.parent
    config = run_dir / CONFIG_NAME
    if not config.is_file():
        return None
    try:
        cfg = TrainConfig.from_dict(json.loads(config.read_text()))
    except (ValueError, TypeError, ConfigError):
        return None  # not a config this version can rebuild: the stand-in times it
    return config if cfg.shard_within <= 1 else None


def time_on_job_passes(
    algo: str, config: str | Path, warmup: int = 3, iters: int = 10
) -> list[dict[str, float]]:
    """Time ``iters`` compressed steps of ``algo`` on the job ``config`` describes, each
    after the job's own forward and backward passes, on every rank of the initialized
    process group at once; every rank returns its own steps (``step_s``,
    ``exchange_s``, ``wait_s``, ``passes_s``)."""
    import json

    from thinwire.train.algorithms import make_strategy
    from thinwire.train.config import TrainConfig
    from thinwire.train.data import TextData
    from thinwire.train.model import GPT
    from thinwire.train.trainer import lr_at, pick_device

    if warmup < 2 or iters < 1:
        raise ConfigError(
            f"bench optimizer: need warmup >= 2 and iters >= 1, got {warmup}, {iters}"
        )
    job = TrainConfig.from_dict(json.loads(Path(config).read_text()))
    # freeze at 2: the warmup's third step is the first compressed one (it allocates
    # the error-feedback buffers); no automatic rule, no record; the run's checkpoint,
    # not its start file, gives the weights
    cfg = replace(job, algo=algo, freeze_step=2, record=False, init_from=None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = pick_device(cfg)
    gcfg = cfg.gpt_config()
    data = TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    start = trained_weights(model, Path(config).parent)
    model.to(device)
    strategy = make_strategy(model, cfg)
    model.train()

    def passes(k: int) -> None:
        # the job's schedule and batches from its checkpoint's step on; from step 0 the
        # lr warmup keeps a fresh model from outgrowing the variance frozen at step 2
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr_at(start + k, cfg)
        x, y = data.batch(start + k, cfg.batch_size, rank, world)
        _, loss = strategy.model(x.to(device), y.to(device))
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)

    return timed_steps(algo, strategy.optimizer, passes, warmup, iters)


def trained_weights(model: torch.nn.Module, run_dir: Path) -> int:
    """Put the run's newest checkpoint's weights into ``model`` when this rank can read
    them; returns its step (0: none here, the seed's initialization stays)."""
    from thinwire.train import checkpoint as ckpt

    try:
        step = ckpt.latest_step(run_dir)
        if step is None:
            return 0
        ckpt.restore_model(model, run_dir, step, ckpt.read_run_id(run_dir))
        return step
    except ConfigError:
        return 0  # unreadable here (another host's disk, another version): timing only
