"""What a Local-SGD worker's inner optimizer carries from one round into the next.

DiLoCo keeps each worker's AdamW state local and persistent across rounds. That is
harmless when a round is long compared with AdamW's first-moment memory
(``1 / (1 - beta1)`` = 10 steps at ``beta1 = 0.9``), and harmful when it is not: a round
of ``H_w`` steps then moves the replica mostly along the momentum built up in earlier
rounds, i.e. along gradients taken at global parameters that many outer updates have
since moved past. DyLU gives slow workers exactly such rounds (``H_w`` of 1-3 steps when
H is small), and with DyLU those workers also arrive the most often.

Measured in the virtual-clock simulator (tiny GPT, 4 workers at the paper's toy speeds,
H = 10, 200 inner steps per worker, no grace period), DN+DyLU ends at val loss
4.64 / 3.93 / 4.66 (seeds 0 / 1 / 2) with the persistent first moment and at
2.66 / 2.61 / 2.67 with :func:`restart_first_moment_` before every round. On arrival,
the slowest worker's 1-step pseudo-gradients have a cosine of 0.04-0.10 with the
gradient of the validation loss at the server's parameters with the carried moment, and
0.20-0.26 with a restarted one (after the first 40 simulated seconds).

Tuning: keep the moment (``"keep"``, DiLoCo's rule) when every worker's round is well
above 10 inner steps; restart it (``"round"``) when rounds are short, which is what DyLU
with a small H produces. Unset, :func:`resolve_inner_momentum` picks ``"round"`` with
DyLU and ``"keep"`` without. With the restart DN+DyLU needs no grace period; a grace
period instead, with the moment kept, gave 2.54 / 3.02 / 3.11 on the same three seeds,
as good as the restart on seed 0 only. The second moment and the step count are kept
either way: the second moment is a slow (``beta2 = 0.999``) scale estimate that stays
valid across rounds, and keeping the step count keeps the bias correction off, so a
restarted moment makes a round start with small steps instead of a full sign-like step.
"""

from __future__ import annotations

import torch

from thinwire.errors import ConfigError

__all__ = [
    "INNER_MOMENTUM",
    "check_inner_momentum",
    "resolve_inner_momentum",
    "restart_first_moment_",
]

INNER_MOMENTUM = ("keep", "round")
"""``keep``: the inner first moment persists across rounds (DiLoCo). ``round``: it
restarts from zero at the start of every round."""


def check_inner_momentum(mode: str) -> None:
    """Raise :class:`ConfigError` (one line) for an unknown inner-momentum mode."""
    if mode not in INNER_MOMENTUM:
        raise ConfigError(
            f"unknown inner momentum {mode!r}; choose one of {', '.join(INNER_MOMENTUM)}"
        )


def resolve_inner_momentum(mode: str | None, dylu: bool) -> str:
    """The inner-momentum mode a run uses: ``mode`` when given, else the default.

    The default is ``"round"`` with DyLU (its slow workers get rounds of a few steps, in
    which a carried first moment is mostly stale) and ``"keep"`` without it (every round
    is H steps, DiLoCo's setting). An explicit ``mode`` always wins, so ``"keep"`` stays
    reachable with DyLU. Raises :class:`ConfigError` for an unknown ``mode``.
    """
    if mode is None:
        return "round" if dylu else "keep"
    check_inner_momentum(mode)
    return mode


@torch.no_grad()
def restart_first_moment_(opt: torch.optim.Optimizer) -> int:
    """Zero the first moment (``exp_avg``, or SGD's ``momentum_buffer``) of every parameter.

    Call it right before a round's first inner step. The second moment and the step
    count are left alone (see the module docstring for why). Parameters without state
    yet are skipped. Returns how many moment tensors were zeroed.
    """
    zeroed = 0
    for state in opt.state.values():
        for key in ("exp_avg", "momentum_buffer"):
            buf = state.get(key)
            if isinstance(buf, torch.Tensor):
                buf.zero_()
                zeroed += 1
    return zeroed
