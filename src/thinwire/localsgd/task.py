"""What a user hands asynchronous Local-SGD: their model, optimizer, data, loss and metric.

A :class:`Task` holds five pieces, all plain callables, so any ``nn.Module`` trains::

    task = Task(
        model=lambda: MyNet(),                                   # same shapes on every rank
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        shards=lambda n: [MyShard(i, n) for i in range(n)],      # n batch sources
        loss=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
        evaluate=lambda model: my_validation_loss(model),        # optional, on the server
    )

Contracts the runtime relies on:

* ``model()`` is called once per process (the server's model, each worker's replica).
  The server's initial parameters become theta; workers overwrite theirs with every
  pulled theta, so only the *shapes* must agree, which the hello checks (parameter
  count and a checksum of the shapes). Seed inside the factory for a reproducible start.
  The model may live on any device; batches are moved to it.
* ``optimizer(params)`` builds the inner optimizer (again after a failed round). Its lr
  is the peak of the per-shard schedule (:func:`~thinwire.localsgd.shards.inner_lr`).
* ``shards(n)`` returns ``n`` batch sources. ``source(step)`` is the batch for the
  ``step``-th inner step spent on that shard; make it depend only on the shard and
  ``step`` (seed a generator with both) and a run is reproducible, and a shard that
  changes hands continues the same data stream. A source with ``len()`` is planned in
  proportion to it (e.g. its token count); otherwise shards are planned equally.
* ``loss(model, batch)`` returns the scalar loss to backpropagate.
* ``evaluate(model)`` returns a number to report (lower is better, e.g. validation loss);
  it runs on the server under ``torch.no_grad()`` in eval mode with theta loaded.

Under the local spawner (:func:`thinwire.comm.launch.spawn`) build the task inside the
rank function; only picklable objects (module-level functions) cross process borders.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from thinwire.errors import ConfigError

__all__ = [
    "BatchSource",
    "Task",
    "evaluate_at",
    "flat_parameters",
    "load_flat_",
    "make_sources",
    "shape_signature",
    "shard_sizes",
    "to_device",
]


class BatchSource(Protocol):
    """One data shard: the batch of its ``step``-th inner step."""

    def __call__(self, step: int) -> Any: ...


@dataclass
class Task:
    """The user's pieces of an asynchronous Local-SGD run (see the module docstring)."""

    model: Callable[[], nn.Module]
    """Builds the model; called once per process."""
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    """Builds a worker's inner optimizer from its model's parameters."""
    shards: Callable[[int], Sequence[BatchSource]]
    """``shards(n)``: ``n`` batch sources, one per data shard."""
    loss: Callable[[nn.Module, Any], torch.Tensor]
    """``loss(model, batch)``: the scalar training loss of one batch."""
    evaluate: Callable[[nn.Module], float] | None = None
    """``evaluate(model)``: the server's metric of theta (lower is better); optional."""


def make_sources(task: Task, n: int) -> list[BatchSource]:
    """``task.shards(n)``, checked to be ``n`` callables."""
    sources = list(task.shards(n))
    if len(sources) != n:
        raise ConfigError(f"the task's shards({n}) returned {len(sources)} batch sources")
    if not all(callable(s) for s in sources):
        raise ConfigError("every batch source must be callable as source(step) -> batch")
    return sources


def shard_sizes(sources: Sequence[BatchSource]) -> list[int]:
    """Relative sizes for planning: ``len(source)`` where defined, else 1 each."""
    return [len(s) if hasattr(s, "__len__") else 1 for s in sources]  # type: ignore[arg-type]


def shape_signature(model: nn.Module) -> tuple[int, int]:
    """``(numel, crc32 of the parameter shapes)``: equal for models of the same shape."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    return sum(p.numel() for p in model.parameters()), zlib.crc32(repr(shapes).encode())


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """The model's parameters as one flat fp32 vector on the CPU (theta's layout)."""
    return parameters_to_vector(model.parameters()).detach().float().cpu()


@torch.no_grad()
def load_flat_(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector into ``params`` (``vector_to_parameters`` would make them views
    of ``flat``, so training would silently modify the pulled theta)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists, dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@torch.no_grad()
def evaluate_at(
    model: nn.Module, theta: torch.Tensor, evaluate: Callable[[nn.Module], float]
) -> float:
    """``evaluate(model)`` with ``theta`` loaded into ``model``, in eval mode."""
    params = list(model.parameters())
    load_flat_(params, theta.to(params[0].device))
    model.eval()
    try:
        return float(evaluate(model))
    finally:
        model.train()
