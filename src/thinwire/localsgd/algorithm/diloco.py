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

DiLoCo counts the inner steps through a ``register_step_post_hook`` on the inner
optimizer, registered at construction, so it syncs with or without ``with``; leaving the
``with`` block (or :meth:`DiLoCo.close`) removes the hook. A loop that counts its own
steps calls :meth:`DiLoCo.after_inner_step` after each ``inner.step()`` instead: its first
call takes the count over from the hook (as thinwire's trainer does). Use one DiLoCo per
inner optimizer.

What a sync carries: the parameters that trained in the round (as a torch optimizer
steps only those that require a gradient): one unfrozen later is synced from the round
it thaws in (its copy of the round's start is taken before its first inner step), one
frozen mid-round ends that round in the replicas' plain average and then stays where it
is, its outer momentum kept for when it thaws; one frozen at construction costs no
copy. Then the model's buffers (BatchNorm's running
statistics), averaged uncompressed in one small allreduce
(:mod:`thinwire.localsgd.algorithm.buffers`), so after every sync all replicas hold one
model, and rank 0's checkpoint is it.

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
from thinwire.localsgd.algorithm.buffers import (
    average_buffers_,
    broadcast_buffers_,
    flat_buffers,
    load_buffers_,
    synced_buffers,
)
from thinwire.localsgd.algorithm.inner_state import DEFAULT_INNER_STATE, InnerStateRule
from thinwire.localsgd.algorithm.methods import TUNED
from thinwire.localsgd.algorithm.outer import check_outer_args
from thinwire.optim.sharded import check_layout, is_sharded, local

__all__ = ["COMPRESS_CHOICES", "DEFAULT_OUTER_LR", "DiLoCo", "InnerStepHook"]

COMPRESS_CHOICES = ("none", *CAST_DTYPES, "onebit")
"""``none`` (fp32), the 16-bit casts (:mod:`thinwire.compress.cast`) and ``onebit``."""
DEFAULT_OUTER_LR = TUNED["sync"].outer_lr
"""Outer lr of synchronous DiLoCo unless told otherwise: sync's tuned value, the best of
the sweep on the tiny GPT at H = 10 (docs/results/localsgd.md, "Tuning the outer lr per method"), the same that
``thinwire train --algo diloco`` and the simulator's ``sync`` use. DiLoCo's 0.7 (tuned on
150M-1B models at H = 500) stalled sync DiLoCo at the byte-frequency loss at H = 10."""


class InnerStepHook:
    """Calls ``on_step()`` after every step of ``optimizer``, from construction on, until
    the caller takes the count over (:meth:`take_over`) or :meth:`detach` removes it.

    Why both: a DiLoCo built without ``with`` must still sync (a silent no-op trains W
    unrelated models), yet loops that count their own steps (thinwire's trainer, the
    simulator) call ``after_inner_step(step)`` themselves and must not count twice."""

    def __init__(self, optimizer: torch.optim.Optimizer, on_step: Callable[[], Any]) -> None:
        self.optimizer = optimizer
        self.on_step = on_step
        self.handle: Any = None
        self.counted = False  # the hook counted a step no caller has reported yet
        self.last: Any = None  # what on_step returned then
        self.attach()

    def attach(self) -> None:
        if self.handle is None:
            self.handle = self.optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self._fire()
            )

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _fire(self) -> None:
        self.last = self.on_step()
        self.counted = True

    def report(self, owner: Any, step: int | None) -> Any:
        """A caller reports inner step ``step`` to ``owner`` (who counts with
        ``owner._count(step)`` and keeps ``owner.local_step``): the count is the caller's
        from now on; the step the hook has already counted is not counted again."""
        counted, result = self.take_over()
        if not counted:
            return owner._count(step)
        if step is not None:
            owner.local_step = step  # a caller's clock that starts elsewhere wins
        return result

    def take_over(self) -> tuple[bool, Any]:
        """The caller counts from now on: remove the hook. ``(True, result)`` when the
        hook has already counted the step the caller is reporting (a caller reports a
        step right after ``optimizer.step()``, whose hook ran first), ``(False, None)``
        otherwise."""
        self.detach()
        counted, self.counted = self.counted, False
        return counted, self.last if counted else None


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
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self._track(model, sync_initial)
        self.outer = self._outer_optimizer(outer_lr, outer_momentum, outer_optimizer)
        self.local_step = 0
        self.outer_steps = 0
        self._onebit: Any = None
        if compress == "onebit":
            from thinwire.comm.onebit_allreduce import OneBitAllreduce

            self._onebit = OneBitAllreduce(process_group, error_feedback=error_feedback)
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
        # After the rule's hooks, so a sync sees the step's lr clock already advanced.
        self._steps = InnerStepHook(inner_optimizer, self._count)
        # Until close(): also for a loop that counts its own steps.
        self._thaw_hook: Any = inner_optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self._anchor_thawed()
        )

    def _track(self, model: nn.Module, sync_initial: bool) -> None:
        """Every parameter (frozen ones too: one may thaw later), its global copy, and
        the buffers; rank 0's of all of them everywhere with ``sync_initial``."""
        self.params = list(model.parameters())
        if any(is_sharded(p) for p in self.params):
            # FSDP2 inside an island, DiLoCo across islands: each rank's outer step works
            # on its own shards, and its pseudo-gradients travel over the replicas only.
            check_layout(self.params, self.group, "DiLoCo", island_only=True)
        # This rank's shard of each parameter (the whole parameter without FSDP2): the
        # outer step is elementwise, so it needs nothing of the other shards.
        self._shards = [local(p) for p in self.params]
        self.buffers = synced_buffers(model)
        if sync_initial and self.world > 1:
            broadcast_replicas(self._shards, self.group, "diloco.broadcast")
            broadcast_buffers_(self.buffers, self.group, "diloco.broadcast.buffers")
        # A global copy of each parameter that trains; one frozen at construction (a
        # frozen backbone) is its own global copy, a view that costs no memory, until it
        # thaws (_anchor_thawed).
        self.global_params = [
            s.detach().clone() if p.requires_grad else s.detach()
            for p, s in zip(self.params, self._shards, strict=True)
        ]
        self._anchored = set(self._trainable())
        self._live = self._trainable()  # trainable at the last sync
        self._carried = list(self._live)  # what the last sync's exchange held

    def _trainable(self) -> list[int]:
        """Indices of the parameters that require a gradient now."""
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    @torch.no_grad()
    def _anchor_thawed(self) -> None:
        """Before each inner step: a parameter frozen since construction that trains now
        gets a global copy of its own, taken before the step moves it (its value since
        the last sync: this round's start)."""
        if len(self._anchored) == len(self.params):
            return  # nothing frozen since construction (the usual case): no loop per step
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._anchored:
                self.global_params[i].data = self._shards[i].detach().clone()
                self._anchored.add(i)

    def _outer_optimizer(
        self,
        outer_lr: float,
        outer_momentum: float,
        factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
    ) -> torch.optim.Optimizer:
        if factory is not None:
            return factory(self.global_params)
        # Momentum 0 is plain averaging: SGD on the averaged pseudo-gradient (torch
        # refuses Nesterov without momentum, and with none there is nothing to look
        # ahead with).
        return torch.optim.SGD(
            self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )

    # --- hooking into the inner optimizer ----------------------------------------------
    def __enter__(self) -> DiLoCo:
        self._steps.attach()  # there since construction, unless a block was left before
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop counting the inner optimizer's steps (no more syncs by themselves)."""
        self._steps.detach()
        if self._thaw_hook is not None:
            self._thaw_hook.remove()
            self._thaw_hook = None

    def after_inner_step(self, step: int | None = None) -> bool:
        """Count one inner step (or set the count to ``step``); sync every H. True if synced.

        For loops that count their own steps: the first call takes the count over from
        the hook registered at construction (the step it reports is the one that hook
        just counted), so call it after every ``inner.step()`` from then on."""
        return bool(self._steps.report(self, step))

    def _count(self, step: int | None = None) -> bool:
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
        """Average the pseudo-gradients ``theta - theta_w`` of the parameters that trained
        in this round, step the outer optimizer, load the new theta into the model,
        average the buffers and apply the inner-state rule: the next round starts here."""
        self._anchor_thawed()  # one thawed since the last inner step: nothing moved it yet
        now = self._trainable()
        # A parameter frozen during the round still ends it (its replicas moved apart
        # before the freeze); from the next round on it stays as the user holds it.
        carried = sorted(set(now) | set(self._live))
        if carried != self._carried:
            self._retrack(carried)
        if carried:
            self._outer_step(carried, set(now))
        for i in self._anchored.difference(carried):
            # Frozen the whole round: theta follows it, its round starting here should it
            # thaw (torch skipped it: no gradient, no momentum).
            self.global_params[i].copy_(self._shards[i])
        self._live = now
        average_buffers_(self.buffers, self.group, "diloco.allreduce.buffers")
        self.rule.begin_round(self.inner)
        self.outer_steps += 1

    def _outer_step(self, carried: list[int], trains: set[int]) -> None:
        """The outer step of the ``carried`` parameters; those that no longer train (not
        in ``trains``) take the plain average of the replicas (theta minus the averaged
        pseudo-gradient: no outer-momentum step on a frozen parameter, and a parameter
        frozen right after a sync does not move at all)."""
        pseudo = torch.cat(
            [
                (self.global_params[i] - self._shards[i].detach()).reshape(-1).float()
                for i in carried
            ]
        )
        avg = self._average(pseudo)
        offset = 0
        for i in carried:
            g = self.global_params[i]
            share = avg[offset : offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
            if i in trains:
                g.grad = share
            else:
                g.sub_(share)
        self.outer.step()  # parameters without a gradient are skipped
        for i in carried:
            self.global_params[i].grad = None
            self._shards[i].copy_(self.global_params[i])

    def _retrack(self, carried: list[int]) -> None:
        """The carried set changed since the last sync: the 1-bit error buffers were
        laid out for the old set and cannot be remapped (the server's half is per
        segment of the sum), so they restart from zero; that loses one sync's rounding."""
        if self._onebit is not None:
            self._onebit.reset()
        self._carried = carried

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global and local params (an empty tensor in the place of each one frozen since
        construction: the model's own checkpoint holds it), the outer state, the step
        counts, the trainable set of the last sync, this rank's buffers, 1-bit errors."""
        state = {
            "global": [self._saved(i, g) for i, g in enumerate(self.global_params)],
            "local": [self._saved(i, p) for i, p in enumerate(self._shards)],
            "outer": self.outer.state_dict(),
            "local_step": self.local_step,
            "outer_steps": self.outer_steps,
            "trainable": list(self._live),
            "carried": list(self._carried),
            "anchored": sorted(self._anchored),
        }
        if self.buffers:
            # Mid-round each replica's statistics are its own, and a trainer's model
            # checkpoint is rank 0's: kept here, a resume continues exactly.
            state["buffers"] = flat_buffers(self.buffers)
        if self._onebit is not None:
            state["onebit"] = self._onebit.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["global"]) != len(self.params) and "trainable" not in state:
            state = self._widen(state)
        if len(state["global"]) != len(self.global_params):
            raise ConfigError(
                f"DiLoCo state holds {len(state['global'])} tensors, the model has "
                f"{len(self.global_params)}"
            )
        anchored = {int(i) for i in state.get("anchored", range(len(self.params)))}
        for i, (g, p) in enumerate(zip(self.global_params, self._shards, strict=True)):
            if i not in anchored:  # frozen since construction there: as the model holds it
                if i in self._anchored:
                    g.copy_(p)
                continue
            if i not in self._anchored:
                g.data = p.detach().clone()
                self._anchored.add(i)
            g.copy_(state["global"][i])
            p.copy_(state["local"][i])
        self.outer.load_state_dict(state["outer"])
        self.local_step = int(state["local_step"])
        self.outer_steps = int(state["outer_steps"])
        self._live = [int(i) for i in state.get("trainable", self._trainable())]
        self._carried = [int(i) for i in state.get("carried", self._live)]
        if self.buffers and "buffers" in state:
            load_buffers_(self.buffers, state["buffers"])
        self.rule.round_step = self.local_step % self.sync_every
        if self._onebit is not None and "onebit" in state:
            self._onebit.load_state_dict(state["onebit"])

    def _saved(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        """What a checkpoint keeps of parameter ``i``'s global or local copy."""
        return tensor.detach().clone() if i in self._anchored else torch.empty(0)

    def _widen(self, state: dict[str, Any]) -> dict[str, Any]:
        """A save from before DiLoCo tracked frozen parameters holds the trainable ones
        only: place them among this model's parameters (the frozen ones keep their
        values) and renumber the outer optimizer's state to match."""
        live = self._trainable()
        if len(state["global"]) != len(live) or len(state["outer"]["param_groups"]) != 1:
            return state  # the count check (or torch) says what does not match, in one line
        glob = [g.detach().clone() for g in self.global_params]
        loc = [p.detach().clone() for p in self._shards]
        for k, i in enumerate(live):
            glob[i], loc[i] = state["global"][k], state["local"][k]
        outer = dict(state["outer"])
        outer["state"] = {live[int(k)]: v for k, v in outer["state"].items()}
        outer["param_groups"] = [outer["param_groups"][0] | {"params": list(range(len(glob)))}]
        widened = {"global": glob, "local": loc, "outer": outer, "trainable": live}
        return state | widened | {"anchored": live}


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
