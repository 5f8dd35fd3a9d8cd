"""Outer optimizers of asynchronous Local-SGD: Delayed Nesterov, naive per-arrival Nesterov,
and the asynchronous buffer baseline.

Both are ordinary :class:`torch.optim.Optimizer` subclasses. The "gradient" they read from
``p.grad`` is a *pseudo-gradient*: ``theta_pulled - theta_after_H_inner_steps`` from one
worker. The server sets ``p.grad`` and calls ``step()`` once per arrival.

Why a delayed momentum: applying Nesterov on every arrival (naive async) advances the
momentum once per worker update instead of once per "round", so with ``N`` workers the
momentum decays ``N`` times too fast and the step is inflated by the extra momentum terms.
Delayed Nesterov (Liu et al., 2024, "Asynchronous Local-SGD Training for Language
Modeling", Algorithm 3, https://arxiv.org/abs/2401.09135) applies each arrival's
``g / N`` at once, buffers the arrivals, and updates the momentum only every ``N``
arrivals, so that (with ``c = 0``) ``N`` arrivals together equal one
``torch.optim.SGD(nesterov=True)`` step on their mean: exactly synchronous DiLoCo's step.

All state lives in ``self.state[p]`` (``momentum_buffer`` m, ``delta`` Delta, ``step`` t,
``pending`` arrivals in the buffer), so ``state_dict()`` / ``load_state_dict()`` resume
exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from thinwire.errors import ConfigError

__all__ = ["AsyncBuffer", "DelayedNesterov", "Nesterov", "check_outer_args", "ramped"]


def check_outer_args(
    lr: float, momentum: float, buffer_size: int = 1, c: float = 0.0, momentum_warmup: int = 0
) -> None:
    """Raise :class:`ConfigError` (one line) for an impossible outer-optimizer setting."""
    if int(momentum_warmup) != momentum_warmup or momentum_warmup < 0:
        raise ConfigError(
            f"outer momentum warmup must be an integer >= 0 (arrivals), got {momentum_warmup}"
        )
    if not lr > 0:
        raise ConfigError(f"outer lr must be > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"outer momentum must be in [0, 1), got {momentum}")
    if int(buffer_size) != buffer_size or buffer_size < 1:
        raise ConfigError(
            f"Delayed Nesterov buffer size N must be an integer >= 1, got {buffer_size}"
        )
    if not 0.0 <= c <= 1.0 / buffer_size:
        raise ConfigError(
            f"Delayed Nesterov c must be in [0, 1/N] = [0, {1.0 / buffer_size:.4g}], got {c}"
        )


def ramped(beta: float, warmup: int, arrivals: int) -> float:
    """The momentum at an arrival after ``arrivals`` earlier ones: ``beta`` ramped up
    linearly from 0 over the first ``warmup`` arrivals (``warmup`` 0: ``beta`` at once)."""
    return beta if arrivals >= warmup else beta * arrivals / warmup


def _buffered_state(state: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state of an outer optimizer that buffers arrivals: the momentum, the summed
    arrivals not yet applied (``delta``, ``pending`` of them) and the arrival count."""
    if not state:
        state["momentum_buffer"] = torch.zeros_like(p)
        state["delta"] = torch.zeros_like(p)
        state["step"] = 0
        state["pending"] = 0
    return state


class Nesterov(torch.optim.Optimizer):
    """Nesterov momentum applied to every pseudo-gradient as it arrives (naive async).

    ``m = beta * m + g;  theta -= lr * (g + beta * m)``: the update of
    ``torch.optim.SGD(momentum=beta, nesterov=True)`` without dampening or weight decay.
    In synchronous DiLoCo this is the outer optimizer (one step per round, on the mean
    pseudo-gradient). Used per arrival in asynchronous training it is the paper's
    "naive" baseline, which loses quality; prefer :class:`DelayedNesterov` there.

    Args:
        params: the global parameters theta.
        lr: outer learning rate (DiLoCo: 0.7). Lower it (e.g. 0.07-0.2) when updates
            arrive one worker at a time and momentum is not delayed.
        momentum: beta (DiLoCo: 0.9).
        momentum_warmup: arrivals over which beta ramps up linearly from 0 (default 0:
            from the first one).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.7,
        momentum: float = 0.9,
        momentum_warmup: int = 0,
    ) -> None:
        check_outer_args(lr, momentum, momentum_warmup=momentum_warmup)
        defaults = {"lr": lr, "momentum": momentum, "momentum_warmup": int(momentum_warmup)}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, warmup = group["lr"], group.get("momentum_warmup", 0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["step"] = 0
                beta = ramped(group["momentum"], warmup, state["step"])
                m = state["momentum_buffer"]
                m.mul_(beta).add_(p.grad)
                p.add_(p.grad + beta * m, alpha=-lr)
                state["step"] += 1
        return loss


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov (DN): Nesterov whose momentum moves once per ``N`` arrivals.

    On each arrival of a pseudo-gradient ``g`` (Algorithm 3 of the paper)::

        Delta += g
        if this is the N-th arrival since the last momentum update:
            m = beta * m + Delta / N
            theta -= lr * ((1 - c*N + c) * beta * m + g / N);  Delta = 0
        else:
            theta -= lr * (c * beta * m + g / N)

    With ``c = 0``, ``N`` arrivals equal one ``SGD(nesterov=True)`` step on their mean;
    with ``N = 1`` it is :class:`Nesterov`.

    Args:
        params: the global parameters theta.
        lr: outer learning rate. Because ``N`` arrivals make one Nesterov step on their
            mean, synchronous DiLoCo's lr (0.7) is the natural starting point.
        momentum: beta (0.9).
        buffer_size: N, arrivals per momentum update; set it to the number of workers.
            :meth:`set_buffer_size` changes it when workers die or join.
        c: share of the momentum applied on every arrival instead of at the N-th, in
            ``[0, 1/N]``. 0 (the paper's default) delays it fully; ``1/N`` spreads it
            evenly, which smooths the trajectory when workers arrive in bursts.
        momentum_warmup: arrivals over which beta ramps up linearly from 0 (default 0:
            from the first one). From a trained model, the first pushes can move it far
            while the momentum builds up; a ramp keeps those first steps plain.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.7,
        momentum: float = 0.9,
        buffer_size: int = 1,
        c: float = 0.0,
        momentum_warmup: int = 0,
    ) -> None:
        check_outer_args(lr, momentum, buffer_size, c, momentum_warmup)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "buffer_size": int(buffer_size),
            "c": c,
            "momentum_warmup": int(momentum_warmup),
        }
        super().__init__(params, defaults)

    def set_buffer_size(self, n: int) -> None:
        """Use ``n`` arrivals per momentum update from now on (e.g. after a worker died).

        A buffer that already holds ``>= n`` arrivals is flushed at the next arrival.
        """
        for group in self.param_groups:
            check_outer_args(group["lr"], group["momentum"], n, min(group["c"], 1.0 / max(n, 1)))
            group["buffer_size"] = int(n)
            group["c"] = min(group["c"], 1.0 / n)  # keep c inside [0, 1/N] as N shrinks

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, n, c = group["lr"], group["buffer_size"], group["c"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = _buffered_state(self.state[p], p)
                beta = ramped(group["momentum"], group.get("momentum_warmup", 0), state["step"])
                m, delta = state["momentum_buffer"], state["delta"]
                delta.add_(g)
                # Counting arrivals in the buffer (rather than testing (t+1) % N) keeps the
                # rule right when N changes mid-buffer because a worker died or joined.
                state["pending"] += 1
                if state["pending"] >= n:
                    m.mul_(beta).add_(delta, alpha=1.0 / state["pending"])
                    p.add_(m, alpha=-lr * (1.0 - c * n + c) * beta)
                    p.add_(g, alpha=-lr / n)
                    delta.zero_()
                    state["pending"] = 0
                else:
                    if c > 0:
                        p.add_(m, alpha=-lr * c * beta)
                    p.add_(g, alpha=-lr / n)
                state["step"] += 1
        return loss


class AsyncBuffer(torch.optim.Optimizer):
    """The paper's "Async Buffer" baseline (FedBuff-like): N arrivals, then one Nesterov step.

    Each arrival's pseudo-gradient is added to a buffer; at the N-th arrival one
    ``SGD(nesterov=True)`` step is taken on the buffer's mean and the buffer is emptied::

        Delta += g
        if this is the N-th arrival since the last step:
            m = beta * m + Delta / N;  theta -= lr * (Delta / N + beta * m);  Delta = 0

    Between steps theta does not move, so every worker that pulls meanwhile gets the
    same parameters. That is where it differs from :class:`DelayedNesterov` with
    ``c = 0``, which applies each arrival's ``g / N`` at once: both take the same total
    step over N arrivals, but DN's workers start from fresher parameters. The paper
    reports the buffer as the strongest of its baselines but unstable early on.

    Args:
        params: the global parameters theta.
        lr: outer learning rate; N arrivals make one Nesterov step on their mean, so the
            synchronous DiLoCo lr is the starting point.
        momentum: beta.
        buffer_size: N, arrivals per step (the number of workers);
            :meth:`set_buffer_size` changes it when workers die or join.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.3,
        momentum: float = 0.9,
        buffer_size: int = 1,
        momentum_warmup: int = 0,
    ) -> None:
        check_outer_args(lr, momentum, buffer_size, momentum_warmup=momentum_warmup)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "buffer_size": int(buffer_size),
            "momentum_warmup": int(momentum_warmup),
        }
        super().__init__(params, defaults)

    def set_buffer_size(self, n: int) -> None:
        """Step every ``n`` arrivals from now on; a fuller buffer steps at the next one."""
        for group in self.param_groups:
            check_outer_args(group["lr"], group["momentum"], n)
            group["buffer_size"] = int(n)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, n = group["lr"], group["buffer_size"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = _buffered_state(self.state[p], p)
                beta = ramped(group["momentum"], group.get("momentum_warmup", 0), state["step"])
                m, delta = state["momentum_buffer"], state["delta"]
                delta.add_(p.grad)
                state["pending"] += 1
                if state["pending"] >= n:
                    delta.div_(state["pending"])
                    m.mul_(beta).add_(delta)
                    p.add_(delta + beta * m, alpha=-lr)
                    delta.zero_()
                    state["pending"] = 0
                state["step"] += 1
        return loss
