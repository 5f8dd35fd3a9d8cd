"""Streaming DiLoCo: the model's fragments synced in turn, overlapped with training.

Streaming DiLoCo (Douillard et al., 2025, https://arxiv.org/abs/2501.18512) keeps
DiLoCo's round of ``H`` inner steps per fragment, but splits the model into ``P``
fragments whose rounds are staggered: fragment ``p`` sends its pseudo-gradient
``theta_p - theta_w,p`` at the local steps ``t`` with ``t mod H = offset_p``
(offsets spread evenly over the round), so each sync carries about ``1/P`` of the
model and the peak bandwidth drops ``P``-fold at the same total bytes. Three more knobs:

* ``overlap`` (the paper's tau): the exchange runs in the background while the worker
  takes ``overlap`` more inner steps; the averaged pseudo-gradient is applied then.
  Training never waits for the network as long as the exchange takes less than
  ``overlap`` steps.
* ``alpha``: after the outer step the fragment's local weights become ``alpha * local +
  (1 - alpha) * global``. ``alpha = 0`` (the default) is DiLoCo's replacement and
  discards the ``overlap`` steps taken meanwhile; ``alpha = 0.5`` (the paper's choice
  with ``overlap > 0``) keeps half of them.
* ``compress``: ``bf16``/``fp16`` casts, or ``int8``, ``fp8`` and ``int4`` block-scaled
  quantization, or ``onebit`` (sign bits and an RMS scale per block, 28x fewer bytes than
  fp32) (:class:`thinwire.comm.QuantizedAllreduce`), summed in fp32, with error
  feedback per fragment unless ``error_feedback=False`` (the paper's plain 4-bit).

With ``fragments=1, overlap=0, alpha=0``, the same inner-state rule and the same
``compress`` (``none`` or a cast) it is exactly
:class:`~thinwire.localsgd.algorithm.diloco.DiLoCo` (a test holds them equal); DiLoCo's
``onebit`` is its own tuned 1-bit allreduce, which scales a tensor's last, partial block
by its real elements where this exchange zero-fills it.

Usage (as DiLoCo: hooks on the inner optimizer, nothing else changes)::

    with StreamingDiLoCo(model, inner, sync_every=50, fragments=4, overlap=5,
                         alpha=0.5, compress="int4") as streaming:
        for x, y in batches:
            loss_fn(model(x), y).backward()
            inner.step()          # some steps send or apply a fragment
            inner.zero_grad()

Tuning guide: ``fragments`` 2-8; each fragment needs ``H / fragments`` steps between
its neighbours' sends, so ``overlap`` must stay below ``sync_every // fragments``; an
overlap of a few steps with ``alpha = 0.5`` hides the exchange without losing those
steps (measured: docs/results/localsgd.md, "Streaming DiLoCo"; with ``alpha = 0`` the
overlap was the worst variant). A fragment is a run of consecutive parameters of
about equal size (the paper's transformer-block fragments), or pass the modules
yourself. The exchange runs in one background thread on a process group of its own, so
the training loop may keep using its groups meanwhile (metrics, barriers).

As DiLoCo, it counts the inner steps through a hook registered at construction (with or
without ``with``; a loop that calls :meth:`StreamingDiLoCo.after_inner_step` itself takes
the count over at its first call). The model's buffers (BatchNorm's statistics) travel
with the fragment that syncs at the end of each round (the last one), uncompressed in a
small allreduce of their own, and are merged with the same ``alpha``
(:mod:`thinwire.localsgd.algorithm.buffers`). The fragments are cut from the parameters
trainable at construction: freezing or unfreezing one later is refused at the next send,
in one line (DiLoCo follows such changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import captured, replay
from thinwire.comm.allreduce import all_reduce_mean_
from thinwire.compress.cast import CAST_DTYPES, cast_decode, cast_encode
from thinwire.compress.quantize import BLOCK_CODES, DEFAULT_QUANT_BLOCK, block_codec
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.buffers import (
    broadcast_buffers_,
    flat_buffers,
    load_buffers_,
    synced_buffers,
)
from thinwire.localsgd.algorithm.diloco import (
    DEFAULT_OUTER_LR,
    InnerStepHook,
    broadcast_replicas,
    load_replicas,
)
from thinwire.localsgd.algorithm.outer import check_outer_args
from thinwire.localsgd.algorithm.streaming_fragments import (
    FRAGMENT_RULES,
    apply_fragment_rule,
    split_fragments,
    sync_offsets,
)
from thinwire.optim.sharded import check_layout, is_sharded, local

__all__ = ["STREAMING_COMPRESS", "StreamingDiLoCo", "check_streaming_args"]

STREAMING_COMPRESS = ("none", *CAST_DTYPES, *BLOCK_CODES)
"""``none`` (fp32), the 16-bit casts, the block-scaled quantizers and the 1-bit code."""


def check_error_feedback(compress: str, error_feedback: bool) -> None:
    """Turning error feedback off needs a code that rounds (the quantizers or
    ``onebit``, whole or in fragments): a one-line :class:`ConfigError` otherwise."""
    if not error_feedback and compress not in BLOCK_CODES:
        raise ConfigError(
            f"error feedback is the quantizers' ({', '.join(BLOCK_CODES)}): turning it off "
            f"with compress {compress!r} changes nothing"
        )


def check_streaming_args(
    sync_every: int,
    fragments: int,
    overlap: int,
    alpha: float,
    compress: str,
    inner_momentum: str,
    error_feedback: bool = True,
) -> None:
    """Every setting of Streaming DiLoCo that can be checked without the model, as a
    one-line :class:`ConfigError` (``thinwire train`` checks them before it starts)."""
    check_error_feedback(compress, error_feedback)
    if int(sync_every) != sync_every or sync_every < 1:
        raise ConfigError(
            f"Streaming DiLoCo sync_every (H) must be an integer >= 1, got {sync_every}"
        )
    if compress not in STREAMING_COMPRESS:
        raise ConfigError(
            f"Streaming DiLoCo's compression must be one of {', '.join(STREAMING_COMPRESS)}, got {compress!r}"
        )
    if not 0.0 <= alpha < 1.0:
        raise ConfigError(f"Streaming DiLoCo alpha must be in [0, 1), got {alpha}")
    if int(fragments) != fragments or fragments < 1:
        raise ConfigError(f"Streaming DiLoCo fragments must be an integer >= 1, got {fragments}")
    sync_offsets(int(sync_every), fragments)  # a step per fragment
    gap = max(1, int(sync_every) // fragments)
    if int(overlap) != overlap or not 0 <= overlap < gap:
        raise ConfigError(
            f"Streaming DiLoCo overlap must be an integer in [0, sync_every // fragments) "
            f"= [0, {gap}), got {overlap}"
        )
    if inner_momentum not in FRAGMENT_RULES:
        raise ConfigError(
            f"Streaming DiLoCo applies the inner-state rule per fragment: choose one of "
            f"{', '.join(FRAGMENT_RULES)} (got {inner_momentum!r}; 'restart' rescales the "
            "whole optimizer's lr and has no per-fragment form)"
        )


class StreamingDiLoCo:
    """Streaming DiLoCo around a model and its inner optimizer.

    Args:
        model: the worker's model (its parameters are the local replica).
        inner_optimizer: the optimizer the user steps every iteration (AdamW).
        sync_every: H, inner steps between two syncs of the same fragment.
        fragments: how many fragments (consecutive parameters of about equal size), or
            the modules that make them (their parameters must cover every trainable
            parameter of ``model`` exactly once).
        overlap: inner steps between a fragment's send and the use of its average
            (tau); below ``sync_every // fragments``.
        alpha: weight of the local weights when a fragment's new global weights arrive
            (0 replaces them, as DiLoCo does).
        outer_lr, outer_momentum: the outer Nesterov SGD, one for all fragments (each
            fragment's momentum moves only when it syncs); defaults as DiLoCo's.
        compress: ``none``, ``fp16``, ``bf16``, ``int8``, ``fp8``, ``int4`` or ``onebit``.
        error_feedback: keep what quantization lost, per fragment (quantizers and
            ``onebit`` only). Leave it on: level with it at int4, 0.78% better on
            average at ``onebit`` (docs/results/localsgd.md).
        quant_block: elements per scale of the quantizers.
        process_group: the workers' group (default: every rank).
        sync_initial: broadcast rank 0's parameters first, so all replicas start equal.
        inner_momentum: ``keep`` (the default: the inner state persists, as in the
            paper), ``round`` (zero the fragment's first moment when its average is
            applied) or ``fresh`` (forget the fragment's inner state then). DiLoCo's
            default ``restart`` rescales the whole optimizer's lr and has no
            per-fragment form.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        fragments: int | Sequence[nn.Module] = 2,
        overlap: int = 0,
        alpha: float = 0.0,
        outer_lr: float | None = None,
        outer_momentum: float = 0.9,
        compress: str = "none",
        error_feedback: bool = True,
        quant_block: int = DEFAULT_QUANT_BLOCK,
        process_group: dist.ProcessGroup | None = None,
        sync_initial: bool = True,
        inner_momentum: str = "keep",
    ) -> None:
        outer_lr = DEFAULT_OUTER_LR if outer_lr is None else outer_lr
        check_outer_args(outer_lr, outer_momentum)
        count = fragments if isinstance(fragments, int) else len(fragments)
        check_streaming_args(
            sync_every, count, overlap, alpha, compress, inner_momentum, error_feedback
        )
        self.model = model
        self.inner = inner_optimizer
        self.sync_every = int(sync_every)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fragments = split_fragments(model, self.params, fragments)
        self.offsets = sync_offsets(self.sync_every, len(self.fragments))
        self.overlap, self.alpha, self.compress = int(overlap), float(alpha), compress
        self.inner_momentum = inner_momentum
        if any(is_sharded(p) for p in self.params):
            check_layout(self.params, process_group, "Streaming DiLoCo", island_only=True)
        self.group = process_group
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self._shards = [local(p) for p in self.params]
        self.buffers = synced_buffers(model)
        if sync_initial and self.world > 1:
            broadcast_replicas(self._shards, process_group, "streaming.broadcast")
            broadcast_buffers_(self.buffers, process_group, "streaming.broadcast.buffers")
        # The buffers ride with the fragment that syncs at the end of a round, so one
        # fragment averages them exactly where DiLoCo does.
        self._buffer_fragment = self.offsets.index(0)
        self._buffer_avg: torch.Tensor | None = None  # averaged, not yet applied
        self.global_params = [p.detach().clone() for p in self._shards]
        nesterov = outer_momentum > 0  # torch refuses Nesterov without momentum
        self.outer = torch.optim.SGD(
            self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )
        self._wire_group = self._exchange_group(process_group)
        if compress in BLOCK_CODES:
            block_codec(compress, quant_block)  # a bad block fails here, on one rank too
        self._codecs = [self._codec(compress, error_feedback, quant_block) for _ in self.fragments]
        self._executor: ThreadPoolExecutor | None = None
        # fragment -> (the local step at which its average is applied, the average or
        # the future that yields it)
        self._pending: dict[int, tuple[int, Future[torch.Tensor] | torch.Tensor]] = {}
        self._records: dict[int, list[tuple[str, int, int]]] = {}  # bytes not yet counted
        self.local_step = 0
        self.syncs = 0
        self._applied_at: list[int | None] = [None] * len(self.fragments)
        self._steps = InnerStepHook(inner_optimizer, self._count)

    def _exchange_group(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The group the background exchange uses. The default group is shared with the
        training loop (metrics, barriers), and two threads must never interleave
        collectives on one group, so a background exchange over every rank gets a group
        of its own; a ``process_group`` the caller gave is taken to be DiLoCo's alone."""
        if self.world == 1 or self.overlap == 0 or group is not None:
            return group
        return dist.new_group(list(range(dist.get_world_size())))

    def _codec(self, compress: str, error_feedback: bool, block: int) -> Any:
        if compress in BLOCK_CODES and self.world > 1:
            from thinwire.comm.quantized_allreduce import QuantizedAllreduce

            return QuantizedAllreduce(
                compress,
                self._wire_group,
                block=block,
                error_feedback=error_feedback,
                op_name=f"streaming.{compress}",
            )
        return None

    # --- hooking into the inner optimizer ----------------------------------------------
    def __enter__(self) -> StreamingDiLoCo:
        self._steps.attach()  # there since construction, unless a block was left before
        return self

    def __exit__(self, *exc: object) -> None:
        self._steps.detach()
        if exc[0] is None:
            self.flush()
        self.close()

    def after_inner_step(self, step: int | None = None) -> int:
        """Count one inner step (or set the count to ``step``); apply the fragments due
        now, then send the fragments whose turn it is. Returns how many were applied.

        For loops that count their own steps: the first call takes the count over from
        the hook registered at construction (the step it reports is the one that hook
        just counted), so call it after every ``inner.step()`` from then on."""
        return int(self._steps.report(self, step))

    def _count(self, step: int | None = None) -> int:
        self.local_step = self.local_step + 1 if step is None else step
        applied = 0
        for f, (due, _) in sorted(self._pending.items()):
            if due <= self.local_step:
                self._apply(f)
                applied += 1
        phase = self.local_step % self.sync_every
        for f, offset in enumerate(self.offsets):
            if offset == phase:
                self._send(f)
        return applied

    def flush(self) -> None:
        """Wait for every fragment in flight and apply it now (at the end of training,
        or before evaluating the model)."""
        for f in sorted(self._pending):
            self._apply(f)

    def finish(self) -> None:
        """End training on the global model: wait for the fragments in flight, then
        sync every fragment once more and replace the local weights with the result, so
        the replicas end equal and hold every worker's last steps (as DiLoCo's do after
        its last round). This last sync carries the whole model at once, less the
        fragments :meth:`finishing` leaves out."""
        self.flush()
        due = self.finishing()
        alpha, self.alpha = self.alpha, 0.0
        try:
            for f in due:
                avg = self._average_with_buffers(f, self._pseudo(f), self._buffers_of(f))
                self._pending[f] = (self.local_step, avg)
                self._apply(f)
        finally:
            self.alpha = alpha

    def finishing(self) -> list[int]:
        """The fragments :meth:`finish` syncs once the ones in flight have landed: all
        but those whose average replaced the local weights at this very step (a sync at
        the last step, or one the flush landed, without mixing: ``alpha = 0``). Those
        are the same on every replica already, and one more sync would only move them by
        the outer momentum, a step DiLoCo does not take."""
        if self.alpha != 0.0:
            return list(range(len(self.fragments)))
        now = self.local_step
        return [f for f in range(len(self.fragments)) if self._applied_at[f] != now]

    def close(self) -> None:
        """Stop counting the inner steps and stop the background thread (after
        :meth:`flush`, nothing is lost; a later send starts a new one)."""
        self._steps.detach()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # --- one fragment's round ----------------------------------------------------------
    @torch.no_grad()
    def _pseudo(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s pseudo-gradient ``theta - theta_w``, flat, in fp32."""
        return torch.cat(
            [
                (self.global_params[i] - self._shards[i].detach()).reshape(-1).float()
                for i in self.fragments[f]
            ]
        )

    def _send(self, f: int) -> None:
        self._check_trainable()
        pseudo, bufs = self._pseudo(f), self._buffers_of(f)
        if self.overlap == 0:
            self._pending[f] = (self.local_step, self._average_with_buffers(f, pseudo, bufs))
            self._apply(f)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="thinwire-streaming")
        future = self._executor.submit(self._average_captured, f, pseudo, bufs)
        self._pending[f] = (self.local_step + self.overlap, future)

    def _check_trainable(self) -> None:
        """The fragments (and their error feedback) are laid out over the parameters
        trainable at construction; syncing a changed set would silently skip a thawed
        parameter or drift a frozen one by the outer momentum."""
        now = [id(p) for p in self.model.parameters() if p.requires_grad]
        if now != [id(p) for p in self.params]:
            raise ConfigError(
                f"Streaming DiLoCo syncs the {len(self.params)} parameters trainable at its "
                f"construction, {len(now)} require a gradient now: build it after freezing "
                "or unfreezing (DiLoCo follows such changes)"
            )

    def _buffers_of(self, f: int) -> torch.Tensor | None:
        """This replica's buffers, flat, when fragment ``f`` carries them."""
        if f != self._buffer_fragment or not self.buffers:
            return None
        return flat_buffers(self.buffers)

    def _average_with_buffers(
        self, f: int, flat: torch.Tensor, bufs: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`_average` of fragment ``f``, then of the buffers it carries (kept for
        :meth:`_apply`): on the same thread and group, so every rank orders them alike."""
        avg = self._average(f, flat)
        if bufs is not None:
            op_name = "streaming.allreduce.buffers"
            self._buffer_avg = all_reduce_mean_(bufs, self._wire_group, op_name=op_name)
        return avg

    def _average_captured(
        self, f: int, flat: torch.Tensor, bufs: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`_average_with_buffers` in the background thread; its bytes are counted when the
        average is applied (by then the exchange has finished on every run alike)."""
        with captured() as records:
            avg = self._average_with_buffers(f, flat, bufs)
        self._records[f] = records
        return avg

    def _average(self, f: int, flat: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return flat
        if self._codecs[f] is not None:
            return self._codecs[f](flat)
        if self.compress in CAST_DTYPES:
            wire = cast_encode(flat, CAST_DTYPES[self.compress])
            all_reduce_mean_(wire, self._wire_group, op_name=f"streaming.allreduce.{self.compress}")
            return cast_decode(wire, flat.dtype)
        return all_reduce_mean_(flat, self._wire_group, op_name="streaming.allreduce")

    @torch.no_grad()
    def _apply(self, f: int) -> None:
        """The outer step on fragment ``f`` with its average, then the merge into the
        local weights and the fragment's inner-state rule."""
        _, result = self._pending.pop(f)
        avg = result.result() if isinstance(result, Future) else result
        replay(self._records.pop(f, []))
        offset = 0
        for i in self.fragments[f]:
            g = self.global_params[i]
            g.grad = avg[offset : offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()
        self.outer.step()  # parameters without a gradient (other fragments) are skipped
        for i in self.fragments[f]:
            g, p = self.global_params[i], self._shards[i]
            g.grad = None
            if self.alpha:
                p.mul_(self.alpha).add_(g, alpha=1.0 - self.alpha)
            else:
                p.copy_(g)
        if f == self._buffer_fragment and self._buffer_avg is not None:
            load_buffers_(self.buffers, self._buffer_avg, keep=self.alpha)
            self._buffer_avg = None
        apply_fragment_rule(
            self.inner, [self.params[i] for i in self.fragments[f]], self.inner_momentum
        )
        self._applied_at[f] = self.local_step
        self.syncs += 1

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global and local weights, the outer state, the step count, the averages still
        to apply (waited for first) and each fragment's error feedback."""
        pending = {}
        for f, (due, result) in self._pending.items():
            avg = result.result() if isinstance(result, Future) else result
            self._pending[f] = (due, avg)
            pending[f] = (due, avg.clone())
        return {
            "global": [g.detach().clone() for g in self.global_params],
            "local": [p.detach().clone() for p in self._shards],
            "outer": self.outer.state_dict(),
            "local_step": self.local_step,
            "syncs": self.syncs,
            "applied_at": list(self._applied_at),
            "pending": pending,
            # The bytes of the fragments in flight are counted when they are applied, in
            # the resumed run as in this one.
            "uncounted": {f: list(self._records.get(f, [])) for f in pending},
            "codecs": [None if c is None else c.state_dict() for c in self._codecs],
            # This replica's own (a trainer's model checkpoint is rank 0's), and the
            # average in flight with the buffer fragment, if any.
            "buffers": flat_buffers(self.buffers) if self.buffers else None,
            "buffer_avg": None if self._buffer_avg is None else self._buffer_avg.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["codecs"]) != len(self.fragments):
            raise ConfigError(
                f"Streaming DiLoCo state was saved with {len(state['codecs'])} fragments, "
                f"this run has {len(self.fragments)}: resume with the same fragments"
            )
        load_replicas(state, self.global_params, self._shards, "Streaming DiLoCo")
        self.outer.load_state_dict(state["outer"])
        self.local_step = int(state["local_step"])
        self.syncs = int(state["syncs"])
        # Saved before it was kept: finish then syncs every fragment, as it did.
        self._applied_at = list(state.get("applied_at", [None] * len(self.fragments)))
        self._pending = {
            int(f): (int(due), avg.clone()) for f, (due, avg) in state["pending"].items()
        }
        uncounted = state.get("uncounted", {})
        self._records = {int(f): [tuple(r) for r in rs] for f, rs in uncounted.items()}
        for codec, saved in zip(self._codecs, state["codecs"], strict=True):
            if codec is not None and saved is not None:
                codec.load_state_dict(saved)
        if self.buffers and state.get("buffers") is not None:
            load_buffers_(self.buffers, state["buffers"])
        self._buffer_avg = state.get("buffer_avg")
