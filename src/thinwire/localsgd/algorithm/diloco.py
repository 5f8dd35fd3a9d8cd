"""Synchronous DiLoCo: H local steps of the inner optimizer, then one averaged outer step.

DiLoCo (Douillard et al., 2023, https://arxiv.org/abs/2311.08105) runs on every worker
the user's own model and inner optimizer (AdamW) for ``H`` steps without any
communication, then averages the *pseudo-gradients* ``theta - theta_w`` with one
allreduce and lets an outer Nesterov optimizer move the global parameters theta. Every
worker then continues from the new theta; what its inner optimizer state carries into
the next round is the inner-state rule ``inner_momentum`` (default ``restart``: the
first moment restarts, bias-corrected; see :mod:`thinwire.localsgd.algorithm.inner_state`).
From a trained model pass ``inner_momentum="keep"``: ``restart`` cost 8-10% there
(the configs, ``thinwire train`` and the simulator pick ``keep`` by themselves when the
run starts from a trained model).
Communication drops by a factor H (the paper uses 500; 20-100 is typical for small
models), at the price of a round that waits for the slowest worker (see
:func:`thinwire.localsgd.run_async` for the asynchronous variant).

Usage, like torchft's DiLoCo (hooks on the inner optimizer, nothing else changes)::

    model = MyModel(); inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DiLoCo(model, inner, sync_every=50) as diloco:
        for x, y in batches:
            loss_fn(model(x), y).backward()
            inner.step()          # every 50th step also syncs
            inner.zero_grad()

The context manager registers a ``register_step_post_hook`` on the inner optimizer and
removes it on exit. Without ``with``, call :meth:`DiLoCo.after_inner_step` yourself.

Pseudo-gradient compression (``compress``): ``fp16``/``bf16`` halve the bytes (thinwire's
cast codec, :mod:`thinwire.compress.cast`; the average is computed in that dtype,
divided by W before the sum so it cannot overflow); ``onebit`` uses thinwire's
error-compensated 1-bit allreduce (28x fewer bytes, its error buffers are part of
:meth:`DiLoCo.state_dict`; ``error_feedback=False`` drops what the signs lost instead of
sending it with the next sync, to measure what the feedback buys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import record
from thinwire.comm.allreduce import all_reduce_mean_
from thinwire.compress.cast import CAST_DTYPES, cast_decode, cast_encode
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.inner_state import DEFAULT_INNER_STATE, InnerStateRule
from thinwire.localsgd.algorithm.methods import TUNED
from thinwire.localsgd.algorithm.outer import check_outer_args
from thinwire.optim.sharded import check_layout, is_sharded, local

__all__ = ["COMPRESS_CHOICES", "DEFAULT_OUTER_LR", "DiLoCo"]

COMPRESS_CHOICES = ("none", *CAST_DTYPES, "onebit")
"""``none`` (fp32), the 16-bit casts (:mod:`thinwire.compress.cast`) and ``onebit``."""
DEFAULT_OUTER_LR = TUNED["sync"].outer_lr
"""Outer lr of synchronous DiLoCo unless told otherwise: sync's tuned value, the best of
the sweep on the tiny GPT at H = 10 (docs/results/localsgd.md, "Tuning the outer lr per method"), the same that
``thinwire train --algo diloco`` and the simulator's ``sync`` use. DiLoCo's 0.7 (tuned on
150M-1B models at H = 500) stalled sync DiLoCo at the byte-frequency loss at H = 10."""


class DiLoCo:
    """Synchronous DiLoCo around a model and its inner optimizer.

    Args:
        model: the worker's model (its parameters are the local replica theta_w).
        inner_optimizer: the optimizer the user steps every iteration (AdamW).
        sync_every: H, inner steps per outer step. Larger H communicates less but lets
            replicas drift further; with lr-warmup, start around 20-50.
        outer_lr: outer Nesterov lr. The default, :data:`DEFAULT_OUTER_LR`, is the best
            of a sweep on thinwire's small models (docs/results/localsgd.md); DiLoCo's 0.7 stalled
            there at H = 10 with the first moment kept.
        outer_momentum: outer Nesterov momentum (0.9). 0 is plain SGD on the averaged
            pseudo-gradient; with ``outer_lr=1`` that is plain parameter averaging.
        outer_optimizer: factory ``params -> Optimizer`` replacing the default
            ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)``.
        compress: ``none``, ``fp16``, ``bf16`` or ``onebit`` (see the module docstring).
        error_feedback: with ``onebit``, carry what the signs lost into the next sync
            (default True; leave it on: without it 1-bit DiLoCo ended 0.9% and 1.9%
            higher on 2 of 3 short runs and level on the third, docs/results/localsgd.md).
            The other codecs here have no rounding to carry, so False is refused with
            them.
        process_group: the workers' group (default: the default group, if initialised).
        sync_initial: broadcast rank 0's parameters at construction so all replicas start
            equal (skip it when the caller already did).
        inner_momentum: the inner-state rule applied after every outer step: ``keep``
            (DiLoCo's; take it from a trained model), ``round``, ``restart`` (the
            default) or ``fresh``; see
            :mod:`thinwire.localsgd.algorithm.inner_state`. ``restart`` scales each inner step's lr
            by a bias correction, through step hooks on ``inner_optimizer`` registered
            here (so it works with or without ``with``), applied after any lr the
            caller set.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        outer_lr: float | None = None,
        outer_momentum: float = 0.9,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        compress: str = "none",
        process_group: dist.ProcessGroup | None = None,
        sync_initial: bool = True,
        inner_momentum: str = DEFAULT_INNER_STATE,
        error_feedback: bool = True,
    ) -> None:
        self.rule = InnerStateRule(inner_momentum)
        outer_lr = DEFAULT_OUTER_LR if outer_lr is None else outer_lr
        check_outer_args(outer_lr, outer_momentum)
        if int(sync_every) != sync_every or sync_every < 1:
            raise ConfigError(f"DiLoCo sync_every (H) must be an integer >= 1, got {sync_every}")
        if compress not in COMPRESS_CHOICES:
            raise ConfigError(f"unknown compression {compress!r}; choose one of {COMPRESS_CHOICES}")
        if not error_feedback and compress != "onebit":
            raise ConfigError(
                f"error feedback is onebit's here: {compress!r} keeps no rounding to carry "
                "(set compress='onebit', or leave error_feedback on)"
            )
        self.model = model
        self.inner = inner_optimizer
        self.sync_every = int(sync_every)
        self.compress = compress
        self.inner_momentum = inner_momentum
        self.group = process_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(is_sharded(p) for p in self.params):
            # FSDP2 inside an island, DiLoCo across islands: each rank's outer step works
            # on its own shards, and its pseudo-gradients travel over the replicas only.
            check_layout(self.params, process_group, "DiLoCo", island_only=True)
        # This rank's shard of each parameter (the whole parameter without FSDP2): the
        # outer step is elementwise, so it needs nothing of the other shards.
        self._shards = [local(p) for p in self.params]
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        if sync_initial and self.world > 1:
            broadcast_replicas(self._shards, process_group, "diloco.broadcast")
        self.global_params = [p.detach().clone() for p in self._shards]
        if outer_optimizer is None:
            # Momentum 0 is plain averaging: SGD on the averaged pseudo-gradient (torch
            # refuses Nesterov without momentum, and with none there is nothing to look
            # ahead with).
            self.outer = torch.optim.SGD(
                self.global_params,
                lr=outer_lr,
                momentum=outer_momentum,
                nesterov=outer_momentum > 0,
            )
        else:
            self.outer = outer_optimizer(self.global_params)
        self.local_step = 0
        self.outer_steps = 0
        self._onebit: Any = None
        if compress == "onebit":
            from thinwire.comm.onebit_allreduce import OneBitAllreduce

            self._onebit = OneBitAllreduce(process_group, error_feedback=error_feedback)
        self._handle: Any = None
        # The first round needs no rule: the optimizer starts it fresh (or resumed, in
        # which case load_state_dict puts the rule's round clock back).
        self._rule_hooks: list[Any] = []
        if self.rule.mode == "restart":
            self._rule_hooks = [
                inner_optimizer.register_step_pre_hook(
                    lambda opt, args, kwargs: self.rule.before_step(opt)
                ),
                inner_optimizer.register_step_post_hook(
                    lambda opt, args, kwargs: self.rule.after_step(opt)
                ),
            ]

    # --- hooking into the inner optimizer ----------------------------------------------
    def __enter__(self) -> DiLoCo:
        self._handle = self.inner.register_step_post_hook(
            lambda opt, args, kwargs: self.after_inner_step()
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def after_inner_step(self, step: int | None = None) -> bool:
        """Count one inner step (or set the count to ``step``); sync every H. True if synced."""
        self.local_step = self.local_step + 1 if step is None else step
        if self.local_step % self.sync_every == 0:
            self.sync()
            return True
        return False

    # --- the outer step ----------------------------------------------------------------
    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return flat
        if self._onebit is not None:
            return self._onebit(flat)
        if self.compress in CAST_DTYPES:
            wire = cast_encode(flat, CAST_DTYPES[self.compress])
            all_reduce_mean_(wire, self.group, op_name=f"diloco.allreduce.{self.compress}")
            return cast_decode(wire, flat.dtype)
        return all_reduce_mean_(flat, self.group, op_name="diloco.allreduce")

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients ``theta - theta_w``, step the outer optimizer, load
        the new theta into the model and apply the inner-state rule: the next round
        starts here."""
        pseudo = torch.cat(
            [
                (g - p.detach()).reshape(-1).float()
                for g, p in zip(self.global_params, self._shards, strict=True)
            ]
        )
        avg = self._average(pseudo)
        offset = 0
        for g in self.global_params:
            n = g.numel()
            g.grad = avg[offset : offset + n].view_as(g).to(g.dtype)
            offset += n
        self.outer.step()
        for g, p in zip(self.global_params, self._shards, strict=True):
            g.grad = None
            p.copy_(g)
        self.rule.begin_round(self.inner)
        self.outer_steps += 1

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global params, outer state, step counts, this rank's local params, 1-bit errors."""
        state = {
            "global": [g.detach().clone() for g in self.global_params],
            "local": [p.detach().clone() for p in self._shards],
            "outer": self.outer.state_dict(),
            "local_step": self.local_step,
            "outer_steps": self.outer_steps,
        }
        if self._onebit is not None:
            state["onebit"] = self._onebit.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_replicas(state, self.global_params, self._shards, "DiLoCo")
        self.outer.load_state_dict(state["outer"])
        self.local_step = int(state["local_step"])
        self.outer_steps = int(state["outer_steps"])
        self.rule.round_step = self.local_step % self.sync_every
        if self._onebit is not None and "onebit" in state:
            self._onebit.load_state_dict(state["onebit"])


def broadcast_replicas(
    shards: list[torch.Tensor], group: dist.ProcessGroup | None, op_name: str
) -> None:
    """Give every replica the group's first rank's ``shards`` (so all start equal),
    counting the bytes under ``op_name``."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in shards:
        dist.broadcast(p.data, src=src, group=group)
        nbytes = p.numel() * p.element_size()
        record(op_name, nbytes, nbytes)


@torch.no_grad()
def load_replicas(
    state: dict[str, Any], global_params: list[torch.Tensor], shards: list[torch.Tensor], who: str
) -> None:
    """Put a saved ``state``'s global parameters and this rank's local replica back
    (checked against the model's count in one line). The local replica mid-round
    differs per rank, so it is restored too (a trainer's model checkpoint is rank 0's)."""
    if len(state["global"]) != len(global_params):
        raise ConfigError(
            f"{who} state holds {len(state['global'])} tensors, the model has {len(global_params)}"
        )
    for g, saved in zip(global_params, state["global"], strict=True):
        g.copy_(saved)
    for p, saved in zip(shards, state["local"], strict=True):
        p.copy_(saved)
