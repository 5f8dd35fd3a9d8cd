"""The global parameters of asynchronous Local-SGD, and how a pseudo-gradient lands on them.

:class:`GlobalModel` holds theta (one flat fp32 vector) and the outer optimizer that
moves it, and applies pseudo-gradients one at a time:

* discounted by their staleness ``tau`` (the updates applied between the version a
  worker pulled and its arrival): ``staleness="poly"`` scales by ``(1 + tau)^-1/2``,
  the paper's "Poly" baseline (Liu et al., 2024, https://arxiv.org/abs/2401.09135);
* dropped when staler than ``max_staleness`` ("PolyThres"; their steps count as spent);
* in sync mode, held until the round is complete and then applied in worker order, so
  the result does not depend on which worker arrived first.

It knows nothing of workers, rounds, shards or speeds:
:class:`~thinwire.localsgd.algorithm.server_core.ServerCore` decides which pushes reach
it (the epoch check, the push guard) and when a sync round is complete.

Tuning: ``outer="dn"`` (Delayed Nesterov) is the paper's method and the default; its
buffer size ``N`` follows the live workers (:meth:`GlobalModel.resize`), so a dead
worker does not stall the buffer. ``staleness="poly"`` helps naive Nesterov with very
uneven workers; under DN it is rarely needed.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.outer import (
    AsyncBuffer,
    DelayedNesterov,
    Nesterov,
    check_outer_args,
)

__all__ = ["OUTER_CHOICES", "STALENESS_CHOICES", "GlobalModel"]

OUTER_CHOICES = ("dn", "nesterov", "buffer")
STALENESS_CHOICES = ("none", "poly")


class GlobalModel:
    """theta, its outer optimizer, and the staleness rules of one asynchronous run.

    Args:
        theta: initial global parameters, flattened (copied).
        buffer_size: DN's (and the asynchronous buffer's) N with every worker alive.
        outer: ``"dn"`` (Delayed Nesterov), ``"nesterov"`` (naive, per arrival) or
            ``"buffer"`` (the asynchronous buffer).
        outer_lr, outer_momentum: outer optimizer lr and beta.
        c: DN's c in ``[0, 1/N]``.
        staleness: ``"none"`` or ``"poly"`` (scale by ``(1 + tau)^-1/2``).
        max_staleness: drop pseudo-gradients staler than this (None: never).
    """

    def __init__(
        self,
        theta: torch.Tensor,
        *,
        buffer_size: int,
        outer: str = "dn",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        c: float = 0.0,
        staleness: str = "none",
        max_staleness: int | None = None,
    ) -> None:
        if outer not in OUTER_CHOICES:
            raise ConfigError(f"unknown outer optimizer {outer!r}; choose one of {OUTER_CHOICES}")
        if staleness not in STALENESS_CHOICES:
            raise ConfigError(
                f"unknown staleness rule {staleness!r}; choose one of {STALENESS_CHOICES}"
            )
        self.theta = torch.nn.Parameter(theta.detach().reshape(-1).float().clone())
        self.n_buffer = buffer_size
        self.opt: torch.optim.Optimizer
        if outer == "dn":
            self.opt = DelayedNesterov(
                [self.theta], lr=outer_lr, momentum=outer_momentum, buffer_size=buffer_size, c=c
            )
        elif outer == "buffer":
            self.opt = AsyncBuffer(
                [self.theta], lr=outer_lr, momentum=outer_momentum, buffer_size=buffer_size
            )
        else:
            self.opt = Nesterov([self.theta], lr=outer_lr, momentum=outer_momentum)
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.version = 0
        self.steps_applied = 0
        self.updates_applied = 0
        self.updates_dropped = 0
        self.staleness_seen: dict[int, int] = {}  # tau -> arrivals with it
        # sync mode: a round's arrivals by worker, applied in worker order once all are in
        self._held: dict[int, tuple[torch.Tensor, int, int]] = {}

    def ramp_momentum(self, arrivals: int) -> None:
        """Ramp the outer momentum up linearly from 0 over the first ``arrivals``
        arrivals (:func:`~thinwire.localsgd.algorithm.outer.ramped`; 0: none). It is a
        setting of the outer optimizer's group, saved with its state."""
        check_outer_args(1.0, 0.0, momentum_warmup=arrivals)
        for group in self.opt.param_groups:
            group["momentum_warmup"] = int(arrivals)

    def staleness_of(self, version: int | None) -> int:
        """``tau`` of a pseudo-gradient computed from theta ``version`` (None: taken as 0)."""
        return 0 if version is None else max(0, self.version - int(version))

    @torch.no_grad()
    def apply(self, grad: torch.Tensor, steps: int, tau: int) -> bool:
        """One outer step with ``grad`` (``steps`` inner steps, staleness ``tau``); False
        if it was dropped as too stale (its steps still count as applied)."""
        self.steps_applied += steps
        self.staleness_seen[tau] = self.staleness_seen.get(tau, 0) + 1
        if self.max_staleness is not None and tau > self.max_staleness:
            self.updates_dropped += 1
            return False
        if self.staleness == "poly" and tau > 0:
            grad = grad * (1.0 + tau) ** -0.5
        self.theta.grad = grad.reshape(-1).to(self.theta.dtype)
        self.opt.step()
        self.theta.grad = None
        self.version += 1
        self.updates_applied += 1
        return True

    def hold(self, worker: int, grad: torch.Tensor, steps: int, tau: int) -> None:
        """Sync mode: keep ``worker``'s arrival until :meth:`flush`."""
        self._held[worker] = (grad, steps, tau)

    @property
    def holding(self) -> bool:
        """Arrivals of an unfinished sync round are held."""
        return bool(self._held)

    def flush(self) -> None:
        """Sync mode: apply the held arrivals, in worker order."""
        held, self._held = self._held, {}
        for w in sorted(held):
            self.apply(*held[w])

    def resize(self, dead: int) -> None:
        """``dead`` workers are gone: DN's (or the buffer's) N shrinks by as many (>= 1)."""
        if isinstance(self.opt, (DelayedNesterov, AsyncBuffer)):
            self.opt.set_buffer_size(max(1, self.n_buffer - dead))

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """theta, the outer state (m, Delta, t), the version and the counters."""
        return {
            "theta": self.theta.detach().clone(),
            "outer": self.opt.state_dict(),
            "outer_kind": type(self.opt).__name__,
            "version": self.version,
            "steps_applied": self.steps_applied,
            "updates_applied": self.updates_applied,
            "updates_dropped": self.updates_dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or a server's, which holds the same keys)."""
        theta = state["theta"]
        if theta.numel() != self.theta.numel():
            raise ConfigError(
                f"checkpoint holds {theta.numel()} parameters, the model has {self.theta.numel()}"
            )
        if state["outer_kind"] != type(self.opt).__name__:
            raise ConfigError(
                f"checkpoint was written with outer optimizer {state['outer_kind']}, "
                f"this run uses {type(self.opt).__name__}"
            )
        with torch.no_grad():
            self.theta.copy_(theta)
        self.opt.load_state_dict(state["outer"])
        self.version = int(state["version"])
        self.steps_applied = int(state["steps_applied"])
        self.updates_applied = int(state["updates_applied"])
        self.updates_dropped = int(state.get("updates_dropped", 0))

    def snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict` plus what only the same run goes on with: the staleness
        histogram and a sync round's arrivals held so far (:meth:`restore`)."""
        return self.state_dict() | {
            "staleness_seen": dict(self.staleness_seen),
            "held": [(w, g.clone(), steps, tau) for w, (g, steps, tau) in self._held.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`snapshot`."""
        self.load_state_dict(state)
        self.staleness_seen = {int(t): int(n) for t, n in state["staleness_seen"].items()}
        self._held = {int(w): (g.clone(), int(n), int(t)) for w, g, n, t in state["held"]}
