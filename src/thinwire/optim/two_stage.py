"""The two stages of 1-bit Adam and 1-bit LAMB: a full-precision warmup, then compression.

:class:`TwoStageOptimizer` owns what both optimizers share:

* **When to switch.** ``freeze_step`` is a step count, or ``"auto"`` / an
  :class:`~thinwire.optim.freeze.AutoFreeze` that ends the warmup once the second moment
  has settled (measured on the run, decided alike on every rank, capped).
* **The frozen denominator** ``sqrt(v_hat) + eps`` of every parameter, computed once
  after the switch (it is constant from then on).
* **Preconditioned compression** (``precondition=True``, 1-bit Adam's default). The papers
  compress the momentum ``m`` and divide the exchanged average by ``sqrt(v)`` afterwards.
  The 1-bit exchange replaces every element by ``+-scale``, one scale per segment of the
  fused buffer, so an element whose momentum is far below the segment's average gets an
  error of about ``scale`` - and dividing that by its own small ``sqrt(v)`` (rare tokens'
  embedding rows, for instance) turns it into a step many times ``lr``. Compressing the
  preconditioned momentum ``m / (sqrt(v_hat) + eps)`` instead puts every element on the
  scale of its own update: the error of one exchange is at most about ``lr`` per element,
  like one Adam step, and error feedback still returns it in later steps (the map is
  linear and fixed after the freeze, so the averaged momentum is the same). On the tiny
  GPT (2 workers, 80 steps, freeze at 20) it took 1-bit Adam from 1.064x and 1.358x
  AdamW's loss to 1.010x and 1.017x (seeds 0, 1). 1-bit LAMB keeps the papers' rule by
  default: its drift factor reads a variance that the preconditioned exchange's error
  inflates (see :class:`~thinwire.optim.OneBitLamb`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record
from thinwire.comm.momentum_exchange import check_exchange
from thinwire.compress.onebit import check_block
from thinwire.optim.amp import note_scaler_verdict, unscale_for_scaler
from thinwire.optim.base import CommOptimizer, check_range, view_batches
from thinwire.optim.floor import FloorReport, floor_denominators, layer_reference
from thinwire.optim.freeze import (
    DEFAULT_CAP_SHARE,
    NO_FREEZE_WARNING_STEP,
    AutoFreeze,
    relative_change,
)
from thinwire.optim.sharded import gather_layer, local, sum_over
from thinwire.optim.stale import StaleGuard
from thinwire.optim.step_bound import ONSET, GradientGauge, check_step_bound

__all__ = ["TwoStageOptimizer"]

_log = logging.getLogger("thinwire.optim")


class TwoStageOptimizer(CommOptimizer):
    """A full-precision warmup, then a compression stage.

    Subclasses implement ``_warmup_step()`` and ``_compression_step()``; each returns
    False (and changes nothing) when the step must be skipped for non-finite values, and
    advances :attr:`global_step` itself when it applies an update. A subclass that needs
    to prepare for compression (e.g. copy ``v``) overrides :meth:`_on_freeze`.
    """

    island_only = True

    onset_reads_gradients = False
    """What switches the step bound on: the gradients' growth (:class:`GradientGauge`) or
    the exchanged momentum's (the stale guard's measure; see the subclasses)."""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        freeze_step: int | str | AutoFreeze,
        process_group: dist.ProcessGroup | None = None,
        block: int | None = None,
        total_steps: int | None = None,
        exchange: str = "onebit",
    ) -> None:
        check_block(block)
        check_exchange(exchange)
        self.exchange = exchange
        """The code of the compressed stage's momentum exchange
        (:mod:`thinwire.comm.momentum_exchange`)."""
        check_range("denom_floor", defaults["denom_floor"], 0.0, 1.0)
        check_step_bound(defaults["step_bound"])
        self.auto_freeze: AutoFreeze | None = None
        self.freeze_step: int | None = None
        self.total_steps = total_steps
        # "auto" with no idea of the run's length: the one case that warns when the
        # warmup runs long (an AutoFreeze given explicitly carries the user's own cap).
        self._unbounded = freeze_step == "auto" and total_steps is None
        if isinstance(freeze_step, AutoFreeze):
            if total_steps is not None:
                raise ValueError(
                    "give total_steps with freeze_step='auto', or an AutoFreeze with its own "
                    "max_step, not both"
                )
            # A copy: the rule records the run's decision, and one AutoFreeze given to two
            # optimizers must not make the second one think it has already frozen.
            self.auto_freeze = dataclasses.replace(freeze_step)
        elif freeze_step == "auto":
            known = total_steps is not None
            self.auto_freeze = AutoFreeze.for_run(total_steps) if known else AutoFreeze()
        elif isinstance(freeze_step, (str, bool)):
            raise ValueError(f"freeze_step must be a step count or 'auto', got {freeze_step!r}")
        else:
            check_range("freeze_step", freeze_step, 1, float("inf"))
            self.freeze_step = int(freeze_step)
            if total_steps is not None:
                AutoFreeze.for_run(total_steps)  # the same check of total_steps
        self._warmup_length = self.freeze_step  # again, for a layer that joins late
        self._refreeze = False  # freeze_step was moved by such a return to the warmup
        super().__init__(params, defaults, process_group)
        if self.sharded and any(g.get("exp_avg_mask") is not None for g in self.param_groups):
            raise ValueError(
                f"{type(self).__name__}: exp_avg_mask is for whole parameters, not FSDP2 "
                "shards; leave it out when the model is sharded"
            )
        self.onebit_block = block
        never = self.freeze_step is not None and total_steps is not None
        if never and self.freeze_step >= total_steps and self._speaks:
            _log.warning(
                "%s: freeze_step=%d is not before total_steps=%d: this run will never "
                "compress (every step sends full-precision gradients)",
                type(self).__name__,
                self.freeze_step,
                total_steps,
            )
        # Derived, not state: rebuilt from exp_avg_sq after a load_state_dict.
        self._denoms: dict[torch.Tensor, torch.Tensor] = {}
        self.floor_report: FloorReport | None = None
        """What :mod:`~thinwire.optim.floor` did to the frozen denominators (after the
        first compressed step)."""
        self.freeze_signals: dict[str, float] = {}
        """The relative changes measured at the last check of the automatic freeze."""
        self.stale = StaleGuard()
        """Watches the compressed stage for a variance the gradients outgrew
        (:mod:`thinwire.optim.stale`)."""
        self.bounded_steps = 0
        """Compressed steps in which the step bound shortened at least one layer's step
        (:mod:`thinwire.optim.step_bound`)."""
        self._lift_variance = False  # the next warmup step follows a stale freeze
        self._saved_in_warmup = False
        self.gauge = GradientGauge()
        """How much the gradients grew since the freeze (the step bound's onset)."""
        self._gauge: torch.Tensor | float = 0.0  # this step's sum of ||g / d||^2
        self._idle: set[torch.Tensor] | None = None  # trained, no gradient in the warmup
        self._late_warned = False

    @property
    def compressing(self) -> bool:
        """True once the next step is in the compression stage."""
        return self.freeze_step is not None and self.global_step >= self.freeze_step

    @property
    def onebit_tuned(self) -> bool | None:
        """Whether the 1-bit collective runs at its final piece count and phase-2 scheme
        (None before the first compressed step). On CPU it tunes itself over its first
        ~20 calls; steps after that show the steady speed."""
        return None if self._onebit is None else bool(self._onebit.tuned)

    def needs_averaged_grads(self) -> bool:
        return not self.compressing

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        unscale_for_scaler(self)
        if self.compressing:
            self._joined()  # may go back to the warmup, before anything is exchanged
        if self.compressing:
            self._gauge = 0.0
            ok = self._compression_step()
            if ok:
                self.gauge.observe(self.exchanged_side)
                self._watch_staleness(self.exchanged_energy)
        else:
            ok = self._warmup_step()
            if ok:
                self._lift_variance = False
                self._maybe_freeze()
        note_scaler_verdict(self, ok)
        if ok:
            self._took_step()
        else:
            self._skip()
        return loss

    def _warmup_step(self) -> bool:
        raise NotImplementedError

    def _update_moments(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """Adam's moments fed ``p.grad``; on the first warmup step after a stale freeze,
        ``v`` is first lifted to cover this step's gradients (``v_hat >= g^2``). It was
        frozen while the gradients grew, and at ``beta2 = 0.999`` it would take hundreds
        of steps to catch up, with steps of up to ``|g| / sqrt(v)`` times lr meanwhile
        (measured on the zoo's BERT at the larger size, 3 seeds: 1-bit Adam ended at
        0.951 accuracy without the lift, 0.978 with it; AdamW 0.986). The lift has a
        cost where one batch's gradients are not typical: the bag-of-words model's rare
        rows keep a lifted ``v`` for hundreds of steps (0.978 without, 0.957 with it;
        AdamW 0.973), still within 3%. (These with the step bound on every compressed
        step; with it waiting for 2x growth, as now: BERT 0.984, bag of words 0.960.) Two alternatives measured worse on BERT: scaling
        each layer's ``v`` as a whole (seed 0: BERT 0.843, bag of words 0.959), and
        holding the re-warmup's steps to the step bound instead of lifting ``v`` (BERT
        0.952, bag of words 0.979); lifting only layers whose gradient energy is 4x their
        ``v``'s did not spare the bag of words (0.958; BERT 0.957)."""
        self._lift(p, group)
        return super()._update_moments(p, group)

    def _update_moments_all(
        self, items: list[tuple[torch.Tensor, dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        for p, group in items:
            self._lift(p, group)
        return super()._update_moments_all(items)

    def _lift(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Lift ``v`` to this step's ``g^2`` on the first step after a stale freeze."""
        state = self.state[p]
        if self._lift_variance and "exp_avg_sq" in state and p.grad is not None:
            b2, t = group["betas"][1], self.layer_step(p)
            corr = 1 - b2**t if group["bias_correction"] else 1.0
            g = p.grad.float()
            torch.maximum(state["exp_avg_sq"], g * g * corr, out=state["exp_avg_sq"])

    def _compression_step(self) -> bool:
        raise NotImplementedError

    def _on_freeze(self) -> None:
        """Called once, right after the last warmup step."""

    # ------------------------------------------------------------------ the switch

    def _maybe_freeze(self) -> None:
        t = self.global_step
        rule = self.auto_freeze
        name = type(self).__name__
        if rule is None:
            if t == self.freeze_step:
                self._switch(f"warmup ended at step {t} (freeze_step={t})")
            return
        if rule.decided_at is not None:
            return
        change = None
        if rule.is_check_step(t):
            # Every rank feeds the rule rank 0's measurement, so every rank keeps the same
            # rule state and reaches the same decision at the same step: no collective
            # ever depends on a locally rounded number.
            change = self._agree(self._measure_change())
        reason = rule.decide(t, change)
        if reason is None:
            if t == NO_FREEZE_WARNING_STEP and self._unbounded and self._speaks:
                _log.warning(
                    "%s: no compression yet at step %d: %s; pass total_steps=<your run's "
                    "steps> to cap the warmup at %.0f%% of it, or freeze_step=N",
                    name,
                    t,
                    rule.pending(),
                    100 * DEFAULT_CAP_SHARE,
                )
            return
        rule.commit(t, reason)
        self.freeze_step = t
        self._switch(rule.describe())

    def _switch(self, why: str) -> None:
        """Enter the compression stage: free the automatic freeze's references (one fp32
        copy of every parameter, held only during the warmup), prepare, freeze the
        denominators, and say so in one line (logging, INFO, rank 0)."""
        for p, _ in self._momentum_params():
            for key in [k for k in self.state[p] if k.startswith("freeze_ref")]:
                del self.state[p][key]
        self._on_freeze()
        self._idle, self._refreeze = set(self._without_momentum()), False
        self._freeze_denominators()
        self.stale.arm(0.0)  # armed by the first compressed step's exchange
        self.gauge.arm()
        if self._speaks:
            floor = self.floor_report.describe() if self.floor_report is not None else ""
            _log.info(
                "%s: %s; 1-bit compression from step %d%s",
                type(self).__name__,
                why,
                self.global_step + 1,
                f"; {floor}" if floor else "",
            )

    def _fill_momenta(
        self,
        items: list[tuple[torch.Tensor, dict[str, Any]]],
        views: list[torch.Tensor],
        scaled: bool = False,
    ) -> None:
        """Write each layer's new momentum ``b1*m + (1-b1)*g`` into its view of the
        exchange's buffer: divided by the frozen denominator where the group
        preconditions, times the layer's ``scaling_coeff`` when ``scaled``. When the
        onset reads gradients, add ``||g / d||^2`` of this rank's gradients to the step's
        :class:`~thinwire.optim.step_bound.GradientGauge` number first (the views are
        its scratch). In batches of layers with torch's foreach kernels."""
        for batch, vs in view_batches(items, views):
            group = batch[0][1]
            b1 = group["betas"][0]
            denoms = [self._frozen_denom(p, group) for p, _ in batch]
            fed = [i for i, (p, _) in enumerate(batch) if p.grad is not None]
            grads = [local(batch[i][0].grad).float() for i in fed]
            if grads and self.onset_reads_gradients:  # else nobody reads it
                scratch = [vs[i] for i in fed]
                torch._foreach_copy_(scratch, grads)
                torch._foreach_div_(scratch, [denoms[i] for i in fed])
                norms = torch._foreach_norm(scratch)
                self._gauge = self._gauge + torch.stack(norms).square().sum()
            torch._foreach_copy_(vs, [local(self.state[p]["exp_avg"]) for p, _ in batch])
            torch._foreach_mul_(vs, b1)
            if grads:
                torch._foreach_add_([vs[i] for i in fed], grads, alpha=1 - b1)
            if group["precondition"]:
                torch._foreach_div_(vs, denoms)
            if scaled:
                torch._foreach_mul_(vs, [self.state[p]["scaling_coeff"] for p, _ in batch])
            for (p, _), v in zip(batch, vs, strict=True):
                if not p.requires_grad:  # frozen since the switch: sends nothing new
                    v.zero_()

    @staticmethod
    def _active(
        items: list[tuple[torch.Tensor, dict[str, Any]]], views: list[torch.Tensor]
    ) -> tuple[list[tuple[torch.Tensor, dict[str, Any]]], list[torch.Tensor]]:
        """The layers a compressed step updates, with their views: those that still train.
        A layer frozen since the switch (``requires_grad_(False)``) keeps its place in
        the exchange's buffer (the layout and the error feedback are per element), but
        neither it nor its momentum moves, as ``torch.optim`` leaves a layer with no
        gradient; its momentum is there again when it trains again."""
        keep = [i for i, (p, _) in enumerate(items) if p.requires_grad]
        if len(keep) == len(items):
            return items, views
        return [items[i] for i in keep], [views[i] for i in keep]

    def _watch_staleness(self, energy: float) -> None:
        """Feed one compressed step's exchanged energy; on a stale variance, go back to
        the warmup (automatic freeze) or warn once (a fixed freeze_step)."""
        if not self.stale.reference > 0:
            self.stale.arm(energy)  # the first compressed step: no residual yet
            return
        growth = self.stale.observe(energy)
        if growth is None:
            return
        name, t, rule = type(self).__name__, self.global_step, self.auto_freeze
        why = (
            f"the frozen variance went stale at step {t}: the momentum it preconditions "
            f"grew {growth:.1f}x since the freeze at step {self.freeze_step} (the gradients "
            "outgrew it, e.g. the loss began to fall after a plateau)"
        )
        if rule is None or self.stale.rewarmups >= self.stale.max_rewarmups:
            if not self.stale.warned and self._speaks:
                keep = (
                    f"freeze_step={self.freeze_step} is kept; a later one, or 'auto', would "
                    "re-estimate it"
                    if rule is None
                    else f"compression stays on after {self.stale.rewarmups} returns to the warmup"
                )
                _log.warning("%s: %s; %s", name, why, keep)
            self.stale.warned = True
            return
        self.stale.rewarmups += 1
        self._back_to_warmup(why)
        self._lift_variance = True

    def _back_to_warmup(self, why: str) -> None:
        """Undo the switch (``why``: the reason, said in one line): the full-precision
        warmup goes on, to freeze again once the statistics settle (automatic freeze) or
        after as many steps as the configured warmup had (a fixed ``freeze_step``)."""
        t, rule = self.global_step, self.auto_freeze
        if rule is not None:
            rule.restart(t, t + max(self.freeze_step or 0, rule.window * (rule.patience + 1)))
            self.freeze_step, until = None, rule.max_step
            plan = f"to freeze again once the statistics settle (step {until:,} at the latest)"
        else:
            self.freeze_step = until = t + (self._warmup_length or 1)
            self._refreeze = True
            plan = f"to freeze again at step {until:,}"
        if self.total_steps is not None and until >= self.total_steps:
            plan += f", after this run's {self.total_steps:,} steps: it ends uncompressed"
        self._denoms = {}
        self._idle = None
        if self._onebit is not None:
            self._onebit.reset()  # its residuals belong to the undone stage
        for p, _ in self._momentum_params():
            # The momentum carries the 1-bit exchange's noise, also where the warmup's
            # exact gradients are 0 (dead units): divided by their v ~ 0 that is a step of
            # many times lr (measured: the CNN's loss went from 0.7 to 3190 in one step).
            self.state[p]["exp_avg"].zero_()
        self._on_rewarm()
        self.stale.arm(0.0)
        self.gauge.arm()
        if self._speaks:
            _log.warning(
                "%s: %s; back to the full-precision warmup, %s", type(self).__name__, why, plan
            )

    def _joined(self) -> None:
        """Before a compressed step: go back to the warmup if layers began to train
        since the switch (unfrozen with ``requires_grad_(True)``, or added with
        ``add_param_group``). They have no variance to precondition them and no place in
        the exchange's buffer, so the compressed stage alone would never move them; a
        short warmup estimates their statistics and freezes again. Decided from
        ``requires_grad`` and the optimizer's state, alike on every rank: no collective.

        A layer that trains but had no gradient in the whole warmup (an unused head, an
        expert no batch reached) stays out; should it get one later, this rank says so
        once (it does not train in the compressed stage)."""
        without = self._without_momentum()
        if self._idle is None:  # a state saved before the set was kept: as it is now
            self._idle = set(without)
            return
        joined = [p for p in without if p not in self._idle]
        if joined:
            self._back_to_warmup(
                f"{len(joined)} parameter(s) began to train after the switch at step "
                f"{self.freeze_step} (requires_grad turned on, or add_param_group)"
            )
            return
        late = sum(p.grad is not None for p in self._idle)
        if late and not self._late_warned:
            self._late_warned = True
            _log.warning(
                "%s: rank %d: %d parameter(s) have gradients but had none in the warmup: "
                "the compressed stage does not train them (no variance was estimated); "
                "turn their requires_grad off and on again to re-estimate it",
                type(self).__name__,
                self.rank,
                late,
            )

    def _without_momentum(self) -> list[torch.Tensor]:
        """The parameters that train (``requires_grad``) but have no momentum yet."""
        return [
            p
            for group in self.param_groups
            for p in group["params"]
            if p.requires_grad and "exp_avg" not in self.state[p]
        ]

    def _on_rewarm(self) -> None:
        """Called when a stale freeze is undone: drop what the compression stage built."""

    def _bounding(self) -> bool:
        """Whether the step bound applies to this compressed step: past ``ONSET`` times the
        first compressed step's size, of the gradients (:attr:`onset_reads_gradients`,
        this step's number included) or of the exchanged momentum
        (:mod:`thinwire.optim.step_bound`)."""
        if self.onset_reads_gradients:
            return self.gauge.growth_with(self.exchanged_side) > ONSET
        ref = self.stale.reference
        return ref > 0 and self.exchanged_energy > ONSET**2 * ref

    def _count_bounded(self, bounded: bool) -> None:
        """Count a compressed step the step bound shortened; say so once (INFO, rank 0)."""
        if not bounded:
            return
        self.bounded_steps += 1
        if self.bounded_steps == 1 and self._speaks:
            _log.info(
                "%s: step %d: the step bound shortened a compressed step to the uncompressed "
                "optimizer's length (the gradients outgrew the variance frozen at step %s; "
                "counted in bounded_steps)",
                type(self).__name__,
                self.global_step,
                self.freeze_step,
            )

    def _measure_change(self) -> float | None:
        """Relative change of what will be frozen since the previous check (None at the
        first): here every denominator ``sqrt(v_hat)+eps``, bias-corrected whatever the
        update rule (the raw ``v`` of a rule without bias correction keeps growing as
        ``1 - beta2^t`` long after it has settled). Stores the current values as the next
        reference (``state["freeze_ref"]``, saved with the optimizer, so a resumed run
        decides exactly as the straight one); subclasses that freeze more add theirs to
        :attr:`freeze_signals` and return the largest change."""
        current, reference = [], []
        for p, group in self._momentum_params():
            state = self.state[p]
            d = self._denominator(state["exp_avg_sq"], group, self.layer_step(p), corrected=True)
            if "freeze_ref" in state:
                reference.append(state["freeze_ref"])
                current.append(d)
            state["freeze_ref"] = d
        if not reference:
            return None
        self.freeze_signals = {"variance": relative_change(current, reference, self._island)}
        return self.freeze_signals["variance"]

    def _agree(self, change: float | None) -> float | None:
        """Rank 0's measured change on every rank (one float64; NaN stands for None)."""
        if self.world_size == 1:
            return change
        device = self._params()[0].device  # NCCL groups take device tensors only
        box = torch.tensor([math.nan if change is None else change], dtype=torch.float64)
        box = box.to(device)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        dist.broadcast(box, src=src, group=self.process_group)
        record("optim.freeze", 8, 8)
        value = float(box)
        return None if math.isnan(value) else value

    # ------------------------------------------------------------------ frozen variance

    @staticmethod
    def _denominator(
        v: torch.Tensor,
        group: dict[str, Any],
        t: int,
        corrected: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sqrt(v_hat) + eps`` at step ``t`` (into ``out`` if given): bias-corrected
        when the group asks, or when ``corrected``."""
        out = torch.empty_like(v) if out is None else out
        if group["bias_correction"] or corrected:
            torch.div(v, 1 - group["betas"][1] ** t, out=out)
        else:
            out.copy_(v)
        return out.sqrt_().add_(group["eps"])

    def _frozen_denom(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The denominator of the frozen variance, floored (:mod:`thinwire.optim.floor`):
        constant after the freeze, so it is computed once for every parameter (4 bytes
        per element) instead of every step."""
        denom = self._denoms.get(p)
        if denom is None:
            self._freeze_denominators()
            denom = self._denoms[p]
        return denom

    def _freeze_denominators(self) -> None:
        assert self.freeze_step is not None
        items = self._momentum_params()
        # This rank's shard of each layer (the whole layer without FSDP2).
        denoms = [
            self._denominator(
                local(self.state[p]["exp_avg_sq"]), group, self.layer_step(p, self.freeze_step)
            )
            for p, group in items
        ]
        eps = [group["eps"] for _, group in items]
        references = None
        if self._island is not None:  # the floor's median is the whole layer's
            references = [
                layer_reference(gather_layer(d, p), e) if group["denom_floor"] > 0 else None
                for (p, group), d, e in zip(items, denoms, eps, strict=True)
            ]
        report = floor_denominators(
            denoms, [group["denom_floor"] for _, group in items], eps, references
        )
        device = denoms[0].device if denoms else None
        elements, zeros, raised = sum_over(
            [report.elements, report.zeros, report.raised], self._island, device
        )
        self.floor_report = FloorReport(int(elements), int(zeros), int(raised))
        self._denoms = {p: d for (p, _), d in zip(items, denoms, strict=True)}

    def _momentum_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, group) of every parameter with momentum: the same set on every
        rank, so the fused compressed buffer has the same layout everywhere."""
        return [
            (p, group)
            for group in self.param_groups
            for p in group["params"]
            if "exp_avg" in self.state[p]
        ]

    # ------------------------------------------------------------------ state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "thinwire" not in state_dict and state_dict.get("state"):
            raise ValueError(
                f"{type(self).__name__} state without its per-rank part ('thinwire': error "
                "feedback, step and freeze counters), as torch.distributed.checkpoint."
                "state_dict's get/set_optimizer_state_dict leave it: save and load "
                "opt.state_dict() itself, e.g. dcp.save({'optim': opt.state_dict()})"
            )
        self._denoms = {}  # the frozen variance may be another one now
        self._idle = None
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # State saved before the option existed compressed the raw momentum; the
            # floor did not exist either (0 keeps such a run's arithmetic).
            group.setdefault("precondition", False)
            group.setdefault("denom_floor", 0.0)
            group.setdefault("step_bound", None)
        if self.compressing and self._saved_in_warmup:
            # A fixed freeze step this run has already passed, while the saved run was
            # still in its warmup: switch now, rather than compress with nothing frozen.
            self.freeze_step = self.global_step
            self._switch(
                f"the loaded state was in its warmup at step {self.global_step}, past "
                "this optimizer's freeze_step"
            )
        elif self.compressing:
            for p, _ in self._momentum_params():
                for key in [k for k in self.state[p] if k.startswith("freeze_ref")]:
                    del self.state[p][key]

    def _extra_state(self) -> dict[str, Any]:
        extra = {**super()._extra_state(), "global_step": self.global_step}
        extra["freeze_step"] = -1 if self.freeze_step is None else self.freeze_step
        extra["bounded_steps"] = self.bounded_steps
        extra["lift_variance"] = int(self._lift_variance)
        extra["refreeze"] = int(self._refreeze)
        if self._idle is not None:  # by position: what _joined does not count as new
            extra["idle"] = [i for i, p in enumerate(self._params()) if p in self._idle]
        extra |= {f"stale_{k}": v for k, v in self.stale.state_dict().items()}
        extra |= {f"gauge_{k}": v for k, v in self.gauge.state_dict().items()}
        if self.auto_freeze is not None:
            extra |= {f"auto_freeze_{k}": v for k, v in self.auto_freeze.state_dict().items()}
            extra |= {f"freeze_signal_{k}": v for k, v in self.freeze_signals.items()}
        return extra

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        super()._load_extra_state(extra)
        self.global_step = extra["global_step"]
        self.bounded_steps = int(extra.get("bounded_steps", 0))
        self._lift_variance = bool(extra.get("lift_variance", 0))
        stale = {k[len("stale_") :]: v for k, v in extra.items() if k.startswith("stale_")}
        gauge = {k[len("gauge_") :]: v for k, v in extra.items() if k.startswith("gauge_")}
        self.gauge = GradientGauge()
        if gauge:  # states saved before the gauge existed start it unarmed
            self.gauge.load_state_dict(gauge)
        self.stale = StaleGuard()
        if stale:  # states saved before the guard existed start it unarmed
            self.stale.load_state_dict(stale)
        if "freeze_step" not in extra and self.auto_freeze is not None and self.global_step:
            raise ValueError(
                f"{type(self).__name__} state was saved before the automatic freeze existed "
                "and does not say where its warmup ended: pass that step as freeze_step"
            )
        if "freeze_step" not in extra:  # older state: the configured step is all we know
            self._saved_in_warmup = False
            return
        saved = int(extra["freeze_step"])
        if self.auto_freeze is not None:
            prefix = "auto_freeze_"
            rule = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}
            fresh = dataclasses.replace(self.auto_freeze)  # same settings, nothing decided
            if rule:
                fresh.load_state_dict(rule)
            self.auto_freeze = fresh
            signal = "freeze_signal_"
            self.freeze_signals = {
                k[len(signal) :]: float(v) for k, v in extra.items() if k.startswith(signal)
            }
        self._saved_in_warmup = not 0 <= saved <= self.global_step
        self._refreeze = bool(extra.get("refreeze", 0)) and self.auto_freeze is None
        params = self._params()
        # Saved as float64 (see _as_tensor): positions come back as floats.
        idle = [params[int(i)] for i in extra.get("idle", []) if 0 <= int(i) < len(params)]
        self._idle = set(idle) if "idle" in extra else None
        if self._refreeze and saved > self.global_step:
            # Back in the warmup after a layer joined: it ends where that return said.
            self.freeze_step, self._saved_in_warmup = saved, False
        elif not self._saved_in_warmup:
            # Compression had started: its error buffers and frozen variance belong to
            # that switch point, whatever this optimizer was configured with.
            self.freeze_step = saved
        elif self.auto_freeze is not None:
            self.freeze_step = None
