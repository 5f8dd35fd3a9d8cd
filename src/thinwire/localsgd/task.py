"""What a user hands asynchronous Local-SGD: their model, optimizer, data, loss and metric.

A :class:`Task` holds five pieces, all plain callables, so any ``nn.Module`` trains::

    task = Task(
        model=lambda: MyNet(),                                   # same shapes on every rank
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        shards=lambda n: [MyShard(i, n) for i in range(n)],      # n batch sources
        loss=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
        evaluate=lambda model: my_validation_loss(model),        # optional, on the server
    )

``evaluate`` may also name several metrics, the loss among them::

        evaluate=lambda model: {"loss": my_validation_loss(model), "accuracy": my_acc(model)},

Contracts the runtime relies on:

* ``model()`` is called once per process (the server's model, each worker's replica).
  The server's initial parameters become theta; workers overwrite theirs with every
  pulled theta, so only the *shapes* must agree, which the hello checks (parameter
  count and a checksum of the shapes). Seed inside the factory for a reproducible start.
  The model may live on any device; batches are moved to it.
* ``optimizer(params)`` builds the inner optimizer (again after a failed round). Its lr
  is the peak of the per-shard schedule (:func:`~thinwire.localsgd.algorithm.shards.inner_lr`).
* ``shards(n)`` returns ``n`` batch sources. ``source(step)`` is the batch for the
  ``step``-th inner step spent on that shard; make it depend only on the shard and
  ``step`` (seed a generator with both) and a run is reproducible, and a shard that
  changes hands continues the same data stream. A source with ``len()`` is planned in
  proportion to it (e.g. its token count); otherwise shards are planned equally.
* ``loss(model, batch)`` returns the scalar loss to backpropagate.
* ``shard(model, mesh)`` (optional) wraps the model's FSDP2 units when each worker is
  an island of ranks (``AsyncConfig.shard_within``); see
  :mod:`thinwire.localsgd.runtime.island`.
* ``evaluate(model)`` returns the number to report (lower is better, e.g. validation
  loss), or a dict of numbers that names that loss ``"loss"`` or ``"val_loss"``
  (:data:`LOSS_KEYS`) next to any other metrics (``{"loss": 0.31, "accuracy": 0.92}``).
  Either way the loss is reported as ``val_loss`` (the records, ``final_val_loss``);
  the other metrics go into the same records under their own names and into the
  summary's ``final_metrics`` (:func:`eval_metrics`). It runs on the server under
  ``torch.no_grad()`` in eval mode with theta loaded.

Under the local spawner (:func:`thinwire.comm.launch.spawn`) build the task inside the
rank function; only picklable objects (module-level functions) cross process borders.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from thinwire.errors import ConfigError

__all__ = [
    "LOSS_KEYS",
    "RESERVED_METRICS",
    "BatchSource",
    "EvalResult",
    "Task",
    "batch_part",
    "eval_metrics",
    "evaluate_at",
    "flat_parameters",
    "load_flat_",
    "make_sources",
    "metrics_at",
    "shape_signature",
    "shard_sizes",
    "to_device",
]


EvalResult = float | Mapping[str, float]
"""What ``Task.evaluate`` returns: the loss, or named metrics with the loss among them."""

LOSS_KEYS = ("loss", "val_loss")
"""The names under which an evaluation dict may give its loss (exactly one of them)."""

RESERVED_METRICS = frozenset({"step", "steps", "updates", "rejected", "time_s"})
"""Names an evaluation dict may not use: the evaluation records' own keys (the runtime's
``step``/``updates``/``rejected``/``time_s``, the simulator's ``steps``/``updates``/
``time_s``), which a metric of the same name would overwrite."""


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
    evaluate: Callable[[nn.Module], EvalResult] | None = None
    """``evaluate(model)``: the server's loss of theta (lower is better), or a dict of
    metrics naming it ``"loss"`` or ``"val_loss"``; optional."""
    shard: Callable[[nn.Module, Any], None] | None = None
    """``shard(model, mesh)``: make the model's FSDP2 units on an island's 1-D device
    mesh (``fully_shard(block, mesh=mesh)`` for each block, as in torchtitan), when
    each worker is an island of ranks (``AsyncConfig.shard_within`` > 1). The runtime
    then shards the root module itself. ``None``: the whole model is one unit (correct,
    but each forward gathers every parameter at once)."""


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


def batch_part(batch: Any, part: int, parts: int) -> Any:
    """Part ``part`` of ``parts`` of ``batch``: every tensor in it (nested in tuples,
    lists, dicts) split along its first dimension as ``torch.tensor_split`` does (the
    first parts one row longer when the rows do not divide); other values as they are.
    The ranks of an island each train on their part of the worker's batch; with a loss
    that averages over rows, the island's gradient is the whole batch's only when
    ``parts`` divides the rows (otherwise a mean of the parts' means).

    Raises:
        ConfigError: a tensor with fewer rows than ``parts`` (a rank would get none)."""
    if parts == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        if not batch.dim():
            return batch
        if len(batch) < parts:
            raise ConfigError(
                f"a batch of {len(batch)} rows cannot be split over an island of {parts} "
                "ranks: give each worker at least as many rows per batch as its ranks"
            )
        return torch.tensor_split(batch, parts)[part]
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_part(b, part, parts) for b in batch)
    if isinstance(batch, dict):
        return {k: batch_part(v, part, parts) for k, v in batch.items()}
    return batch


def _kind(value: Any) -> str:
    # What a value that is not a number is, for an error message.
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of {value.numel()} elements"
    return f"a {type(value).__name__}"


def _number(name: str, value: Any) -> float:
    # Anything float() takes but text: Python and NumPy numbers, one-element tensors
    # (``loss`` as well as ``loss.item()``). A string or None is a mistake, not a metric.
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(
            f"task.evaluate returned {_kind(value)} as {name!r}; every metric must be a number"
        ) from None
    # A non-finite value is a measurement (a diverged run's loss), not a mistake in the
    # task: it is reported as it is, as a plain float loss always was.
    return out


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """``task.evaluate``'s result as ``{"val_loss": loss, **other metrics}``.

    A number is the loss (passed on as ``float(result)``, non-finite included, as it
    always was: a diverged run still reports its nan). A dict names the loss under one
    of :data:`LOSS_KEYS`; every value must be a number (or a one-element tensor).

    Raises:
        ConfigError: one line naming the problem: a dict without a loss or with two, a
            metric that is not a number, a name from
            :data:`RESERVED_METRICS` or not a string, or a result that is neither a
            number nor a dict.
    """
    if not isinstance(result, Mapping):
        try:
            return {"val_loss": float(result)}
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(
                f"task.evaluate returned {_kind(result)}: return the loss as a "
                f"float, or a dict of floats that names it {' or '.join(map(repr, LOSS_KEYS))}"
            ) from None
    bad = [k for k in result if not isinstance(k, str)]
    if bad:
        raise ConfigError(
            f"task.evaluate returned a dict with a key that is not a string: {bad[0]!r}"
        )
    named = [k for k in LOSS_KEYS if k in result]
    if not named:
        raise ConfigError(
            f"task.evaluate returned a dict without a loss (keys: {', '.join(result) or 'none'}): "
            f"name the loss {' or '.join(map(repr, LOSS_KEYS))}"
        )
    if len(named) > 1:
        raise ConfigError(
            f"task.evaluate returned a dict with both {' and '.join(map(repr, named))}: "
            "name the loss once"
        )
    taken = sorted(RESERVED_METRICS.intersection(result))
    if taken:
        raise ConfigError(
            f"task.evaluate returned a metric named {taken[0]!r}, a name the evaluation "
            "records use for themselves: rename it"
        )
    out = {"val_loss": _number(named[0], result[named[0]])}
    for k, v in result.items():
        if k != named[0]:
            out[k] = _number(k, v)
    return out


@torch.no_grad()
def metrics_at(
    model: nn.Module,
    theta: torch.Tensor,
    evaluate: Callable[[nn.Module], EvalResult],
    prepare: Callable[[nn.Module], object] | None = None,
) -> dict[str, float]:
    """:func:`eval_metrics` of ``evaluate(model)`` with ``theta`` loaded into ``model``,
    in eval mode. ``prepare(model)`` runs once theta is loaded, before the evaluation
    (the server recomputes normalization statistics there)."""
    params = list(model.parameters())
    load_flat_(params, theta.to(params[0].device))
    if prepare is not None:
        prepare(model)
    model.eval()
    try:
        return eval_metrics(evaluate(model))
    finally:
        model.train()


def evaluate_at(
    model: nn.Module, theta: torch.Tensor, evaluate: Callable[[nn.Module], EvalResult]
) -> float:
    """The loss ``evaluate(model)`` gives with ``theta`` loaded (see :func:`metrics_at`)."""
    return metrics_at(model, theta, evaluate)["val_loss"]
