"""What a Local-SGD worker's inner optimizer carries from one round into the next.

One rule, set once per run and applied to every method of a comparison (synchronous
DiLoCo, every asynchronous variant), since the rule alone moves the final loss by more
than the methods differ (docs/results/localsgd.md). The four rules:

* ``keep``: the optimizer's state persists across rounds (DiLoCo's rule; the default
  from a trained model). A round of
  ``H_w`` steps then starts with momentum built from gradients taken at global
  parameters that outer updates have since moved past; that is harmless when rounds are
  long against AdamW's first-moment memory (``1 / (1 - beta1)`` = 10 steps) and harmful
  when they are not, as DyLU's short rounds are.
* ``round``: the first moment (``exp_avg``, SGD's ``momentum_buffer``) is zeroed before
  every round; the second moment and the step count are kept. Keeping the step count
  keeps the bias correction off, so the k-th step of a round moves only ``1 - beta1^k``
  as far as a steady step: 10% for the first, 41% on average over a 10-step round.
* ``restart`` (the default from scratch): the first moment is zeroed *and bias-corrected on the
  round's own clock*: the k-th step's lr is multiplied by
  ``(1 - beta1^t) / (1 - beta1^k)`` (``t`` the optimizer's step count, which Adam
  already divides by), so a round's first step is a full normalised-gradient step
  ``g / sqrt(v)``. The second moment, a slow scale estimate, is kept. Decoupled weight
  decay is divided by the same factor, so it stays what the schedule says.
* ``fresh``: a new optimizer every round (the paper's notebook): moments and step count
  restart, so a round's first AdamW step is about ``lr * sign(g)``, a full step in every
  coordinate however small its gradient. Rounds of 1-3 steps (DyLU at a small H) then
  become sign-noise; pair it with a DyLU floor (``min_local_steps`` of 5, the notebook's).

Measured for sync DiLoCo and DN+DyLU (docs/results/localsgd.md, "Inner-state ablation");
:data:`DEFAULT_INNER_STATE` and :data:`TRAINED_INNER_STATE` say what was found and why the
defaults are what they are.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.errors import ConfigError

__all__ = [
    "DEFAULT_INNER_STATE",
    "INNER_MOMENTUM",
    "TRAINED_INNER_STATE",
    "InnerStateRule",
    "check_inner_momentum",
    "resolve_inner_momentum",
    "restart_first_moment_",
]

INNER_MOMENTUM = ("keep", "round", "restart", "fresh")
"""The inner-state rules (see the module docstring)."""

DEFAULT_INNER_STATE = "restart"
"""The rule a run from scratch uses unless told otherwise. Chosen over ``keep`` (which
stalled sync DiLoCo and DyLU's short rounds at the former outer lr 0.7 with momentum, and
kept a 300-step DiLoCo run on Shakespeare on its plateau) and ``round`` (which damps
every round's start). In the ablation at the tuned outer settings
(docs/results/localsgd.md, "Inner-state ablation": tiny GPT, H = 10, one or two seeds)
``fresh`` was 1.3-1.8% better than ``restart`` for both sync DiLoCo and DN+DyLU,
``keep`` level or better, and ``round`` 5.5% worse for DN+DyLU. Try ``fresh``."""

TRAINED_INNER_STATE = "keep"
"""The rule a run that starts from a trained model (``init_from``, ``pretrain_steps``)
uses unless told otherwise. There a round's first steps must not be large: ``restart``
makes each one a full bias-corrected AdamW step and cost DiLoCo 7.9-10.0% of its final
loss against ``keep`` (500 trained steps, H = 10, both bundled corpora, 3 seeds each;
docs/results/localsgd.md, "The inner-state rule from a trained model"), and ``keep`` was
0.4-0.5% ahead at H = 50 in the long tier, for sync DiLoCo and DN + DyLU alike."""


def check_inner_momentum(mode: str) -> None:
    """Raise :class:`ConfigError` (one line) for an unknown inner-state rule."""
    if mode not in INNER_MOMENTUM:
        raise ConfigError(
            f"unknown inner-state rule {mode!r}; choose one of {', '.join(INNER_MOMENTUM)}"
        )


def resolve_inner_momentum(mode: str | None, *, trained: bool = False) -> str:
    """The rule a run uses: ``mode`` when given, else :data:`TRAINED_INNER_STATE` for a
    run that starts from a trained model (``trained``) and :data:`DEFAULT_INNER_STATE`
    for one from scratch.

    The default is the same for every method, so a comparison is like-for-like unless a
    rule is set on purpose. Raises :class:`ConfigError` for an unknown ``mode``.
    """
    if mode is None:
        return TRAINED_INNER_STATE if trained else DEFAULT_INNER_STATE
    check_inner_momentum(mode)
    return mode


@torch.no_grad()
def restart_first_moment_(opt: torch.optim.Optimizer) -> int:
    """Zero the first moment (``exp_avg``, or SGD's ``momentum_buffer``) of every parameter.

    The second moment and the step count are left alone. Parameters without state yet
    are skipped. Returns how many moment tensors were zeroed.
    """
    zeroed = 0
    for state in opt.state.values():
        for key in ("exp_avg", "momentum_buffer"):
            buf = state.get(key)
            if isinstance(buf, torch.Tensor):
                buf.zero_()
                zeroed += 1
    return zeroed


def _step_count(opt: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """Adam's step count for ``group`` before its next step (0 without state yet)."""
    for p in group["params"]:
        step = opt.state.get(p, {}).get("step")
        if step is not None:
            return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


class InnerStateRule:
    """Applies one inner-state rule to one inner optimizer, round after round.

    Call :meth:`begin_round` before a round's first step, and wrap every inner step in
    :meth:`before_step` / :meth:`after_step` (only ``restart`` does anything there: it
    scales that step's lr and weight decay, and puts them back afterwards).

    Args:
        mode: one of :data:`INNER_MOMENTUM`.
    """

    def __init__(self, mode: str) -> None:
        check_inner_momentum(mode)
        self.mode = mode
        self.round_step = 0
        self._saved: list[tuple[float, float | None]] | None = None

    def begin_round(self, opt: torch.optim.Optimizer) -> None:
        """The next step is a round's first: apply the rule to ``opt``'s state."""
        self.round_step = 0
        if self.mode in ("round", "restart"):
            restart_first_moment_(opt)
        elif self.mode == "fresh":
            opt.state.clear()  # every torch optimizer rebuilds empty state lazily

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """Count the step; under ``restart``, bias-correct the restarted first moment."""
        self.round_step += 1
        if self.mode != "restart":
            return
        self._saved = []
        for group in opt.param_groups:
            lr, wd = float(group["lr"]), group.get("weight_decay")
            self._saved.append((lr, wd))
            betas = group.get("betas")
            if betas is None:
                continue  # SGD's momentum buffer has no bias to correct
            beta1, t = float(betas[0]), _step_count(opt, group) + 1
            if beta1 <= 0.0 or self.round_step >= t:
                continue  # the optimizer's own count is the round's: Adam corrects it
            factor = (1.0 - beta1**t) / (1.0 - beta1**self.round_step)
            group["lr"] = lr * factor
            if wd:
                group["weight_decay"] = wd / factor  # decoupled decay: lr * wd unchanged

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """Put back what :meth:`before_step` changed."""
        if self._saved is None:
            return
        for group, (lr, wd) in zip(opt.param_groups, self._saved, strict=True):
            group["lr"] = lr
            if wd is not None:
                group["weight_decay"] = wd
        self._saved = None
