"""Launch the example trainer: under torchrun, in this process, or on spawned workers.

:func:`run_training` is the one launch policy every driver shares (``thinwire train``,
the comparisons, the tests): it validates the whole config and the input files first, so
a bad option or an unreadable corpus fails once, in the caller, before any process
starts; then it picks the launch:

* under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) this process joins the existing group
  and ``workers`` is ignored;
* with one worker the trainer runs here, with no process group;
* otherwise ``workers`` gloo ranks (nccl with ``device="cuda"``) are spawned on loopback.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from thinwire.comm.launch import init_from_env, launched_by_torchrun, spawn
from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir
from thinwire.train.algorithms import check_algorithm, check_config
from thinwire.train.config import TrainConfig
from thinwire.train.data import load_text

__all__ = ["run_training"]


def _rank_main(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    from thinwire.train.trainer import train

    return train(cfg)


def run_training(cfg: TrainConfig, workers: int, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Validate, then train under torchrun, in-process (1 worker) or on spawned workers.

    Returns rank 0's run summary. ``timeout_s`` bounds the whole run: a stuck rank is
    stopped after it rather than hanging the caller.
    """
    cfg.validate()
    check_algorithm(cfg.algo)
    if launched_by_torchrun():
        from thinwire.train.trainer import train

        check_config(cfg, int(os.environ["WORLD_SIZE"]))  # every rank: all raise together

        created = not dist.is_initialized()  # a group the caller made is left as it is
        init_from_env(timeout_s=timeout_s)
        try:
            return train(cfg)
        finally:
            if created:
                dist.destroy_process_group()
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    check_config(cfg, workers)
    load_text(cfg.data)  # a bad data file fails here, before any process starts
    writable_dir(cfg.out_dir)  # so does an output directory that cannot be written
    if workers == 1:
        from thinwire.train.trainer import train

        return train(cfg)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    # Asynchronous Local-SGD outlives its workers (rank 0 serves the others): a worker
    # that dies or is killed must not take the launcher, and with it the run, down.
    may_fail = range(1, workers) if cfg.algo == "async-diloco" else ()
    return spawn(
        _rank_main, workers, (cfg,), backend=backend, timeout_s=timeout_s, may_fail=may_fail
    )[0]
