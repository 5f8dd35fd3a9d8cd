"""The trained model back from an asynchronous Local-SGD run.

Rank 0's :func:`~thinwire.localsgd.run_async` summary carries ``theta``: the server's
global parameters as the run ends, one flat fp32 vector in the order of the model's
``parameters()``. They are the parameters the final evaluation scored
(``final_val_loss``, ``final_metrics``) and the server's last checkpoint holds, whether
the run was fresh, resumed, or resumed after its budget was already met.
:func:`load_trained` copies them into a module built by the task's model factory::

    summary = run_async(task, cfg)            # on every rank
    if rank == 0:                             # the rank function's rank, or $RANK
        model = load_trained(task.model(), summary)
        model.save_pretrained("out/model")    # a Hugging Face model, say; or torch.save

The same parameters are in ``cfg.checkpoint_dir`` when the run kept one, so another
process (after torchrun has exited, on another machine) loads them from there::

    model = load_trained(make_model(), "runs/async")   # reads runs/async/localsgd_server.pt

A model with normalization layers (BatchNorm) also gets theta's running statistics,
which the server recomputed for it (``norm_stats`` in the summary and the checkpoint;
:mod:`thinwire.localsgd.algorithm.norm_stats`). Given ``theta`` alone, its statistics
stay as they were.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.norm_stats import load_norm_state_
from thinwire.localsgd.runtime.server_process import SERVER_CHECKPOINT, load_server_state
from thinwire.localsgd.task import load_flat_

__all__ = ["load_trained"]

M = TypeVar("M", bound=nn.Module)


def load_trained(model: M, source: Mapping[str, Any] | torch.Tensor | str | os.PathLike[str]) -> M:
    """Copy the server's final parameters of an asynchronous run into ``model``; return it.

    Args:
        model: a module of the run's shapes, e.g. a fresh ``task.model()``; its
            parameters (and normalization statistics, where the source has them) are
            overwritten in place, each keeping its dtype and device.
        source: where the parameters are: rank 0's ``run_async`` summary (or an
            :class:`~thinwire.localsgd.IncompleteRunError`'s ``summary``: what was
            trained before every worker was gone), its ``theta`` tensor itself, or the
            run's ``checkpoint_dir`` (or the ``localsgd_server.pt`` in it).

    Returns:
        ``model``, for chaining (``load_trained(task.model(), summary).eval()``).

    Raises:
        ConfigError: one line: a summary without ``theta`` (a worker's result: only
            rank 0 has the model), a missing or foreign checkpoint, or parameters of
            another size than the model's.
    """
    stats: Mapping[str, torch.Tensor] = {}
    if isinstance(source, torch.Tensor):
        theta = source
    elif isinstance(source, Mapping):
        if "theta" not in source:
            raise ConfigError(
                "this result has no 'theta': only rank 0's run_async summary carries the "
                "trained parameters (a worker's result does not)"
            )
        theta, stats = source["theta"], source.get("norm_stats") or {}
    else:
        path = Path(source)
        path = path / SERVER_CHECKPOINT if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(
                f"no asynchronous run's checkpoint at {path}: give the run's checkpoint_dir "
                "(a run without one gives its model back only in rank 0's summary)"
            )
        state = load_server_state(path)
        theta, stats = state["theta"], state.get("norm_stats") or {}
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    if not isinstance(theta, torch.Tensor) or theta.numel() != numel:
        got = theta.numel() if isinstance(theta, torch.Tensor) else type(theta).__name__
        raise ConfigError(
            f"the trained parameters hold {got} numbers, the model has {numel}: build the "
            "model the way the run's model factory does"
        )
    # Copies, not views: load_flat_ keeps the model's own storage, dtypes and devices.
    load_flat_(params, theta.detach().reshape(-1))
    load_norm_state_(model, stats)
    return model
