"""1-bit LAMB: large-batch LAMB's convergence with ~1 bit per element on the wire.

Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
LAMB's Convergence Speed", arXiv 2104.06069.

Error feedback cannot be put under LAMB directly: the trust ratio is a nonlinear
function of the update, so compression error would change it. 1-bit LAMB therefore:

* **Warmup** (until ``freeze_step``, or with ``freeze_step="auto"`` until the second
  moment has settled): LAMB (no bias correction, as the reference) on gradients
  averaged by a full-precision allreduce, while keeping an EMA ``c_freeze`` of each
  layer's trust ratio. At the switch the variance ``v`` is frozen and a fresh copy
  ``v_fresh`` keeps tracking the gradients.
* **Compression stage**: gradients stay local. All layers' momenta, first brought to one
  common scale (``scaling_coeff``, fixed at the first compressed step, so one sign+scale
  fits every layer), travel in ONE fused error-compensated 1-bit allreduce per step
  (optionally preconditioned by the frozen ``sqrt(v)`` first, ``precondition=True``). The
  trust ratio becomes ``c_freeze * f``, where ``f`` = max over the layer of
  ``(sqrt(v)+eps) / (sqrt(v_fresh)+eps)`` measures how far the frozen variance has drifted
  from the fresh one (``v_fresh`` is fed with the global gradient reconstructed from the
  momentum), clipped to [factor_min, factor_max] and to +-factor_threshold per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from thinwire.compress.onebit import DEFAULT_BLOCK
from thinwire.optim.base import (
    check_adam_hyperparameters,
    check_range,
    momentum_masks,
    view_batches,
)
from thinwire.optim.floor import DEFAULT_DENOM_FLOOR
from thinwire.optim.freeze import AutoFreeze
from thinwire.optim.lamb import apply_lamb, ratio_of_norms
from thinwire.optim.sharded import local, reduce_norms
from thinwire.optim.step_bound import DEFAULT_STEP_BOUND, bound_lamb_ratio
from thinwire.optim.two_stage import TwoStageOptimizer

__all__ = ["OneBitLamb"]


class OneBitLamb(TwoStageOptimizer):
    """1-bit LAMB, data-parallel, on any torch.distributed backend.

    Args:
        params: parameters or parameter groups (a group may carry ``exp_avg_mask``, as
            for :class:`~thinwire.optim.OneBitAdam`).
        lr: learning rate, as for LAMB.
        freeze_step: when the full-precision warmup ends: ``"auto"`` (once the second
            moment has settled, see :class:`~thinwire.optim.freeze.AutoFreeze`, and at
            30% of ``total_steps`` at the latest; pass an ``AutoFreeze(...)`` to tune
            it), or a step count. The frozen variance and the trust-ratio EMA must be
            representative: a fixed count of 15-25% of the run is the paper's choice.
            Shorter saves bandwidth; too short shows as a loss bump after the freeze
            (the factor ``f`` then hits its clip bounds often, visible in
            :meth:`get_lamb_coeffs`).
        betas, eps, weight_decay: as for LAMB.
        max_coeff, min_coeff: bounds of the warmup trust ratio.
        coeff_beta: EMA rate of the trust ratio during warmup; 0.9 averages about the
            last 10 steps.
        factor_max, factor_min: bounds of the variance-drift factor ``f``.
        factor_threshold: ``f`` may change by at most this fraction per step, which
            damps the noise of the reconstructed gradient.
        bias_correction: as for :class:`~thinwire.optim.OneBitAdam` (on by default;
            ``False`` is the reference's rule). Without it the variance frozen after a few
            hundred steps or fewer is a small fraction of its steady size (``1 - b2^t``),
            and coordinates with small gradients then take huge steps from the +-scale
            noise of the 1-bit momenta (a 120-step GPT run diverged). It also makes the
            warmup exactly :class:`~thinwire.optim.Lamb`'s rule.
        precondition: compress ``m / (sqrt(v_hat)+eps)`` instead of ``m`` (see
            :mod:`thinwire.optim.two_stage`). Off by default here, unlike
            :class:`~thinwire.optim.OneBitAdam`: the drift factor ``f`` reads the
            variance of the gradient reconstructed from the exchanged momentum, and the
            preconditioned exchange's error, proportional to each element's ``sqrt(v)``,
            inflates that variance everywhere alike, so ``f`` sinks to ``factor_min`` and
            the steps shrink. Measured on the tiny GPT (Moby-Dick, 300 steps, freeze at
            45): 2.052 with the paper's rule, 2.190 preconditioned, LAMB 2.029.
        total_steps, denom_floor, block: as for :class:`~thinwire.optim.OneBitAdam`
            (the run's length, which caps the automatic freeze at 30% of it; the floor
            under the frozen denominator; elements per 1-bit scale).
        step_bound: a layer's compressed trust ratio ``c_freeze * f`` is at most this
            many times LAMB's own on the same update: no compressed step is longer than
            that many LAMB steps (:mod:`thinwire.optim.step_bound`). Without it, a
            variance frozen before the gradients grew (a plateau that ends) scales every
            later step up with them. None is the paper's rule.
        process_group: ranks to average over (default: the default group, if any).
            With FSDP2 inside an island, the ranks that hold the same shard in every
            island (``mesh.get_group("replicate")``): each rank then compresses its own
            shards across the islands (:mod:`thinwire.optim.sharded`).
        exchange: the code of the compressed stage's momentum exchange, as for
            :class:`~thinwire.optim.OneBitAdam`.

    With one process it is LAMB in warmup and the same frozen-variance rule afterwards,
    with exact (uncompressed) momenta. The paper's 1-bit LAMB is ``freeze_step=N,
    bias_correction=False``.

    Memory: besides LAMB's state (m, v) it keeps ``v_fresh`` and, in the compression
    stage, ``sqrt(v_hat) + eps`` of the frozen variance (4 bytes per element each; the
    latter is derived, not saved). Each step's temporaries are about three fp32 copies
    of a batch of layers (:data:`~thinwire.optim.base.FUSED_CHUNK` elements at most).
    """

    onset_reads_gradients = True
    """The step bound switches on when the gradients have grown 2x since the freeze
    (:class:`~thinwire.optim.step_bound.GradientGauge`), not the exchanged momentum: its
    reference, LAMB's ratio on the same update, shrinks with the 1-bit noise in that
    update, so a bound switched on by that noise shortens good steps (a ReLU MLP with
    dead units ended at 0.75 against LAMB's 0.49; 0.50 with the gradients)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int | str | AutoFreeze = "auto",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        bias_correction: bool = True,
        precondition: bool = False,
        denom_floor: float = DEFAULT_DENOM_FLOOR,
        step_bound: float | None = DEFAULT_STEP_BOUND,
        block: int | None = DEFAULT_BLOCK,
        total_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        exchange: str = "onebit",
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        check_range("min_coeff", min_coeff, 0.0, float("inf"), lo_open=True)
        check_range("max_coeff", max_coeff, min_coeff, float("inf"))
        check_range("coeff_beta", coeff_beta, 0.0, 1.0, hi_open=True)
        check_range("factor_min", factor_min, 0.0, float("inf"), lo_open=True)
        check_range("factor_max", factor_max, factor_min, float("inf"))
        check_range("factor_threshold", factor_threshold, 0.0, 1.0, hi_open=True)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
            bias_correction=bias_correction,
            precondition=precondition,
            denom_floor=denom_floor,
            step_bound=step_bound,
        )
        super().__init__(params, defaults, freeze_step, process_group, block, total_steps, exchange)
        self.last_coeffs: list[float] = []
        self.last_factors: list[float] = []

    # ------------------------------------------------------------------ warmup

    def _warmup_step(self) -> bool:
        items = self._averaged_grads()
        if items is None:
            return False
        self.global_step += 1

        def track(group: dict[str, Any], state: dict[str, Any], c: float) -> None:
            # The EMA of the trust ratio that the compressed stage starts from.
            state.setdefault("last_factor", 1.0)
            beta = group["coeff_beta"]
            state["lamb_coeff_freeze"] = beta * state.get("lamb_coeff_freeze", 0.0) + (1 - beta) * c

        coeffs = apply_lamb(self, items, self.global_step, track)
        self.last_coeffs, self.last_factors = coeffs, [1.0] * len(coeffs)
        return True

    def _measure_change(self) -> float | None:
        """The automatic freeze also waits for the trust ratios: after the switch each layer
        steps with its frozen ``c_freeze`` (times the bounded drift factor ``f``), so
        freezing while LAMB's ratio is still climbing leaves every later step too short
        (on the tiny GPT the ratio rose from 0.5 to 1.9 between steps 45 and 90)."""
        variance = super()._measure_change()
        current, reference = [], []
        for p, _ in self._momentum_params():
            state = self.state[p]
            coeff = state.get("lamb_coeff_freeze", 0.0)
            if "freeze_ref_coeff" in state:
                reference.append(state["freeze_ref_coeff"])
                current.append(coeff)
            state["freeze_ref_coeff"] = coeff
        if variance is None or not reference:
            return variance
        total = sum(abs(r) for r in reference)
        moved = sum(abs(c - r) for c, r in zip(current, reference, strict=True))
        self.freeze_signals["trust_ratio"] = moved / total if total > 0 else math.inf
        return max(self.freeze_signals.values())

    def _on_freeze(self) -> None:
        for p, _ in self._momentum_params():
            self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()

    # ------------------------------------------------------------------ compression

    def _compression_step(self) -> bool:
        items = self._momentum_params()
        params, groups = [p for p, _ in items], dict(items)
        if params and "scaling_coeff" not in self.state[params[0]]:
            self._set_scaling_coeffs(items)

        views = self._compressed_average(
            params, lambda vs: self._fill_momenta(items, vs, scaled=True), lambda: self._gauge
        )
        if views is None:
            return False
        self.global_step += 1
        items, views = self._active(items, views)
        params = [p for p, _ in items]
        bounding = self._bounding()
        masks = momentum_masks(self.param_groups)
        # Two passes: every layer's new momentum, its update (into the exchange's view,
        # no longer needed) and this rank's share of the layer's numbers first, in
        # batches of layers with torch's foreach kernels; then those numbers reduced over
        # the island in ONE collective (not five per layer: under FSDP2 each is a round
        # trip of its own) and read back in one host sync; then the updates.
        shares = [
            self._new_momenta(batch, vs, masks, bounding)
            for batch, vs in view_batches(items, views)
        ]
        stats = self._layer_stats(torch.cat(shares)) if shares else []
        coeffs, factors, scales, bounded = [], [], [], False
        for p, (drift, u_norm, full, w_norm) in zip(params, stats, strict=True):
            group, state = groups[p], self.state[p]
            f = drift
            if group["weight_decay"]:
                rho = min(1.0, u_norm / full) if full > 0 else 1.0
                f = f * rho + (1 - rho)
            f = self._damped_factor(f, group, state)
            lamb_ratio = ratio_of_norms(w_norm, full, group["min_coeff"], group["max_coeff"])
            bound = group["step_bound"] if bounding else None
            coeff, shortened = bound_lamb_ratio(state["lamb_coeff_freeze"] * f, lamb_ratio, bound)
            bounded |= shortened
            scales.append(-group["lr"] * coeff)
            coeffs.append(coeff)
            factors.append(f)
        masters = [local(self._master(p)) for p in params]
        if params:
            torch._foreach_mul_(views, scales)
            torch._foreach_add_(masters, views)
        self._write_back_all(params, masters)
        self.last_coeffs, self.last_factors = coeffs, factors
        self._count_bounded(bounded)
        return True

    def _new_momenta(
        self,
        batch: list[tuple[torch.Tensor, dict[str, Any]]],
        views: list[torch.Tensor],
        masks: dict[torch.Tensor, torch.Tensor | None],
        bounding: bool,
    ) -> torch.Tensor:
        """For each layer of ``batch`` (one parameter group): take its averaged momentum
        from its view into its state (times the momentum's mask, if any), feed the
        gradient it implies to the fresh variance, and leave the layer's update in the
        view. Returns this rank's share of each layer's numbers (layers x 4, float64):
        the largest drift of the frozen variance from the fresh one, the update's norm
        before and after weight decay, and the weights' norm (0 when the step bound is
        off). Torch's foreach kernels: a few launches for the batch, none per layer."""
        group = batch[0][1]
        b1, b2 = group["betas"]
        t, eps = self.global_step, group["eps"]
        corrected = group["bias_correction"]
        states = [self.state[p] for p, _ in batch]
        # This rank's shard of every tensor (the whole tensor without FSDP2).
        ms = [local(s["exp_avg"]) for s in states]
        v_fresh = [local(s["exp_avg_sq_fresh"]) for s in states]
        denoms = [self._frozen_denom(p, group) for p, _ in batch]
        masters = [local(self._master(p)) for p, _ in batch]
        torch._foreach_div_(views, [s["scaling_coeff"] for s in states])
        if group["precondition"]:
            torch._foreach_mul_(views, denoms)
        # The averaged momentum implies the averaged gradient; feed it to v_fresh.
        g_rec = torch._foreach_sub(views, torch._foreach_mul(ms, b1))
        torch._foreach_div_(g_rec, 1 - b1)
        torch._foreach_mul_(v_fresh, b2)
        torch._foreach_addcmul_(v_fresh, g_rec, g_rec, value=1 - b2)
        del g_rec
        torch._foreach_copy_(ms, views)
        for (p, _), m in zip(batch, ms, strict=True):
            if masks.get(p) is not None:
                m.mul_(masks[p])
        # Drift of the frozen variance from the fresh one: the ratio of their
        # denominators, max over the layer (both positive: the inf-norm). The frozen one
        # is read as it was (not floored): an element the floor raised would otherwise
        # read as drift.
        vs = [local(s["exp_avg_sq"]) for s in states]
        fresh, frozen = (
            (
                torch._foreach_div(v_fresh, 1 - b2**t),
                torch._foreach_div(vs, 1 - b2**self.freeze_step),
            )
            if corrected
            else (torch._foreach_mul(v_fresh, 1.0), torch._foreach_mul(vs, 1.0))
        )
        for x in (fresh, frozen):  # in place: two batch-sized temporaries at most
            torch._foreach_sqrt_(x)
            torch._foreach_add_(x, eps)
        torch._foreach_div_(frozen, fresh)
        # An empty shard has no largest element: -inf, which the island's max ignores.
        filled = [x for x in frozen if x.numel()]
        maxima = iter(torch._foreach_norm(filled, math.inf) if filled else [])
        drifts = [next(maxima) if x.numel() else x.new_full((), -math.inf) for x in frozen]
        del fresh, frozen
        # The update replaces the momentum in the views.
        torch._foreach_copy_(views, ms)
        if corrected:
            torch._foreach_div_(views, 1 - b1**t)
        torch._foreach_div_(views, denoms)
        u_norms = torch._foreach_norm(views)
        full = u_norms
        if group["weight_decay"]:
            torch._foreach_add_(views, masters, alpha=group["weight_decay"])
            full = torch._foreach_norm(views)
        columns = [torch.stack(drifts), torch.stack(u_norms), torch.stack(full)]
        if bounding:
            columns.append(torch.stack(torch._foreach_norm(masters)))
        else:
            columns.append(torch.zeros_like(columns[0]))
        return torch.stack([c.double() for c in columns], dim=1)

    def _layer_stats(self, mine: torch.Tensor) -> list[tuple[float, float, float, float]]:
        """Every layer's numbers (:meth:`_new_momenta`, layers x 4, on the parameters'
        device) for the whole layer: this rank's own without FSDP2; under FSDP2 the
        island's shares gathered in one collective, the drifts maxed and the norms
        combined (an empty shard adds nothing)."""
        if self._island is not None:
            parts = [torch.empty_like(mine) for _ in range(self._island.size())]
            dist.all_gather(parts, mine, group=self._island)
            every = torch.stack(parts)  # ranks x layers x 4
            mine = torch.cat(
                [every[:, :, :1].amax(dim=0), every[:, :, 1:].square().sum(dim=0).sqrt()], dim=1
            )
        return [tuple(row) for row in mine.tolist()]

    @staticmethod
    def _damped_factor(f: float, group: dict[str, Any], state: dict[str, Any]) -> float:
        """The drift factor within its bounds, and within ``factor_threshold`` of the
        last step's (kept in ``state``)."""
        f = min(max(f, group["factor_min"]), group["factor_max"])
        last = state["last_factor"]
        thr = group["factor_threshold"]
        f = min(max(f, last * (1 - thr)), last * (1 + thr))
        state["last_factor"] = f
        return f

    def _on_rewarm(self) -> None:
        # The fresh variance, the layers' scales and the drift factor belong to the stale
        # compression stage; the next freeze sets them up again.
        for p, _ in self._momentum_params():
            state = self.state[p]
            for key in ("exp_avg_sq_fresh", "scaling_coeff"):
                state.pop(key, None)
            state["last_factor"] = 1.0

    def _set_scaling_coeffs(self, items: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Bring every layer's (preconditioned) momentum to the mean RMS, so one 1-bit
        scale fits all."""
        norms = []
        for p, group in items:
            m = local(self.state[p]["exp_avg"])
            if group["precondition"]:
                m = m / self._frozen_denom(p, group)
            norms.append(torch.linalg.vector_norm(m))
        # The whole layers' norms, read back together (p.numel() is the whole layer's).
        whole = reduce_norms(torch.stack(norms), self._island).tolist() if norms else []
        rms = [n / math.sqrt(max(1, p.numel())) for n, (p, _) in zip(whole, items, strict=True)]
        nonzero = [s for s in rms if s > 0]
        mean = sum(nonzero) / len(nonzero) if nonzero else 1.0
        for (p, _), s in zip(items, rms, strict=True):
            # A layer with all-zero momentum at the switch keeps scale 1 (nothing to match).
            self.state[p]["scaling_coeff"] = mean / s if s > 0 else 1.0

    # ------------------------------------------------------------------ introspection

    def get_lamb_coeffs(self) -> list[tuple[float, float, float]]:
        """Per parameter, in order: (trust ratio used in the last step, its frozen EMA
        ``c_freeze``, variance-drift factor ``f``; 1 in warmup)."""
        out = []
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                frozen = self.compressing and not p.requires_grad  # see _active
                if "exp_avg" not in state or frozen or i >= len(self.last_coeffs):
                    continue
                out.append((self.last_coeffs[i], state["lamb_coeff_freeze"], self.last_factors[i]))
                i += 1
        return out

    def _extra_state(self) -> dict[str, Any]:
        return {
            **super()._extra_state(),
            "last_coeffs": self.last_coeffs,
            "last_factors": self.last_factors,
        }

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        super()._load_extra_state(extra)
        self.last_coeffs = list(extra["last_coeffs"])
        self.last_factors = list(extra["last_factors"])
