"""LAMB: Adam with a per-layer trust ratio, for large batches (You et al., arXiv 1904.00962).

Per parameter tensor ("layer")::

    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2        (g averaged over the ranks)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p  (hats: bias-corrected, optional)
    r = clamp(||p|| / ||u||, min_coeff, max_coeff)      (1 when either norm is 0)
    p -= lr * r * u

The trust ratio ``r`` scales each layer's step to its weight norm, which is what lets
LAMB keep Adam's per-sample convergence at batch sizes where Adam diverges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from thinwire.optim.amp import note_scaler_verdict, unscale_for_scaler
from thinwire.optim.base import (
    CommOptimizer,
    adam_direction,
    adam_directions,
    check_adam_hyperparameters,
    check_range,
    layer_batches,
)
from thinwire.optim.sharded import full_norm, island_norms

__all__ = ["Lamb", "apply_lamb", "ratio_of_norms", "trust_ratio"]


def trust_ratio(
    p: torch.Tensor,
    u: torch.Tensor,
    min_coeff: float,
    max_coeff: float,
    island: dist.ProcessGroup | None = None,
) -> float:
    """``clamp(||p|| / ||u||, min_coeff, max_coeff)``, or 1 when either norm is 0. The
    norms are the whole layer's when ``p`` and ``u`` are FSDP2 shards (DTensors, or
    plain shards of a layer split over ``island``)."""
    return ratio_of_norms(full_norm(p, island), full_norm(u, island), min_coeff, max_coeff)


def ratio_of_norms(p_norm: float, u_norm: float, min_coeff: float, max_coeff: float) -> float:
    """:func:`trust_ratio` from the layer's two norms, already reduced."""
    if p_norm == 0.0 or u_norm == 0.0:
        return 1.0
    return min(max(p_norm / u_norm, min_coeff), max_coeff)


def _fused_lamb(
    opt: CommOptimizer, batch: list[tuple[torch.Tensor, dict[str, Any]]], t: int
) -> tuple[list[dict[str, Any]], list[float]]:
    """LAMB's step on a batch of whole layers of one group with torch's foreach kernels:
    a few kernel launches for the batch, and one host sync to read its norms."""
    group = batch[0][1]
    states = opt._update_moments_all(batch)
    masters = [opt._master(p) for p, _ in batch]
    u = adam_directions([s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], group, t)
    if group["weight_decay"]:
        torch._foreach_add_(u, masters, alpha=group["weight_decay"])
    norms = torch.stack(torch._foreach_norm(masters) + torch._foreach_norm(u)).tolist()
    n = len(batch)
    coeffs = [
        ratio_of_norms(norms[i], norms[n + i], group["min_coeff"], group["max_coeff"])
        for i in range(n)
    ]
    torch._foreach_mul_(u, [-group["lr"] * c for c in coeffs])
    torch._foreach_add_(masters, u)
    opt._write_back_all([p for p, _ in batch], masters)
    return states, coeffs


def apply_lamb(
    opt: CommOptimizer,
    items: list[tuple[torch.Tensor, dict[str, Any]]],
    t: int,
    after: Callable[[dict[str, Any], dict[str, Any], float], None],
) -> list[float]:
    """LAMB's step ``t`` on every ``(parameter, group)`` of ``items`` (their gradients
    averaged); ``after(group, state, ratio)`` sees each layer's trust ratio. Returns the ratios.

    Whole layers are stepped in batches with torch's foreach kernels: layer by layer, a
    GPU spends more time launching LAMB's small kernels and waiting for each layer's
    norms than computing (an 85M-parameter GPT on an H200: 43 ms a step, against 5 ms
    for torch's AdamW). Under FSDP2 across islands every layer's update is made first (a
    shard's worth of memory) and all the layers' norms are reduced in one allreduce
    inside the island: one round trip per step, not two per layer. FSDP2's DTensors
    over every rank go a layer at a time (each norm the whole layer's)."""
    island = opt._island
    states: list[dict[str, Any]] = []
    coeffs: list[float] = []

    def update(p: torch.Tensor, group: dict[str, Any]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        state = opt._update_moments(p, group)
        master = opt._master(p)
        u = adam_direction(state["exp_avg"], state["exp_avg_sq"], group, t)
        if group["weight_decay"]:
            u.add_(master, alpha=group["weight_decay"])
        return state, master, u

    if island is None and not any(isinstance(p, DTensor) for p, _ in items):
        for batch in layer_batches(items):
            batch_states, batch_coeffs = _fused_lamb(opt, batch, t)
            states += batch_states
            coeffs += batch_coeffs
    elif island is None:  # DTensors over every rank: a layer at a time, no update held
        for p, group in items:
            state, master, u = update(p, group)
            c = trust_ratio(master, u, group["min_coeff"], group["max_coeff"])
            master.add_(u, alpha=-group["lr"] * c)
            opt._write_back(p, master)
            states.append(state)
            coeffs.append(c)
    else:
        made = [update(p, group) for p, group in items]
        norms = island_norms([x for _, w, u in made for x in (w, u)], island) if made else []
        for i, ((p, group), (state, master, u)) in enumerate(zip(items, made, strict=True)):
            c = ratio_of_norms(
                norms[2 * i], norms[2 * i + 1], group["min_coeff"], group["max_coeff"]
            )
            master.add_(u, alpha=-group["lr"] * c)
            opt._write_back(p, master)
            states.append(state)
            coeffs.append(c)
    for (_, group), state, c in zip(items, states, coeffs, strict=True):
        after(group, state, c)
    return coeffs


class Lamb(CommOptimizer):
    """LAMB, data-parallel: gradients are averaged in one fused fp32 allreduce per step.

    It takes FSDP2-sharded parameters too (:mod:`thinwire.optim.sharded`): the trust
    ratio reads the whole layer's norms, reduced over the shards.

    Args:
        params: parameters or parameter groups.
        lr: learning rate. LAMB's trust ratio makes the step relative to each layer's
            weight norm, so good values are larger than Adam's: 1e-3 to 1e-2 for small
            transformers; scale roughly with sqrt(batch size).
        betas: moment decay rates (``b1``, ``b2``), each in [0, 1).
        eps: added to ``sqrt(v)``; 1e-6 is more forgiving in fp16 than 1e-8.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - b^t`` (standard LAMB: on).
        max_coeff, min_coeff: bounds of the trust ratio; the 1-bit LAMB reference uses
            10 and 0.01. Tight bounds make LAMB behave more like Adam.
        process_group: ranks to average over (default: the default group, if any).
            Under FSDP2 inside an island, the ranks holding the same shard in every
            island; unset when FSDP2's mesh covers every rank.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        check_range("min_coeff", min_coeff, 0.0, float("inf"), lo_open=True)
        check_range("max_coeff", max_coeff, min_coeff, float("inf"))
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults, process_group)
        self.last_coeffs: list[float] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        unscale_for_scaler(self)
        items = self._averaged_grads()
        note_scaler_verdict(self, items is not None)
        if items is None:
            self._skip()
            return loss
        self._took_step()
        self.global_step += 1
        t = self.global_step

        def count(_: dict[str, Any], state: dict[str, Any], __: float) -> None:
            state["step"] = float(t)  # per parameter too: see load_state_dict

        self.last_coeffs = apply_lamb(self, items, t, count)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, from :meth:`state_dict` or from
        ``torch.distributed.checkpoint.state_dict``'s optimizer state, which keeps only
        ``state`` and ``param_groups``: the step count (bias correction) then comes from
        each parameter's ``"step"``, as for torch's Adam."""
        super().load_state_dict(state_dict)
        if "thinwire" not in state_dict:
            steps = [s["step"] for s in self.state.values() if "step" in s]
            self.global_step = int(max(steps)) if steps else 0

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got in the last step (in parameter order)."""
        return list(self.last_coeffs)

    def _extra_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        self.global_step = extra["global_step"]
        self.last_coeffs = []
