"""1-bit Adam: Adam whose momentum travels at ~1 bit per element after a warmup.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", arXiv 2102.02888.

* **Warmup**: Adam on gradients averaged with a full-precision allreduce (one fused
  buffer per step), until ``freeze_step`` or, with ``freeze_step="auto"``, until the
  second moment has settled (:class:`~thinwire.optim.freeze.AutoFreeze`).
* **Freeze**: Adam's variance ``v`` stops changing; the preconditioner is now fixed, so
  the update is linear in the momentum and error feedback can compensate compression.
* **Compression stage**: gradients stay local. Each rank updates its momentum with its
  own gradient, ``m = b1*m + (1-b1)*g_local``, and the momenta of all layers are averaged
  in ONE error-compensated 1-bit allreduce per step (preconditioned by the frozen
  ``sqrt(v)`` first, unless ``precondition=False``); then
  ``p -= lr * (m/(sqrt(v)+eps) + weight_decay*p)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from thinwire.compress.onebit import DEFAULT_BLOCK
from thinwire.optim.base import (
    adam_direction,
    adam_directions,
    check_adam_hyperparameters,
    layer_batches,
    momentum_masks,
    view_batches,
)
from thinwire.optim.floor import DEFAULT_DENOM_FLOOR
from thinwire.optim.freeze import AutoFreeze
from thinwire.optim.sharded import is_sharded, local, local_norms, reduce_norms
from thinwire.optim.step_bound import DEFAULT_STEP_BOUND, bound_adam_update, track_adam_update
from thinwire.optim.two_stage import TwoStageOptimizer

__all__ = ["OneBitAdam"]


class OneBitAdam(TwoStageOptimizer):
    """1-bit Adam, data-parallel, on any torch.distributed backend.

    Args:
        params: parameters or parameter groups. A group may carry ``exp_avg_mask``: a
            list with one tensor (or None) per parameter, multiplied into the momentum
            after each compressed exchange, to keep coordinates whose gradient is always
            zero (e.g. unused embedding rows) from accumulating compression error.
        lr: learning rate, as for Adam.
        freeze_step: when the full-precision warmup ends: ``"auto"`` (once the second
            moment has settled, see :class:`~thinwire.optim.freeze.AutoFreeze`, and at
            30% of ``total_steps`` at the latest; pass an ``AutoFreeze(...)`` to tune
            it), or a step count. A fixed count must come after the variance has
            settled: 15-25% of the run is the papers' choice, at least a few hundred
            steps on real models. Too early shows as a loss jump right after the freeze
            (or as a stale variance, see :mod:`thinwire.optim.stale`); later costs only
            bandwidth (warmup steps send 28x more).
        betas: moment decay rates, each in [0, 1).
        eps: added to ``sqrt(v)``.
        weight_decay: added to the update (``+ weight_decay * p``), as in the reference.
        bias_correction: divide ``m`` by ``1-b1^t`` and ``v`` by ``1-b2^t`` (``v``'s factor
            is frozen with ``v``). On by default; ``False`` is the reference's rule, safe
            only with warmups of thousands of steps: without it the variance frozen after
            a few hundred steps is a small fraction of its steady size (``1 - b2^t``).
        precondition: compress ``m / (sqrt(v_hat)+eps)`` instead of ``m`` (default), so
            the compression error of an element is on the scale of its own step; see
            :mod:`thinwire.optim.two_stage`. ``False`` is the paper's rule.
        total_steps: the run's length in optimizer steps, if known. With
            ``freeze_step="auto"`` it caps the warmup at 30% of it
            (:meth:`AutoFreeze.for_run <thinwire.optim.freeze.AutoFreeze.for_run>`,
            ``thinwire train``'s rule), so the automatic freeze compresses in a run of
            any length: on thinwire's model zoo the statistics settled after 45-90% of a
            300-step run or not at all. Without it the cap is 10,000 steps, and a warmup
            that has not settled by step 100 says so in one warning line.
        denom_floor: floor of each frozen denominator, as a share of its layer's median
            (:mod:`thinwire.optim.floor`): keeps the weights behind ReLU units that never
            fired (second moment 0) and other near-dead elements from taking steps of
            many times lr. 0 is the papers' rule.
        step_bound: a layer's compressed update is at most this many times the norm of
            its warmup updates (their average over the last ~10 warmup steps), where
            Adam's own growing variance would have kept it
            (:mod:`thinwire.optim.step_bound`). None is the papers' rule.
        block: elements per 1-bit scale in the compressed exchange (see
            :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce`); None is the papers'
            one scale per buffer.
        process_group: ranks to average over (default: the default group, if any).
            With FSDP2 inside an island, the ranks that hold the same shard in every
            island (``mesh.get_group("replicate")``): each rank then compresses its own
            shards across the islands (:mod:`thinwire.optim.sharded`).
        exchange: the code of the compressed stage's momentum exchange: ``"onebit"``
            (the default), or ``"int8"``, ``"fp8"``, ``"int4"``, ``"bf16"`` (finer, 4-14x
            more bytes); tuning guide in :mod:`thinwire.comm.momentum_exchange`.

    With one process (or no process group) it is plain Adam (the "compression" of one
    rank is the identity) with the variance frozen after the warmup. The defaults
    (automatic freeze, bias correction, preconditioned exchange) are thinwire's; the
    paper's 1-bit Adam is ``freeze_step=N, bias_correction=False, precondition=False``.
    """

    onset_reads_gradients = False
    """The step bound switches on when the exchanged momentum has grown 2x since the
    freeze. Measured on the model zoo's BERT at the larger size (seeds 0-2): with the
    gradients' growth as the onset (1-bit LAMB's) 1-bit Adam ended at 0.858, 0.997, 0.987
    (AdamW 0.986): at the plateau's end the gradients turn coherent, the momentum and the
    steps grow while the gradients' norm hardly does; with the momentum, 0.984 on
    average."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int | str | AutoFreeze = "auto",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        precondition: bool = True,
        denom_floor: float = DEFAULT_DENOM_FLOOR,
        step_bound: float | None = DEFAULT_STEP_BOUND,
        block: int | None = DEFAULT_BLOCK,
        total_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        exchange: str = "onebit",
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            precondition=precondition,
            denom_floor=denom_floor,
            step_bound=step_bound,
        )
        super().__init__(params, defaults, freeze_step, process_group, block, total_steps, exchange)

    def _warmup_step(self) -> bool:
        items = self._averaged_grads()
        if items is None:
            return False
        self.global_step += 1
        tracked: list[tuple[dict[str, Any], torch.Tensor]] = []
        if any(isinstance(p, DTensor) for p, _ in items):
            for p, group in items:
                state = self._update_moments(p, group)
                u = adam_direction(state["exp_avg"], state["exp_avg_sq"], group, self.layer_step(p))
                if group["step_bound"] is not None:
                    tracked.append((state, local_norms([u])[0]))  # before the decay
                self._apply(p, group, u)
        else:  # batches of whole layers (or plain shards), with torch's foreach kernels
            for batch in layer_batches(items):
                group = batch[0][1]
                states = self._update_moments_all(batch)
                ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
                u = adam_directions(ms, vs, group, [self.layer_step(p) for p, _ in batch])
                if group["step_bound"] is not None:  # before the decay
                    tracked += zip(states, torch._foreach_norm(u), strict=True)
                masters = [local(self._master(p)) for p, _ in batch]
                if group["weight_decay"]:
                    torch._foreach_add_(u, masters, alpha=group["weight_decay"])
                torch._foreach_add_(masters, u, alpha=-group["lr"])
                self._write_back_all([p for p, _ in batch], masters)
        if tracked:  # the whole layers' norms in one reduction for all of them
            norms = reduce_norms(torch.stack([n for _, n in tracked]), self._island)
            for (state, _), norm in zip(tracked, norms, strict=True):
                track_adam_update(state, norm)
        return True

    def _compression_step(self) -> bool:
        items = self._momentum_params()
        groups = dict(items)

        params = [p for p, _ in items]
        views = self._compressed_average(
            params, lambda vs: self._fill_momenta(items, vs), lambda: self._gauge
        )
        if views is None:
            return False
        self.global_step += 1
        items, views = self._active(items, views)
        params = [p for p, _ in items]
        masks = momentum_masks(self.param_groups)
        bounding = self._bounding()
        if not (bounding and any(group["step_bound"] is not None for _, group in items)):
            self._apply_momenta(items, views, masks)  # no bound this step: in batches
            self._count_bounded(False)
            return True
        shortened: list[torch.Tensor] = []
        held: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor, float]] = []
        for p, view in zip(params, views, strict=True):
            group = groups[p]
            denom = self._frozen_denom(p, group)
            m = local(self.state[p]["exp_avg"])
            if group["precondition"]:
                torch.mul(view, denom, out=m)
            else:
                m.copy_(view)
            if masks.get(p) is not None:
                m.mul_(masks[p])
            u = m / denom
            if group["bias_correction"]:
                u.div_(1 - group["betas"][0] ** self.layer_step(p))
            bound = group["step_bound"] if bounding else None
            if bound is not None and self._island is not None:
                held.append((p, group, u, bound))  # applied once every layer's norm is in
                continue
            norm = torch.linalg.vector_norm(u) if bound is not None else None
            self._bounded_apply(p, group, u, bound, norm, shortened)
        if held:  # under FSDP2: the whole layers' norms in one reduction for all of them
            norms = reduce_norms(local_norms([u for _, _, u, _ in held]), self._island)
            for (p, group, u, bound), norm in zip(held, norms, strict=True):
                self._bounded_apply(p, group, u, bound, norm, shortened)
        # One host synchronisation per step, not one per layer.
        self._count_bounded(bool(torch.stack(shortened).any()) if shortened else False)
        return True

    def _apply_momenta(
        self,
        items: list[tuple[torch.Tensor, dict[str, Any]]],
        views: list[torch.Tensor],
        masks: dict[torch.Tensor, torch.Tensor | None],
    ) -> None:
        """A compressed step without the step bound, in batches of layers with torch's
        foreach kernels: each layer's averaged momentum from its view into its state
        (times its mask), and ``p -= lr * (m_hat / d + weight_decay * p)`` with the frozen
        denominator ``d``; the views hold the updates (no other temporaries)."""
        for batch, vs in view_batches(items, views):
            group = batch[0][1]
            denoms = [self._frozen_denom(p, group) for p, _ in batch]
            ms = [local(self.state[p]["exp_avg"]) for p, _ in batch]
            torch._foreach_copy_(ms, vs)
            if group["precondition"]:
                torch._foreach_mul_(ms, denoms)
            for (p, _), m in zip(batch, ms, strict=True):
                if masks.get(p) is not None:
                    m.mul_(masks[p])
            torch._foreach_copy_(vs, ms)
            torch._foreach_div_(vs, denoms)
            if group["bias_correction"]:
                b1 = group["betas"][0]
                torch._foreach_div_(vs, [1 - b1 ** self.layer_step(p) for p, _ in batch])
            masters = [local(self._master(p)) for p, _ in batch]
            if group["weight_decay"]:
                torch._foreach_add_(vs, masters, alpha=group["weight_decay"])
            torch._foreach_add_(masters, vs, alpha=-group["lr"])
            self._write_back_all([p for p, _ in batch], masters)

    def _bounded_apply(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        u: torch.Tensor,
        bound: float | None,
        norm: torch.Tensor | None,
        shortened: list[torch.Tensor],
    ) -> None:
        """Apply ``u`` held to the step bound (``norm``: its whole layer's norm); a flag
        of whether it was shortened goes to ``shortened``."""
        flag = bound_adam_update(self.state[p], u, bound, norm)
        if flag is not None:
            shortened.append(flag)
        self._apply(p, group, u)

    def _apply(self, p: torch.Tensor, group: dict[str, Any], u: torch.Tensor) -> None:
        """``p -= lr * (u + weight_decay * p)`` on the fp32 master (``u`` and the master
        both whole, or both this rank's shard)."""
        master = self._master(p)
        if not is_sharded(u):
            master = local(master)
        if group["weight_decay"]:
            u.add_(master, alpha=group["weight_decay"])
        master.add_(u, alpha=-group["lr"])
        self._write_back(p, master)
