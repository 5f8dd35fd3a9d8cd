"""Streaming DiLoCo's fragments: how the model is cut, when each part syncs, and what
the inner optimizer keeps of a fragment after its sync.

Kept apart from :mod:`thinwire.localsgd.algorithm.streaming` (the exchange and the outer
step) because the analyzer and the simulator need the same schedule without any of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from thinwire.errors import ConfigError

__all__ = ["FRAGMENT_RULES", "apply_fragment_rule", "split_fragments", "sync_offsets"]

FRAGMENT_RULES = ("keep", "round", "fresh")
"""The inner-state rules that have a per-fragment form (see
:mod:`thinwire.localsgd.algorithm.inner_state` for what each means for a whole model)."""


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """The step of the round (``t mod H``) at which each fragment sends: spread evenly,
    the last fragment at ``0``, so one fragment syncs exactly like DiLoCo (every H-th
    step). Raises :class:`ConfigError` when there are more fragments than steps."""
    if fragments > sync_every:
        raise ConfigError(
            f"Streaming DiLoCo needs a step per fragment: {fragments} fragments do not fit "
            f"a round of sync_every = {sync_every} steps"
        )
    return [((f + 1) * sync_every // fragments) % sync_every for f in range(fragments)]


def split_fragments(
    model: nn.Module, params: list[torch.Tensor], fragments: int | Sequence[nn.Module]
) -> list[list[int]]:
    """Indices into ``params`` of each fragment.

    An integer cuts ``params`` (in the model's order) into that many runs of consecutive
    parameters of about equal size: each parameter goes to the fragment in which its
    middle element falls, the ``k``-th cut lying at ``k / P`` of the elements. Modules are taken as given and must cover every
    one of ``params`` exactly once; either way an empty fragment is an error.
    """
    if isinstance(fragments, int):
        return _equal_runs(params, fragments)
    index = {id(p): i for i, p in enumerate(params)}
    out: list[list[int]] = []
    seen: set[int] = set()
    for k, module in enumerate(fragments):
        mine = [index[id(p)] for p in module.parameters() if id(p) in index]
        if not mine:
            raise ConfigError(f"Streaming DiLoCo fragment {k} holds no trainable parameter")
        if seen.intersection(mine):
            raise ConfigError(
                f"Streaming DiLoCo fragment {k} shares parameters with an earlier one"
            )
        seen.update(mine)
        out.append(mine)
    if len(seen) != len(params):
        missing = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and index.get(id(p)) not in seen
        ]
        raise ConfigError(
            f"Streaming DiLoCo fragments leave {len(params) - len(seen)} trainable "
            f"parameter(s) out, first {missing[0]!r}: every parameter must be in one fragment"
        )
    return out


def _equal_runs(params: list[torch.Tensor], fragments: int) -> list[list[int]]:
    if int(fragments) != fragments or fragments < 1:
        raise ConfigError(f"Streaming DiLoCo fragments must be an integer >= 1, got {fragments}")
    if fragments > len(params):
        raise ConfigError(
            f"Streaming DiLoCo cannot cut {len(params)} trainable parameter(s) into {fragments} fragments"
        )
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[] for _ in range(fragments)]
    running, k = 0, 0
    for i, p in enumerate(params):
        # A parameter goes where its middle falls (the k-th cut at k/P of the elements),
        # leaving at least one parameter for each fragment still to fill.
        past_cut = running + p.numel() / 2 > (k + 1) * total / fragments
        must_move = len(params) - i == fragments - 1 - k
        if out[k] and k < fragments - 1 and (past_cut or must_move):
            k += 1
        out[k].append(i)
        running += p.numel()
    return out


@torch.no_grad()
def apply_fragment_rule(opt: torch.optim.Optimizer, params: list[torch.Tensor], rule: str) -> None:
    """After a fragment's sync: ``keep`` leaves the inner state alone, ``round`` zeroes
    the fragment's first moment (``exp_avg``, SGD's ``momentum_buffer``), ``fresh``
    forgets the fragment's state (torch's optimizers rebuild it lazily, step count
    included)."""
    if rule == "keep":
        return
    for p in params:
        state = opt.state.get(p)
        if not state:
            continue
        if rule == "fresh":
            del opt.state[p]
            continue
        for key in ("exp_avg", "momentum_buffer"):
            buf = state.get(key)
            if isinstance(buf, torch.Tensor):
                buf.zero_()
