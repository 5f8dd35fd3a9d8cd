"""1-bit Adam: Adam whose momentum travels at ~1 bit per element after a warmup.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", arXiv 2102.02888.

* **Warmup** (steps 1..``freeze_step``): Adam on gradients averaged with a full-precision
  allreduce (one fused buffer per step).
* **Freeze**: Adam's variance ``v`` stops changing; the preconditioner is now fixed, so
  the update is linear in the momentum and error feedback can compensate compression.
* **Compression stage**: gradients stay local. Each rank updates its momentum with its
  own gradient, ``m = b1*m + (1-b1)*g_local``, and the momenta of all layers are averaged
  in ONE error-compensated 1-bit allreduce per step; then ``p -= lr * (m/(sqrt(v)+eps)
  + weight_decay*p)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from thinwire.optim.distributed import TwoStageOptimizer, check_adam_hyperparameters

__all__ = ["OneBitAdam"]


class OneBitAdam(TwoStageOptimizer):
    """1-bit Adam, data-parallel, on any torch.distributed backend.

    Args:
        params: parameters or parameter groups. A group may carry ``exp_avg_mask``: a
            list with one tensor (or None) per parameter, multiplied into the momentum
            after each compressed exchange, to keep coordinates whose gradient is always
            zero (e.g. unused embedding rows) from accumulating compression error.
        lr: learning rate, as for Adam.
        freeze_step: steps of full-precision warmup (required). The variance must have
            settled before it is frozen: pick 15-25% of the run, and at least a few
            hundred steps on real models. Too short shows as a loss jump right after the
            freeze; longer costs only bandwidth (warmup steps send 32x more).
        betas: moment decay rates, each in [0, 1).
        eps: added to ``sqrt(v)``.
        weight_decay: added to the update (``+ weight_decay * p``), as in the reference.
        bias_correction: divide ``m`` by ``1-b1^t`` and ``v`` by ``1-b2^t`` (``v``'s factor
            is frozen with ``v``). Off by default, like the reference; turn it on for
            short warmups (see :class:`~thinwire.optim.OneBitLamb`). ``thinwire train``
            turns it on.
        process_group: ranks to average over (default: the default group, if any).

    With one process (or no process group) it is plain Adam without bias correction
    (the "compression" of one rank is the identity).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100_000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction,
        )  # fmt: skip
        super().__init__(params, defaults, freeze_step, process_group)

    def _warmup_step(self) -> bool:
        items = self._grads()
        if not self._average_gradients([p for p, _ in items]):
            return False
        for p, group in items:
            self._update_moments(p, group)
        self._apply_updates()
        return True

    def _compression_step(self) -> bool:
        items = self._momentum_params()
        betas = {p: group["betas"][0] for p, group in items}

        def fill(p: torch.Tensor, view: torch.Tensor) -> None:
            b1 = betas[p]
            torch.mul(self.state[p]["exp_avg"], b1, out=view)
            if p.grad is not None:
                view.add_(p.grad.float(), alpha=1 - b1)

        params = [p for p, _ in items]
        views = self._compressed_average(params, fill)
        if views is None:
            return False
        masks = _masks(self.param_groups)
        for p, view in zip(params, views, strict=True):
            m = self.state[p]["exp_avg"]
            m.copy_(view)
            if masks.get(p) is not None:
                m.mul_(masks[p])
        self._apply_updates()
        return True

    def _apply_updates(self) -> None:
        self.global_step += 1
        t = self.global_step
        for p, group in self._momentum_params():
            b1, b2 = group["betas"]
            m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
            if group["bias_correction"]:
                t_v = min(t, self.freeze_step)
                denom = (v / (1 - b2**t_v)).sqrt_().add_(group["eps"])
                u = (m / (1 - b1**t)).div_(denom)
            else:
                u = m / v.sqrt().add_(group["eps"])
            master = self._master(p)
            if group["weight_decay"]:
                u.add_(master, alpha=group["weight_decay"])
            master.add_(u, alpha=-group["lr"])
            self._write_back(p, master)


def _masks(groups: list[dict[str, Any]]) -> dict[torch.Tensor, torch.Tensor | None]:
    """Parameter -> its ``exp_avg_mask`` entry, for groups that carry one."""
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
