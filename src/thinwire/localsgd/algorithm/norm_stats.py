"""Running statistics of normalization layers for asynchronous Local-SGD's global model.

BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked`` change only
in forward passes in train mode. The server's theta is built from pseudo-gradients and
never runs a forward pass, so without help its statistics stay those of a freshly
built model (mean 0, variance 1) while its weights are trained: evaluated in eval mode
it scores far worse than it is, and the model handed back is broken the same way. The
workers' statistics do not help either: each belongs to that worker's own replica,
which drifted from theta over its round.

So the server recomputes them for theta whenever it needs the whole model: before each
evaluation, before each checkpoint, and for the trained model the summary hands back.
:class:`NormStats` resets every layer that tracks running statistics, runs ``batches``
training batches (drawn in turn from the shards) through the model in train mode with
no gradients, each layer averaging over all of them (the plain mean, not the layer's
moving average),
and puts the layers' momenta back. The statistics are then exactly those of theta on
those batches; nothing goes over the wire, and the workers train as before (a forward
pass in train mode normalizes with the batch's own statistics, never the running ones).

Tuning: ``AsyncConfig.norm_batches`` (default 16) is the number of batches. More
batches give less noisy statistics at that many forward passes on the server per
evaluation or checkpoint (during which it answers no worker). Models without such layers
cost nothing: no batch is drawn. Other buffers (a user's own) are not recomputed: a
forward pass here leaves them as they were, and a one-line warning names how many there
are, since they keep the values of a freshly built model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from thinwire.errors import ConfigError
from thinwire.localsgd.task import BatchSource, to_device

__all__ = ["NormStats", "load_norm_state_", "norm_layers"]

_log = logging.getLogger("thinwire.localsgd")


def norm_layers(model: nn.Module) -> list[tuple[str, _NormBase]]:
    """The layers of ``model`` that keep running statistics, with their names
    (BatchNorm of any dimension, SyncBatchNorm, InstanceNorm with
    ``track_running_stats=True``)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None
    ]


class NormStats:
    """Recomputes ``model``'s normalization statistics for the parameters it holds.

    Args:
        model: the server's model; the caller loads theta into it first.
        sources: the run's batch sources (one per shard); batch ``j`` is
            ``sources[j % S](j // S)``, the same batches every time.
        loss: ``loss(model, batch)``, the task's training loss: its forward pass is the
            one the statistics come from (its value is not used).
        batches: how many batches; 0 turns recomputing off.
    """

    def __init__(
        self,
        model: nn.Module,
        sources: Sequence[BatchSource],
        loss: Callable[[nn.Module, Any], torch.Tensor],
        batches: int,
    ) -> None:
        self.model, self.sources, self.loss, self.batches = model, sources, loss, batches
        self.layers = norm_layers(model)
        self._done_for: object = None

    @property
    def active(self) -> bool:
        """Whether there is anything to recompute (norm layers, and batches to do it)."""
        return bool(self.layers) and self.batches > 0

    def describe(self) -> str | None:
        """One line on what this model's buffers get, when it is not the whole story
        (None: nothing to say)."""
        own = {id(b) for _, m in self.layers for b in m.buffers()}
        other = [b for b in self.model.buffers() if id(b) not in own and b.is_floating_point()]
        if self.layers and self.batches == 0:
            return (
                f"norm_batches=0: the {len(self.layers)} normalization layers keep a freshly "
                "built model's running statistics in the server's evaluations and the "
                "trained model"
            )
        if other:
            return (
                f"the model has {len(other)} floating-point buffers outside normalization "
                "layers; asynchronous Local-SGD does not sync them, so the server's "
                "evaluations and the trained model use a freshly built model's"
            )
        return None

    def warn(self) -> None:
        """Log :meth:`describe`'s line, if it has one (once per run, at its start)."""
        said = self.describe()
        if said is not None:
            _log.warning("thinwire: %s (docs/localsgd.md)", said)

    def refresh(self, version: object = None) -> bool:
        """Recompute the statistics for the parameters ``model`` holds now; whether it
        did. ``version`` names those parameters (the server's theta version): asked
        again for the same one, it does nothing."""
        if not self.active or self.holds(version):
            return False
        recompute_(self.model, self._batches(), self.loss, self.layers)
        self._done_for = version
        return True

    def holds(self, version: object) -> bool:
        """Whether the model holds the parameters of ``version`` and their statistics
        already (None: unknown, never)."""
        return version is not None and version == self._done_for

    def mark(self, version: object) -> None:
        """The statistics the model holds are already those of ``version`` (restored
        with it from a checkpoint)."""
        self._done_for = version

    def _batches(self) -> Iterator[Any]:
        # one at a time: only one batch is on the device at once
        device = next(self.model.parameters()).device
        count = len(self.sources)
        for j in range(self.batches):
            yield to_device(self.sources[j % count](j // count), device)

    def state(self) -> dict[str, torch.Tensor]:
        """The statistics by their ``state_dict`` names, on the CPU (what the summary
        and the checkpoint keep, and :func:`load_norm_state_` puts back)."""
        out = {}
        for name, m in self.layers:
            prefix = f"{name}." if name else ""
            for leaf, b in m.named_buffers(recurse=False):
                if b is not None:
                    out[prefix + leaf] = b.detach().cpu().clone()
        return out


@torch.no_grad()
def recompute_(
    model: nn.Module,
    batches: Iterable[Any],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    layers: Sequence[tuple[str, _NormBase]],
) -> None:
    """Reset ``layers``' statistics and average them over ``batches`` (see the module
    docstring). Other buffers, the training mode and the random streams (dropout draws)
    are as they were afterwards, so a run's results do not depend on when it evaluates."""
    own = {id(b) for _, m in layers for b in m.buffers()}
    others = [(b, b.clone()) for b in model.buffers() if id(b) not in own]
    momenta = [m.momentum for _, m in layers]
    was_training = model.training
    device = next(model.parameters()).device
    cuda = [device] if device.type == "cuda" else []
    try:
        for _, m in layers:
            m.reset_running_stats()
        model.train()
        with torch.random.fork_rng(devices=cuda):
            for k, batch in enumerate(batches):
                # momentum 1/(k+1) makes each statistic the plain mean over the batches
                # so far (InstanceNorm reads momentum=None as "never update")
                for _, m in layers:
                    m.momentum = 1.0 / (k + 1)
                loss(model, batch)
    finally:
        for (_, m), momentum in zip(layers, momenta, strict=True):
            m.momentum = momentum
        for b, saved in others:
            b.copy_(saved)
        model.train(was_training)


@torch.no_grad()
def load_norm_state_(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Put statistics saved by :meth:`NormStats.state` into ``model``'s buffers; a
    one-line ConfigError when a name or a shape is not the model's."""
    for name, value in state.items():
        try:
            b = model.get_buffer(name)
        except AttributeError:
            raise ConfigError(
                f"the saved normalization statistics name buffer {name!r}, which the model "
                "does not have: load them into a model built like the run's"
            ) from None
        if b is None or b.shape != value.shape:
            raise ConfigError(
                f"the saved statistics {name!r} have shape {tuple(value.shape)}, the "
                f"model's buffer has {None if b is None else tuple(b.shape)}"
            )
        b.copy_(value.to(b.device, b.dtype))
