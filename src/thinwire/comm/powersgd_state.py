"""PyTorch's PowerSGD state, checkpointed so that a resumed run continues bit-identically.

PowerSGD (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) carries state
from step to step: the step counter that decides when compression starts, the
error-feedback residual of every bucket, the warm-started ``Q`` factors, and a random
generator that seeds new factors. Without them a resumed run starts PowerSGD over: plain
allreduces again for ``start_powerSGD_iter`` steps, lost residuals, fresh factors.

Saving them is not enough. The residual and the factors are flat buffers laid out in the
order of the bucket's gradients, and DDP changes that order after its first iteration
(it rebuilds buckets in the order gradients became ready). A resumed run's first step
therefore sees its bucket in the initial order while the saved buffers follow the
rebuilt one. :class:`TrackedPowerSGD` records which parameter order each bucket's
buffers follow and, whenever a bucket arrives in another order, permutes the buffers to
match before PowerSGD reads them (:meth:`TrackedPowerSGD.align`, called by
:func:`thinwire.comm.peer_hooks.powersgd_hook`). (``thinwire train`` goes further on
resume: :class:`~thinwire.comm.resumable_ddp.ResumableDDP` rebuilds the buckets before
the first step, since the allreduce's rounding depends on the layout as well.)

:func:`powersgd_state_dict` stores all of it as plain data (PyTorch's own
``__getstate__`` keeps the generator as a numpy object, which a safe load refuses, see
:mod:`thinwire.safeload`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

__all__ = ["TrackedPowerSGD", "load_powersgd_state_dict", "powersgd_state_dict"]

_COUNTERS = (
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)
_BUFFERS = ("error_dict", "p_memory_dict", "q_memory_dict")


class TrackedPowerSGD:
    """A ``PowerSGDState`` and, per bucket, the parameter order its buffers follow.

    Args:
        inner: the PowerSGD state the hook uses.
        model: the model DDP wraps; its ``parameters()`` order names the parameters.
    """

    def __init__(self, inner: psgd.PowerSGDState, model: nn.Module) -> None:
        self.inner = inner
        params = list(model.parameters())
        self._index = {p.data_ptr(): i for i, p in enumerate(params)}
        self._shapes = [tuple(p.shape) for p in params]
        self.layout: dict[int, list[int]] = {}
        """bucket index -> parameter indices, in the order of that bucket's buffers."""

    def align(self, bucket: dist.GradBucket) -> None:
        """Make the bucket's saved buffers follow the order it arrives in now."""
        b = bucket.index()
        order = [self._index[p.data_ptr()] for p in bucket.parameters()]
        before = self.layout.get(b)
        self.layout[b] = order
        if before is None or before == order:
            return
        s = self.inner
        if b in s.error_dict:
            sizes = {i: _numel(self._shapes[i]) for i in order}
            s.error_dict[b] = _permute(s.error_dict[b], before, order, sizes)
        for name, width in (("p_memory_dict", 0), ("q_memory_dict", 1)):
            memory = getattr(s, name)
            if b in memory:
                old = self._factor_blocks(before, width)
                new = self._factor_blocks(order, width)
                memory[b] = _permute(memory[b], [i for i, _ in old], [i for i, _ in new], dict(new))

    def _factor_blocks(self, order: list[int], width: int) -> list[tuple[int, int]]:
        """``(parameter, length)`` of each P (``width`` 0) or Q (1) block, in PowerSGD's
        memory order: grouped by matrix shape in order of first appearance, then in
        bucket order (as ``powerSGD_hook`` lays them out)."""
        groups: dict[tuple[int, int], list[int]] = {}
        rank, min_rate = self.inner.matrix_approximation_rank, self.inner.min_compression_rate
        for i in order:
            shape = self._shapes[i] or (1,)
            n = shape[0]
            m = _numel(shape) // n
            r = min(n, m, rank)
            if psgd._should_compress(n, m, r, min_rate)[0]:
                groups.setdefault((n, m), []).append(i)
        return [(i, (n, m)[width] * min(n, m, rank)) for (n, m), ids in groups.items() for i in ids]


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _permute(
    flat: torch.Tensor, before: list[int], after: list[int], sizes: dict[int, int]
) -> torch.Tensor:
    """``flat`` holds one block per parameter in ``before`` order; return it in ``after``."""
    blocks, offset = {}, 0
    for i in before:
        blocks[i] = flat[offset : offset + sizes[i]]
        offset += sizes[i]
    return torch.cat([blocks[i] for i in after]) if after else flat.clone()


def powersgd_state_dict(state: TrackedPowerSGD) -> dict[str, Any]:
    """Everything an exact resume needs, as tensors, numbers and strings."""
    s = state.inner
    out: dict[str, Any] = {name: getattr(s, name) for name in _COUNTERS}
    for name in _BUFFERS:
        out[name] = {k: v.detach().clone() for k, v in getattr(s, name).items()}
    kind, keys, pos, has_gauss, cached = s.rng.get_state()
    out["rng"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    out["layout"] = {b: list(order) for b, order in state.layout.items()}
    return out


def load_powersgd_state_dict(
    state: TrackedPowerSGD, saved: dict[str, Any], device: torch.device | None = None
) -> None:
    """Inverse of :func:`powersgd_state_dict`; buffers go to ``device`` (the gradients')."""
    s = state.inner
    for name in _COUNTERS:
        setattr(s, name, saved[name])
    for name in _BUFFERS:
        setattr(s, name, {k: v.to(device) if device else v for k, v in saved[name].items()})
    r = saved["rng"]
    keys = r["keys"].numpy().astype("uint32")
    s.rng.set_state((r["kind"], keys, r["pos"], r["has_gauss"], r["cached_gaussian"]))
    state.layout = {int(b): list(order) for b, order in saved["layout"].items()}
