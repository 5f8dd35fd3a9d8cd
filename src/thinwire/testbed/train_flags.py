"""A :class:`~thinwire.train.config.TrainConfig` as the ``thinwire train`` command line
that runs it on every testbed host.

The testbed starts ``thinwire train`` unchanged on each emulated host, so a config
travels as flags. Every field either has its flag here or is refused when it differs
from its default: a field dropped on the way would silently train something else than
the caller asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from thinwire.errors import ConfigError
from thinwire.train.config import TrainConfig

__all__ = ["train_argv"]

# TrainConfig field -> ``thinwire train`` flag (None: a boolean switch handled below).
_FLAGS: dict[str, str] = {
    "algo": "--algo",
    "model": "--model",
    "seq_len": "--seq-len",
    "n_layer": "--n-layer",
    "n_head": "--n-head",
    "n_embd": "--n-embd",
    "data": "--data",
    "seed": "--seed",
    "steps": "--steps",
    "stop_after": "--stop-after",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "warmup_steps": "--warmup-steps",
    "weight_decay": "--weight-decay",
    "grad_clip": "--grad-clip",
    "freeze_step": "--freeze-step",
    "freeze_cap": "--freeze-cap",
    "freeze_tolerance": "--freeze-tolerance",
    "grad_dtype": "--grad-dtype",
    "local_steps": "--local-steps",
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "outer": "--outer",
    "compress": "--compress",
    "inner_momentum": "--inner-momentum",
    "grace_s": "--grace",
    "shards": "--shards",
    "staleness": "--staleness",
    "max_staleness": "--max-staleness",
    "calibration_steps": "--calibration-steps",
    "min_local_steps": "--min-local-steps",
    "shard_sampling": "--shard-sampling",
    "shard_layout": "--shard-layout",
    "compress_pull": "--compress-pull",
    "eval_interval": "--eval-interval",
    "eval_sequences": "--eval-sequences",
    "log_interval": "--log-interval",
    "checkpoint_interval": "--checkpoint-interval",
    "device": "--device",
}
# Fields the command line cannot carry: refused when they differ from the default,
# rather than silently training something else than the caller asked for.
# That includes the asynchronous Local-SGD settings without a flag.
_NO_FLAG = (
    "min_lr_ratio",
    "betas",
    "resume",
    "tensorboard",
    "c",
    "dylu_ema",
    "dead_after_s",
    "connect_timeout_s",
    "link_timeout_s",
)


def train_argv(
    cfg: TrainConfig, out_dir: Path, extra_args: Sequence[str] | None = None
) -> list[str]:
    """The ``python -m thinwire train ...`` command line that runs ``cfg`` into ``out_dir``."""
    default = TrainConfig()
    for name in _NO_FLAG:
        if getattr(cfg, name) != getattr(default, name):
            raise ConfigError(
                f"TrainConfig.{name} cannot be passed to 'thinwire train' on the testbed"
            )
    argv = [sys.executable, "-m", "thinwire", "train"]
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        # lr always: 'thinwire train' would otherwise pick its per-algorithm default
        explicit = f.name == "lr" or value != getattr(default, f.name)
        if f.name in _FLAGS and value is not None and explicit:
            argv += [_FLAGS[f.name], str(value)]
    if cfg.extra:
        raise ConfigError(
            f"TrainConfig.extra[{sorted(cfg.extra)[0]!r}] cannot be passed to 'thinwire train' "
            "on the testbed"
        )
    if cfg.sync:
        argv.append("--sync")
    if cfg.dylu:
        argv.append("--dylu")
    if cfg.precondition is not None:
        argv.append("--precondition" if cfg.precondition else "--no-precondition")
    if cfg.slowdown is not None:
        argv += ["--slowdown", ",".join(f"{v:g}" for v in cfg.slowdown)]
    if cfg.speeds is not None:
        argv += ["--speeds", ",".join(f"{v:g}" for v in cfg.speeds)]
    return [*argv, "--out", str(out_dir), "--no-progress", *(extra_args or [])]
