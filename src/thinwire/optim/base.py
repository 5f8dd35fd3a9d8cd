"""What LAMB, 1-bit Adam and 1-bit LAMB share: they are distributed optimizers.

(The two-stage warmup-then-compress machinery of the 1-bit optimizers is in
:mod:`thinwire.optim.two_stage`; when to switch, in :mod:`thinwire.optim.freeze`.)

Each is a ``torch.optim.Optimizer`` that also owns the communication of its step, so a
user's training loop stays ``loss.backward(); opt.step()``:

* **Construction** (after ``init_process_group``, or without a group for one process):
  the parameters are broadcast from rank 0, so every rank starts equal, and their shapes
  are compared across ranks (a mismatch fails here, naming both shapes, instead of
  hanging later in a collective).
* **Gradient averaging**: when the optimizer needs globally averaged gradients (LAMB
  always, the 1-bit optimizers during warmup), it packs every gradient into ONE flat fp32
  buffer and allreduces it once per step. Under PyTorch DDP, call :meth:`register_ddp`
  instead: DDP then averages the gradients in warmup and stays silent after the freeze,
  and the optimizer does not average again.
* **Non-finite gradients**: checked after averaging (or inside the 1-bit collective,
  which checks every rank's scale), so every rank decides alike; the step is skipped
  and counted in :attr:`skipped_steps`, and no state is touched; under a GradScaler
  every rank steps or skips alike (:mod:`thinwire.optim.amp`). The first skipped step logs a warning, and so do the 2nd,
  4th, 8th, ... with the count. When more than half of the last 20 steps were skipped
  (:attr:`~CommOptimizer.max_skipped_fraction`) the run is not training any more:
  ``step()`` raises :class:`~thinwire.errors.DivergedError` on every rank alike, as
  ``thinwire train``'s divergence guard stops a run.
* **Precision**: fp32, fp16 and bf16 parameters and gradients; moments and an fp32
  master copy of every low-precision parameter live in the optimizer state, so small
  updates are not rounded away.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record, ring_allreduce_bytes
from thinwire.comm.launch import rank as global_rank
from thinwire.compress.cast import WIRE_DTYPES
from thinwire.compress.onebit import DEFAULT_BLOCK
from thinwire.errors import DivergedError
from thinwire.optim.sharded import (
    check_layout,
    is_sharded,
    island_group,
    local,
    replica_groups,
    sum_over,
)

__all__ = [
    "FUSED_CHUNK",
    "CommOptimizer",
    "adam_direction",
    "adam_directions",
    "all_finite",
    "check_adam_hyperparameters",
    "check_range",
    "layer_batches",
    "momentum_masks",
    "view_batches",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_log = logging.getLogger("thinwire.optim")
SKIP_WINDOW = 20
"""Steps the divergence check looks back over (see :attr:`CommOptimizer.max_skipped_fraction`)."""


def check_range(
    name: str, value: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
) -> None:
    """Raise ``ValueError`` naming ``name`` and its valid range unless ``value`` lies in it."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    if value is None or isinstance(value, str | bytes | bool):
        raise ValueError(f"{name} must be a number in {left}{lo}, {hi}{right}, got {value!r}")
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}, got {value}")


def check_adam_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """The checks every Adam-family optimizer here shares (ValueError naming the knob)."""
    check_range("lr", lr, 0.0, float("inf"))
    check_range("betas[0]", betas[0], 0.0, 1.0, hi_open=True)
    check_range("betas[1]", betas[1], 0.0, 1.0, hi_open=True)
    check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    check_range("weight_decay", weight_decay, 0.0, float("inf"))


def adam_direction(m: torch.Tensor, v: torch.Tensor, group: dict[str, Any], t: int) -> torch.Tensor:
    """Adam's update direction ``m_hat / (sqrt(v_hat) + eps)`` at step ``t`` (a new tensor).

    The hats are the bias-corrected moments (divided by ``1 - beta^t``) when the group asks
    for ``bias_correction``, else the raw moments (the 1-bit papers' reference behaviour).
    """
    b1, b2 = group["betas"]
    if group["bias_correction"]:
        return (m / (1 - b1**t)).div_((v / (1 - b2**t)).sqrt_().add_(group["eps"]))
    return m / v.sqrt().add_(group["eps"])


FUSED_CHUNK = 1 << 26
"""Elements per batch of layers that the optimizers step together with torch's foreach
kernels (:func:`layer_batches`): their fp32 temporaries are a few x 256 MiB at most,
whatever the model."""


def layer_batches(
    items: list[tuple[torch.Tensor, dict[str, Any]]],
) -> list[list[tuple[torch.Tensor, dict[str, Any]]]]:
    """Consecutive runs of ``items`` with one parameter group and one device, each of at
    most :data:`FUSED_CHUNK` elements (or one larger layer)."""
    out: list[list[tuple[torch.Tensor, dict[str, Any]]]] = []
    size = 0
    for p, group in items:
        last = out[-1] if out else None
        if (
            last is None
            or last[0][1] is not group
            or last[0][0].device != p.device
            or size + p.numel() > FUSED_CHUNK
        ):
            out.append([])
            size = 0
        out[-1].append((p, group))
        size += p.numel()
    return out


def view_batches(
    items: list[tuple[torch.Tensor, dict[str, Any]]], views: list[torch.Tensor]
) -> Iterator[tuple[list[tuple[torch.Tensor, dict[str, Any]]], list[torch.Tensor]]]:
    """:func:`layer_batches` of ``items``, each with its slice of ``views`` (one view per
    item, in the same order: the exchange buffer's views of the layers)."""
    start = 0
    for batch in layer_batches(items):
        yield batch, views[start : start + len(batch)]
        start += len(batch)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, read back in one host sync (a
    sync per tensor stalls a GPU's stream once per layer). The largest magnitude of
    each, by one foreach kernel: inf or NaN exactly where the tensor holds one."""
    filled = [t for t in tensors if t.numel()]
    if not filled:
        return True
    device = filled[0].device
    # One kernel per dtype: foreach falls back to a kernel per tensor on a mixed list.
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in filled:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    peaks = [
        torch.stack(torch._foreach_norm(kind, math.inf)).to(device, torch.float32)
        for kind in by_kind.values()
    ]
    return bool(torch.cat(peaks).isfinite().all())


def adam_directions(
    ms: list[torch.Tensor], vs: list[torch.Tensor], group: dict[str, Any], t: int | list[int]
) -> list[torch.Tensor]:
    """:func:`adam_direction` of many layers of one group (new tensors), with torch's
    foreach kernels: the same arithmetic in the same order. ``t``: the step, or each
    layer's own (a layer that began to train later)."""
    b1, b2 = group["betas"]
    if group["bias_correction"]:
        c1 = 1 - b1**t if isinstance(t, int) else [1 - b1**k for k in t]
        c2 = 1 - b2**t if isinstance(t, int) else [1 - b2**k for k in t]
        denom = torch._foreach_div(vs, c2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        u = torch._foreach_div(ms, c1)
        torch._foreach_div_(u, denom)
        return u
    denom = torch._foreach_sqrt(vs)
    torch._foreach_add_(denom, group["eps"])
    return torch._foreach_div(ms, denom)


def momentum_masks(groups: list[dict[str, Any]]) -> dict[torch.Tensor, torch.Tensor | None]:
    """Parameter -> its ``exp_avg_mask`` entry, for groups that carry one (1-bit Adam/LAMB:
    a mask multiplied into the momentum after each compressed exchange)."""
    out: dict[torch.Tensor, torch.Tensor | None] = {}
    for group in groups:
        masks = group.get("exp_avg_mask")
        if masks is None:
            continue
        if len(masks) != len(group["params"]):
            raise ValueError(
                f"exp_avg_mask has {len(masks)} entries for a group of "
                f"{len(group['params'])} parameters"
            )
        out.update(zip(group["params"], masks, strict=True))
    return out


def _as_tensor(value: Any) -> Any:
    """Numbers and lists of numbers as tensors: ``torch.distributed.checkpoint`` loads
    tensors in place but leaves plain Python numbers at the values the target held."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return torch.tensor(value, dtype=torch.float64)
    return value


def _from_tensor(value: Any) -> Any:
    """Inverse of :func:`_as_tensor`."""
    if not torch.is_tensor(value) or value.dtype not in (torch.int64, torch.float64):
        return value
    if value.dim() == 1:
        return value.tolist()
    return int(value) if value.dtype == torch.int64 else float(value)


class CommOptimizer(torch.optim.Optimizer):
    """Base class: process group, start-up checks, fused gradient allreduce, fp32 masters."""

    _step_supports_amp_scaling = True
    """torch's GradScaler calls ``step()`` on every rank and hands it the scale, instead of
    skipping where this rank alone overflowed (:mod:`thinwire.optim.amp`)."""

    onebit_block: int | None = DEFAULT_BLOCK
    """Elements per scale of the 1-bit exchange (:class:`OneBitAllreduce`'s ``block``)."""

    island_only: bool = False
    """Sharded parameters only with FSDP2 inside an island and the optimizer across
    islands (the 1-bit optimizers: their compressed exchange is the one across islands)."""

    max_skipped_fraction: float = 0.5
    """``step()`` raises :class:`~thinwire.errors.DivergedError` once more than this share
    of the last 20 steps (at least 10 taken) were skipped for NaN/Inf gradients. A few
    skipped steps are normal with a loss scaler or right after a learning-rate change;
    most steps skipped means the run is not training. Set it to 1.0 on an instance to
    only count (:attr:`skipped_steps`) and warn."""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, defaults)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.global_step = 0
        """Steps applied (skipped ones not counted)."""
        self.skipped_steps = 0
        self._check_averaged_already = True  # see _warn_if_averaged_already
        self._written: dict[torch.Tensor, int] = {}
        """Each low-precision parameter's version counter after this optimizer last wrote
        its master into it (:meth:`_master` tells the user's own writes from it)."""
        self._recent: deque[bool] = deque(maxlen=SKIP_WINDOW)  # True: that step was skipped
        self._ddp_averages_grads = False
        self._grad_wire_dtype = torch.float32  # the optimizer's own average (set_grad_wire_dtype)
        self._flat: torch.Tensor | None = None
        self._onebit: Any = None  # the 1-bit collective, created at the first compressed step
        self._onebit_state: dict[str, Any] | None = None  # loaded before that step
        self.exchanged_energy = 0.0
        """``||x||^2`` of the buffer the last compressed step exchanged (after the exchange)."""
        self.exchanged_side = 0.0
        """The last compressed step's ``side`` number, averaged over the ranks."""
        self.exchange_s = 0.0
        """Seconds this rank has spent in the 1-bit exchange, all steps together (a
        counter: a step's share is the difference across it; the step recorder reads it)."""
        self.exchange_wait_s = 0.0
        """Of them, the seconds blocked waiting for the network and the other ranks; the
        rest is the codec's compute (compression, server average, decompression)."""
        for p in self._params():
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters")
            if p.dtype not in _FLOATS:
                raise ValueError(
                    f"{type(self).__name__} supports float32/float16/bfloat16 parameters, "
                    f"got {p.dtype}"
                )
        self._fsdp_averages_grads = False
        """FSDP2 owns every rank and averages the gradients (:mod:`thinwire.optim.sharded`)."""
        self._island: dist.ProcessGroup | None = None
        """The ranks each layer is split over when the optimizer works across islands on
        plain shards: whole-layer sums and norms are reduced over it."""
        self.sharded = any(is_sharded(p) for p in self._params())
        # Who logs: rank 0 of the group, and under FSDP2 only the first of those (every
        # shard position has its own replica group, each with a rank 0).
        self._speaks = self.rank == 0 and (not self.sharded or global_rank() == 0)
        if self.sharded:
            name = type(self).__name__
            params = self._params()
            self._fsdp_averages_grads = check_layout(params, process_group, name, self.island_only)
            if not self._fsdp_averages_grads:
                self._island = island_group(params)
        if self.world_size > 1 or self.sharded:
            self._check_shapes_agree()
            self._broadcast_parameters()

    # ------------------------------------------------------------------ helpers

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _check_shapes_agree(self) -> None:
        shapes = [tuple(p.shape) for p in self._params()]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, shapes, group=self.process_group)
        for r, theirs in enumerate(everyone):
            if theirs != shapes:
                if len(theirs) != len(shapes):
                    raise ValueError(
                        f"rank {r} has {len(theirs)} parameters, rank {self.rank} has "
                        f"{len(shapes)}: every rank must optimize the same model"
                    )
                i = next(i for i, (a, b) in enumerate(zip(theirs, shapes, strict=True)) if a != b)
                raise ValueError(
                    f"parameter {i} has shape {theirs[i]} on rank {r} but {shapes[i]} on rank "
                    f"{self.rank}: every rank must optimize the same model"
                )

    def _broadcast_parameters(self) -> None:
        """Every replica starts equal: whole parameters over the group, or a shard over
        the ranks that hold the same shard (the process group across islands, or
        HSDP's replicate dimension, which FSDP2 does not broadcast)."""
        with torch.no_grad():
            for p in self._params():
                if not is_sharded(p):
                    groups = [self.process_group]
                elif self._fsdp_averages_grads:
                    groups = replica_groups(p)
                else:
                    groups = [self.process_group]
                for group in groups:
                    src = dist.get_global_rank(group, 0) if group is not None else 0
                    dist.broadcast(local(p.data), src=src, group=group)
                    nbytes = local(p).numel() * p.element_size()
                    record("optim.broadcast", nbytes, nbytes)

    def _grads(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its group) for every parameter that has a gradient this step."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                out.append((p, group))
        return out

    def _flat_buffer(self, numel: int, device: torch.device) -> torch.Tensor:
        if self._flat is None or self._flat.numel() != numel or self._flat.device != device:
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
        return self._flat

    def _averaged_grads(self) -> list[tuple[torch.Tensor, dict[str, Any]]] | None:
        """(parameter, its group) for every parameter with a gradient on some rank, each
        gradient now the average over the ranks; None, with nothing changed, if any
        average holds NaN/Inf (every rank reaches the same verdict).

        Without DDP or FSDP2 the optimizer averages them itself, in one fused allreduce
        over every parameter that trains (``requires_grad``): a rank whose forward pass
        did not reach a parameter (a data-dependent branch, an expert, an auxiliary head)
        sends zeros for it, as DDP's ``find_unused_parameters`` does, so every rank packs
        the same layout and the average counts that rank as a zero gradient. One number
        per parameter travels beside the gradients to say which had one on any rank: a
        parameter none of them reached keeps ``grad=None`` and is skipped, as
        ``torch.optim`` skips it. (Packing only the gradients present would mix one
        rank's branch into another's, or fail on a size mismatch.)
        """
        items = self._grads()
        if self._fsdp_averages_grads or self.world_size == 1 or self._ddp_averages_grads:
            # One island (a replica group of 1) still agrees: a NaN may be in one shard.
            ok = self._agree_finite(all_finite([local(p.grad) for p, _ in items]))
            return items if ok else None
        trains = [
            (p, group)
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad or p.grad is not None
        ]
        flat = self._pack_grads(trains)
        flat.div_(self.world_size)  # before the cast: bf16/fp16 sums stay in range
        mine = flat.clone() if self._check_averaged_already and self._speaks else None
        self._check_averaged_already = False
        wire = flat if self._grad_wire_dtype == torch.float32 else flat.to(self._grad_wire_dtype)
        dist.all_reduce(wire, group=self.process_group)
        if wire is not flat:
            flat.copy_(wire)
        if mine is not None:
            self._warn_if_averaged_already(mine, flat)
        nbytes = wire.numel() * wire.element_size()
        record("optim.allreduce", nbytes, ring_allreduce_bytes(nbytes, self.world_size))
        if not self._agree_finite(bool(torch.isfinite(flat).all())):
            return None
        reached = flat[flat.numel() - len(trains) :].tolist()
        out, offset = [], 0
        for (p, group), seen in zip(trains, reached, strict=True):
            n = local(p).numel()
            if seen > 0:
                if p.grad is None:  # reached on another rank: this one's zero is counted
                    p.grad = torch.zeros_like(p)
                g = local(p.grad)
                g.copy_(flat[offset : offset + n].view_as(g))
                out.append((p, group))
            offset += n
        return out

    def _warn_if_averaged_already(self, mine: torch.Tensor, averaged: torch.Tensor) -> None:
        """At the first averaged step: gradients equal on every rank before the average
        mean DDP averaged them already, with this optimizer not registered (or the ranks
        read the same data); said in one line by rank 0. Checked once: one copy of the
        buffer, on rank 0."""
        if mine.numel() == 0:
            return
        mine.mul_(self.world_size)
        if bool(mine.abs().max() > 0) and torch.allclose(mine, averaged, rtol=1e-5, atol=0.0):
            _log.warning(
                "%s: the gradients were equal on every rank before this optimizer "
                "averaged them: under DDP, call opt.register_ddp(ddp_model), or DDP "
                "averages every step in fp32 beside this optimizer's own exchange (no "
                "compression, twice the bytes); otherwise the ranks read the same data",
                type(self).__name__,
            )

    def _pack_grads(self, trains: list[tuple[torch.Tensor, dict[str, Any]]]) -> torch.Tensor:
        """Every gradient of ``trains`` (zeros where this rank has none), then one flag
        per parameter (1: this rank has its gradient), in one flat fp32 buffer."""
        for p, _ in trains:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        shards = [local(p) for p, _ in trains]
        device = shards[0].device if shards else local(self._params()[0]).device
        numel = sum(t.numel() for t in shards)
        flat = self._flat_buffer(numel + len(trains), device)
        parts = [
            local(p.grad).reshape(-1).float()
            if p.grad is not None
            else torch.zeros(t.numel(), device=device)
            for (p, _), t in zip(trains, shards, strict=True)
        ]
        parts.append(torch.tensor([float(p.grad is not None) for p, _ in trains], device=device))
        torch.cat(parts, out=flat)
        return flat

    def _agree_finite(self, finite: bool) -> bool:
        """With sharded parameters a rank sees only its shard of a NaN: every rank takes
        the same decision, or the ranks that skip would leave the others waiting in the
        next whole-layer norm. One allreduce of one number, over the island when the
        optimizer works across islands: an island holds one rank of every replica group,
        so after an exchange across the replicas (where each group already agrees) the
        island's vote is everyone's, and nothing extra crosses the slow tier. Over all
        ranks when FSDP2 owns every rank."""
        if not self.sharded:
            return finite
        device = local(self._params()[0]).device  # NCCL takes device tensors only
        flag = torch.tensor([0.0 if finite else 1.0], device=device)
        dist.all_reduce(flag, group=self._island)
        return float(flag) == 0.0

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state, with Adam's ``m`` and ``v`` (fp32) created at first use."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if self.global_step > 1:
                # A layer that begins to train after the others: its bias corrections
                # count its own steps (layer_step), as torch's Adam counts per parameter.
                state["born"] = self.global_step - 1
        return state

    def layer_step(self, p: torch.Tensor, t: int | None = None) -> int:
        """Step ``t`` (default: :attr:`global_step`) counted from ``p``'s first step: the
        ``t`` of its bias corrections."""
        t = self.global_step if t is None else t
        return max(1, t - int(self.state[p].get("born", 0)))

    def _update_moments(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Adam's ``m`` and ``v`` of ``p`` (fp32, created at first use) fed ``p.grad``."""
        b1, b2 = group["betas"]
        state = self._moments(p)
        g = p.grad.float()
        state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        return state

    def _update_moments_all(
        self, items: list[tuple[torch.Tensor, dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        """:meth:`_update_moments` for plain tensors of one parameter group, with torch's
        foreach kernels (a few launches for all of them, not a few per layer)."""
        b1, b2 = items[0][1]["betas"]
        states = [self._moments(p) for p, _ in items]
        ms = [s["exp_avg"] for s in states]
        vs = [s["exp_avg_sq"] for s in states]
        gs = [p.grad.float() for p, _ in items]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        return states

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 copy the update is applied to (the parameter itself when fp32).

        Made from the parameter at its first step, and made again when the parameter
        was changed by someone else since this optimizer last wrote it (a
        ``load_state_dict``, a reset to an EMA of the weights): the user's weights win,
        as with torch's optimizers, instead of being overwritten by a stale master."""
        if p.dtype == torch.float32:
            return p.data
        state = self.state[p]
        master = state.get("master")
        if master is None or self._edited(p, master):
            state["master"] = master = p.detach().float().clone()
        return master

    def _edited(self, p: torch.Tensor, master: torch.Tensor) -> bool:
        # The version counter says whether anything wrote p since our own write (ours
        # go through .data, which leaves it alone); the values say whether it changed.
        written = self._written.get(p)
        if written is None or p._version == written:
            return False
        self._written[p] = p._version
        return not torch.equal(local(p.detach()), local(master).to(p.dtype))

    def _write_back(self, p: torch.Tensor, master: torch.Tensor) -> None:
        if p.dtype != torch.float32:
            local(p.data).copy_(local(master))  # whole, or this rank's shard of both
            self._written[p] = p._version

    def _write_back_all(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """:meth:`_write_back` for many layers: one foreach copy for the low-precision
        ones (it converts the dtype)."""
        low = [(p, m) for p, m in zip(params, masters, strict=True) if p.dtype != torch.float32]
        if low:
            torch._foreach_copy_([local(p.data) for p, _ in low], [local(m) for _, m in low])
            for p, _ in low:
                self._written[p] = p._version

    def _skip(self) -> None:
        """Count a skipped step; warn at the 1st, 2nd, 4th, 8th, ...; raise
        :class:`DivergedError` when most recent steps were skipped."""
        self.skipped_steps += 1
        self._recent.append(True)
        k, taken, name = (
            self.skipped_steps,
            self.global_step + self.skipped_steps,
            type(self).__name__,
        )
        if self._speaks and k & (k - 1) == 0:  # a power of two
            if k == 1:
                _log.warning(
                    "%s: step %d skipped: the averaged gradients held NaN or Inf; parameters "
                    "and optimizer state are unchanged",
                    name,
                    taken,
                )
            else:
                _log.warning(
                    "%s: %d of %d steps skipped so far (NaN/Inf gradients)", name, k, taken
                )
        recent = sum(self._recent)
        if len(self._recent) >= 10 and recent > self.max_skipped_fraction * len(self._recent):
            raise DivergedError(
                f"{name}: the run diverged at step {taken}: {recent} of the last "
                f"{len(self._recent)} steps were skipped (NaN/Inf gradients); lower the lr, "
                "clip the gradients, or start the compression later (freeze_step)"
            )

    def _took_step(self) -> None:
        """Record an applied step for the divergence check."""
        self._recent.append(False)

    def _compressed_average(
        self,
        params: list[torch.Tensor],
        fill: Callable[[list[torch.Tensor]], None],
        side: Callable[[], torch.Tensor | float] | None = None,
    ) -> list[torch.Tensor] | None:
        """Exchange one value per element of ``params`` in ONE 1-bit compressed allreduce.

        ``fill(views)`` writes each parameter's share into its view (in order: slices of
        one flat fp32 buffer, each shaped like its parameter, or its shard); the buffer
        is averaged across the ranks with error feedback
        (:class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce`) and the averaged views
        are returned in order. ``side()``, read once every view is
        filled, is one number that travels exactly beside the bits; its average over the
        ranks is left in :attr:`exchanged_side`. Returns None, with every error buffer
        and every optimizer state untouched, if any rank's buffer held NaN/Inf.
        """
        shards = [local(p) for p in params]
        total = sum(t.numel() for t in shards)
        flat = self._flat_buffer(total, shards[0].device)
        views, offset = [], 0
        for t in shards:
            views.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        fill(views)
        value = side() if side is not None else 0.0
        if not self._exchange_flat(flat, total > 0, value):
            return None
        # What was exchanged keeps its energy through the 1-bit code (RMS block scales):
        # a gauge of the step's size that every rank reads alike. Both numbers are sums
        # over elements: over the whole layers when each rank holds shards.
        energy = float(torch.linalg.vector_norm(flat)) ** 2
        self.exchanged_energy, self.exchanged_side = sum_over(
            [energy, self.exchanged_side], self._island, flat.device
        )
        return views

    def _exchange_flat(self, flat: torch.Tensor, nonempty: bool, value: float) -> bool:
        """Average ``flat`` across the replicas in the momentum exchange (in place; its
        ``side`` number in :attr:`exchanged_side`); False, with the error feedback
        untouched on every rank, if some rank's buffer held NaN/Inf."""
        from thinwire.comm.momentum_exchange import make_exchange
        from thinwire.comm.onebit_allreduce import NonFiniteError

        if self._onebit is None:
            kind = getattr(self, "exchange", "onebit")  # 1-bit, or a quantizer
            self._onebit = make_exchange(kind, self.process_group, self.onebit_block)
            if self._onebit_state is not None:
                self._onebit.load_state_dict(self._onebit_state)
                self._onebit_state = None
        if self.sharded and not self._agree_finite(bool(torch.isfinite(flat).all())):
            # A NaN in one shard: its island agrees on it over the fast links, and each
            # of the island's ranks poisons its buffer, so that the exchange refuses in
            # every replica group (each has a rank in this island) before any error
            # feedback moves. No vote over all ranks has to cross the slow tier.
            flat.fill_(math.nan)
        exchanged = self.world_size > 1 and nonempty  # all shards empty: nothing to send
        overflow = False
        if exchanged:
            try:
                self._onebit(flat, out=flat, side=value)
            except NonFiniteError:
                overflow = True
        # An overflow inside one replica group's exchange: every other rank must hear of
        # it, or they would wait for that group in the next island collective.
        if self.sharded and not self._agree_finite(not overflow):
            return False
        if overflow or not (exchanged or bool(torch.isfinite(flat).all())):
            return False
        if exchanged:
            self.exchange_s += self._onebit.last_call_s
            self.exchange_wait_s += self._onebit.last_wait_s
            self.exchanged_side = self._onebit.side_mean
        else:  # one rank, or shards empty on every replica (their side is 0 everywhere)
            self.exchanged_side = float(value)
        return True

    # ------------------------------------------------------------------ DDP

    def needs_averaged_grads(self) -> bool:
        """Whether the next step needs gradients averaged over the ranks (DDP hook asks)."""
        return True

    def set_grad_wire_dtype(self, wire_dtype: torch.dtype) -> None:
        """What the gradients travel as when this optimizer averages them itself (LAMB,
        and the 1-bit optimizers' warmup, without DDP: e.g. on FSDP2 shards across
        islands): ``torch.float32`` (the default, exact), or ``torch.bfloat16`` /
        ``torch.float16`` for half the bytes. With DDP, :meth:`register_ddp` sets it."""
        if wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {wire_dtype}")
        self._grad_wire_dtype = wire_dtype

    def register_ddp(
        self,
        ddp_model: torch.nn.parallel.DistributedDataParallel,
        wire_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Use with a DDP-wrapped model: DDP averages gradients only while this optimizer
        needs them averaged (LAMB always, the 1-bit optimizers in warmup), bucket by
        bucket during the backward pass, and sends nothing after the freeze.

        Args:
            ddp_model: the model wrapped in ``DistributedDataParallel`` (register before
                the first backward pass).
            wire_dtype: what the averaged gradients travel as: ``torch.float32`` (exact),
                or ``torch.float16`` / ``torch.bfloat16`` for half the bytes (fp16 is the
                1-bit papers' baseline; bf16 cannot overflow).
        """
        from thinwire.optim.ddp_hook import OptimizerAwareHookState, optimizer_aware_hook

        if wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {wire_dtype}")
        state = OptimizerAwareHookState(self, wire_dtype)
        ddp_model.register_comm_hook(state, optimizer_aware_hook)
        self._ddp_averages_grads = True

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"thinwire"``: the world size and, under the key
        ``"rank{r}"``, this rank's own state (error-feedback buffers, counters).

        Keying the per-rank part by rank lets ``torch.distributed.checkpoint`` save every
        rank's entry (it would keep only one copy of a key all ranks share); the rest of
        the state is identical on every rank, or a DTensor shard of it. ``r`` is the
        rank in the default group: two ranks can share a rank in the optimizer's group
        (the replicas of different shards under FSDP2), never in the default one.
        """
        sd = super().state_dict()
        # torch's dict shares each parameter's state dict with the live state: build new
        # ones, or the floats below would stay tensors in the running optimizer too.
        sd["state"] = {
            pid: {
                key: torch.tensor(value, dtype=torch.float64) if isinstance(value, float) else value
                for key, value in per_param.items()
            }
            for pid, per_param in sd["state"].items()
        }
        mine = {"skipped_steps": self.skipped_steps, **self._extra_state()}
        sd["thinwire"] = {
            "world_size": self.world_size,
            f"rank{global_rank()}": {k: _as_tensor(v) for k, v in mine.items()},
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        extra = sd.pop("thinwire", None)
        if extra is not None:
            if extra["world_size"] != self.world_size:
                raise ValueError(
                    f"{type(self).__name__} state was saved with world size "
                    f"{extra['world_size']}, this group has {self.world_size}: the per-rank "
                    "error-feedback state cannot be mapped onto a different number of ranks"
                )
            key = f"rank{global_rank()}"
            # State saved before it was keyed by the rank in the default group holds the
            # rank in the optimizer's group (the same rank without a process_group).
            mine = extra.get(key)
            if mine is None and not self.sharded:  # several shards share a group rank
                mine = extra.get(f"rank{self.rank}")
            if mine is None:
                saved = sorted(k for k in extra if k.startswith("rank"))
                raise ValueError(
                    f"{type(self).__name__} state holds {', '.join(saved)}, not "
                    f"{key}'s: each rank must load its own state"
                )
            mine = {k: _from_tensor(v) for k, v in mine.items()}
            self.skipped_steps = mine["skipped_steps"]
            self._load_extra_state(mine)
        super().load_state_dict(sd)
        # torch casts floating state to each parameter's dtype; our moments and masters are
        # fp32 whatever the parameter is, so put the saved tensors back as they were.
        saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
        for pid, p in zip(saved_ids, self._params(), strict=True):
            for key, value in sd["state"].get(pid, {}).items():
                if torch.is_tensor(value) and value.dtype == torch.float64 and value.dim() == 0:
                    self.state[p][key] = float(value)  # a scalar state_dict() made a tensor
                elif torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, copy=True)

    def _extra_state(self) -> dict[str, Any]:
        onebit = self._onebit.state_dict() if self._onebit is not None else self._onebit_state
        return {"onebit": onebit}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        saved = extra.get("onebit")
        kind, mine = (saved or {}).get("kind", "onebit"), getattr(self, "exchange", "onebit")
        if saved is not None and kind != mine:
            raise ValueError(
                f"the saved momentum exchange is {kind}, this optimizer exchanges {mine}: "
                "resume with the exchange it was saved with"
            )
        self._onebit_state = saved
        if self._onebit is not None:
            if self._onebit_state is None:
                self._onebit.reset()
            else:
                self._onebit.load_state_dict(self._onebit_state)
            self._onebit_state = None

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # pragma: no cover
        raise NotImplementedError
