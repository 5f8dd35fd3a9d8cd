"""DDP communication hook: 1-bit error-feedback compression of gradient buckets.

Plugs the compressed allreduce (:class:`thinwire.comm.onebit_allreduce.OneBitAllreduce`)
into PyTorch DDP's own extension point, the way PowerSGD's hook does::

    from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook

    state = OneBitHookState(process_group=None, warmup_steps=100)
    ddp_model.register_comm_hook(state, onebit_hook)

or, with the optimizer's pairing checked, ``thinwire.comm.register_comm_hook(ddp_model,
"onebit", optimizer=opt, warmup_steps=100)``.

Each gradient bucket is averaged with sign bits plus one scale per block of 64
elements, 21x fewer bytes than fp32. What the compression loses is kept per bucket, on the
worker and on the server side, and added back next step (error-feedback sign SGD:
Seide et al. 2014, Karimireddy et al. arXiv 1901.09847, Tang et al. arXiv 2102.02888).
Because only the gradients change, it works with any optimizer.

**Overlap.** Like PyTorch's own hooks, the hook returns at once with a future that
completes when the bucket's collective is done, so the collective runs while backward
computes the next buckets. The 1-bit allreduce is several collectives with compute in
between, so it runs on one background thread per state
(:class:`thinwire.comm.hook_worker.HookWorker`), which takes the buckets in DDP's index
order on every rank: every rank issues the same collectives in the same order. The
result is bit-identical to running each collective inside the hook (``overlap=False``).

**Its own process group.** DDP runs collectives of its own on its group while backward
goes on (the bitmap of ``find_unused_parameters=True`` at the end of backward) and before
forward (``broadcast_buffers=True``); on the same group as the hook's thread they would
meet in a different order on each rank (a hang, or gloo's "collective mismatch"). So the
state averages over the ranks of ``process_group`` on a group of its own
(:func:`thinwire.comm.hook_group.hook_group`), made when the state is created (or, if
``torch.distributed`` is not initialized yet, at its first bucket), on every rank alike;
``close()`` destroys it. Every collective of the hook goes there: the warmup's allreduce,
the 1-bit collectives, with or without overlap.

Tuning guide:

* ``warmup_steps``: plain (uncompressed) allreduce for this many steps first. Early
  training is the most sensitive to compression error, and DDP rebuilds its buckets
  after the first step. 5-10% of the run is a good start; never less than 1.
* Bucket size (``bucket_cap_mb`` of DDP): only buckets that are ready before backward
  ends can overlap it, and every bucket costs 3 collective latencies. A model smaller
  than DDP's cap (25 MB) is one bucket: nothing to overlap. A cap of a quarter of the
  gradient size gives 4 buckets, 3 of which overlap; one bucket has the fewest
  latencies, which pays on a WAN whose round trips dominate.
* On CPU hosts the compression compute runs beside backward and competes for the same
  cores: overlap hides the wire time, not the compute. On GPUs it runs on a side stream.
* Adaptive optimizers (Adam, AdamW, ...) behind this hook build their second moment
  from 1-bit gradients, which carry each block's magnitude, not each element's: on the
  model zoo AdamW lost up to 12% accuracy (docs/compression.md). For Adam-style
  training use 1-bit Adam (:class:`thinwire.optim.OneBitAdam`), which freezes the second
  moment and compresses the momentum; :func:`thinwire.comm.register_comm_hook`, given
  the optimizer, says so in one line.

**Checkpoints.** Residuals are kept per bucket, with the bucket's parameters (their
places in the order of DDP's first iteration, the same in every run of the same model
and options). A new DDP's first iteration puts all parameters in one bucket before it
rebuilds its buckets; after loading a checkpoint the hook reduces that bucket as the
saved buckets it contains, each with its own residuals, so a resumed run is
bit-identical to an uninterrupted one. A :class:`~thinwire.comm.resumable_ddp.ResumableDDP`
that rehearses before its first step (as ``thinwire train`` does on resume) skips that
initial bucket altogether, so the plain allreduce of the warmup steps resumes exactly
too.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook inspects the
# hook's annotations at runtime and rejects string annotations.
import weakref
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.allreduce import all_reduce_mean_, allreduce_hook
from thinwire.comm.hook_group import hook_group, release_group
from thinwire.comm.hook_worker import HookWorker, completed
from thinwire.comm.onebit_allreduce import NonFiniteError, OneBitAllreduce
from thinwire.compress.onebit import check_block

__all__ = ["HOOK_BLOCK", "OneBitHookState", "onebit_hook"]

HOOK_BLOCK = 64
"""Elements per 1-bit scale in the hook unless told otherwise: finer than the
optimizers' 256, because the hook compresses every gradient of every step and the
optimizer behind it sees each block's magnitude in place of each element's. 1.5 bits per
element, 21x fewer bytes than fp32. Measured behind AdamW on the model zoo (3 seeds,
docs/compression.md): 64 against 256, ReLU CNN 0.936 against 0.927 accuracy (AdamW
alone 0.947), bag of words 0.858 against 0.840, thinwire's GPT 2.735 against 2.805 loss
(AdamW 2.594)."""

_NONFINITE = ("allreduce", "raise")

Spans = list[tuple[int, int]]
"""Element ranges of a bucket's buffer holding one saved bucket's parameters, in order."""
Plan = list[tuple[OneBitAllreduce, Spans | None]]
"""The collectives that reduce one bucket: its own (spans None), or one per saved bucket."""


def _reduce(
    allreduce: OneBitAllreduce, buf: torch.Tensor, nonfinite: str, group: dist.ProcessGroup | None
) -> None:
    """One buffer's average, in place: 1-bit, or plain for a non-finite one."""
    try:
        allreduce(buf, out=buf)
    except NonFiniteError:
        # Raised on every rank alike, so every rank takes the same branch here.
        if nonfinite == "raise":
            raise
        all_reduce_mean_(buf, group, op_name="ddp.allreduce")


def _run_plan(
    plan: Plan, buf: torch.Tensor, nonfinite: str, group: dist.ProcessGroup | None
) -> None:
    for allreduce, spans in plan:
        if spans is None:
            _reduce(allreduce, buf, nonfinite, group)
            continue
        part = torch.cat([buf[a:b] for a, b in spans])
        _reduce(allreduce, part, nonfinite, group)
        offset = 0
        for a, b in spans:
            buf[a:b].copy_(part[offset : offset + b - a])
            offset += b - a


class OneBitHookState:
    """State of :func:`onebit_hook`: step counter, options and per-bucket residuals.

    Args:
        process_group: the ranks to average over (``None``: every rank). The hook talks
            on a group of its own over the same ranks (:meth:`group`), never on this
            one, so passing DDP's own group is safe. Create the state on every rank of
            the job, in the same order (over a subgroup: on every member): making that
            group is collective.
        warmup_steps: steps of plain allreduce before compression starts.
        nonfinite: what a bucket with NaN/Inf gradients does. ``"allreduce"`` (default)
            sends it uncompressed, so the NaN/Inf reaches the optimizer exactly as with
            plain DDP (a ``GradScaler`` then skips the step) and the residuals stay
            untouched; ``"raise"`` makes ``backward()`` raise a ``RuntimeError`` naming
            :class:`NonFiniteError` on every rank (residuals untouched; DDP stays usable,
            so the caller can skip the step).
        chunk: elements per step of the in-place residual updates (see
            :class:`OneBitAllreduce`).
        overlap: run each bucket's collective on a background thread while backward
            goes on (default). ``False`` runs it inside the hook, blocking backward: the
            same result bit for bit, without the overlap.
        block: elements per 1-bit scale (see
            :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce`; default
            :data:`HOOK_BLOCK`, 64). Smaller blocks follow the gradient's magnitude more
            closely (each layer, each part of a layer, gets its own) at 32 bits per
            block: 64 adds half a bit per element, 256 an eighth. None is one scale per
            bucket (the papers').

    The state pickles without the process groups (``process_group`` is ``None`` after
    unpickling, i.e. every rank; set it again before the first bucket if needed) and
    without its thread; both are made again at the first bucket. Residuals travel with
    it, so a checkpoint of the state resumes exactly. :meth:`close` stops the thread and
    destroys the state's group; garbage collection stops the thread (the group then
    goes with ``dist.destroy_process_group()``).
    """

    __slots__ = (
        "__weakref__",
        "_allreduces",
        "_group",
        "_group_for",
        "_layout",
        "_learning",
        "_order",
        "_pending",
        "_worker",
        "block",
        "chunk",
        "iteration",
        "nonfinite",
        "overlap",
        "process_group",
        "warmup_steps",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        warmup_steps: int = 10,
        nonfinite: str = "allreduce",
        chunk: int | None = None,
        overlap: bool = True,
        block: int | None = HOOK_BLOCK,
    ) -> None:
        check_block(block)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.nonfinite = nonfinite
        self.chunk = chunk
        self.overlap = overlap
        self.block = block
        self.iteration = 0
        self._allreduces: dict[int, OneBitAllreduce] = {}
        self._pending: dict[int, dict[str, Any]] = {}  # loaded, not yet met
        self._layout: dict[int, tuple[int, ...] | None] = {}  # bucket -> its parameters
        self._order: dict[int, int] = {}  # parameter address -> place in the first iteration
        self._learning = True  # until this object's first iteration ends
        self._worker: HookWorker | None = None
        self._group: dist.ProcessGroup | None = None
        self._group_for: dist.ProcessGroup | None = None  # the process_group it copies
        if dist.is_initialized():
            # Now, while every rank is at the same point of its program; not in the hook,
            # which on GPUs runs on autograd's device threads.
            self.group()

    # ------------------------------------------------------------------ buckets

    def _positions(self, bucket: dist.GradBucket) -> tuple[int, ...] | None:
        """The places of the bucket's parameters in the order DDP's first iteration handed
        them over (deterministic for a model and DDP's options); None if unknown."""
        params = bucket.parameters()
        if self._learning:
            for p in params:
                self._order.setdefault(p.data_ptr(), len(self._order))
        try:
            return tuple(self._order[p.data_ptr()] for p in params)
        except KeyError:
            return None

    def _materialize(self, index: int) -> OneBitAllreduce:
        saved = self._pending.pop(index)
        positions = saved.get("positions")
        ar = OneBitAllreduce(self.group(), self.chunk, block=self.block)
        ar.load_state_dict({k: v for k, v in saved.items() if k != "positions"})
        self._allreduces[index] = ar
        self._layout[index] = None if positions is None else tuple(positions)
        return ar

    def _split(self, bucket: dist.GradBucket, positions: tuple[int, ...]) -> Plan:
        """Reduce ``bucket`` as the saved buckets that exactly cover it, in their own
        order (DDP's first iteration after a load); [] when they do not."""
        where: dict[int, tuple[int, int]] = {}
        offset = 0
        for pos, p in zip(positions, bucket.parameters(), strict=True):
            where[pos] = (offset, offset + p.numel())
            offset += p.numel()
        if offset != bucket.buffer().numel():
            return []
        parts: list[tuple[int, Spans]] = []
        covered: set[int] = set()
        for j in sorted(self._pending):
            saved = self._pending[j].get("positions")
            if saved is None or not set(saved) <= where.keys():
                continue
            spans = [where[q] for q in saved]
            if sum(b - a for a, b in spans) != self._pending[j]["numel"]:
                return []
            parts.append((j, spans))
            covered.update(saved)
        if not parts or covered != where.keys():
            return []
        return [(self._materialize(j), spans) for j, spans in parts]

    def plan(self, bucket: dist.GradBucket) -> Plan:
        """The collectives (and residuals) that reduce one compressed bucket."""
        index, numel = bucket.index(), bucket.buffer().numel()
        positions = self._positions(bucket)
        saved = self._pending.get(index)
        if index not in self._allreduces and saved is not None:
            were = saved.get("positions")
            same = positions is None or were is None or tuple(were) == positions
            if saved["numel"] in (None, numel) and same:
                self._materialize(index)
            elif positions is not None and (parts := self._split(bucket, positions)):
                return parts
            else:
                del self._pending[index]  # another layout: those residuals are moot
        ar = self._allreduces.get(index)
        if ar is None:
            ar = self._allreduces[index] = OneBitAllreduce(
                self.group(), self.chunk, block=self.block
            )
        elif ar.numel not in (None, numel) or self._layout.get(index) not in (None, positions):
            ar.reset()  # DDP rebuilt its buckets (alike on every rank): old residuals are moot
        self._layout[index] = positions
        return [(ar, None)]

    def rehearse(self, bucket: dist.GradBucket) -> None:
        """See a bucket of a rehearsed iteration, which sends nothing
        (:meth:`thinwire.comm.resumable_ddp.ResumableDDP.rehearse`): learn the parameter
        order as DDP's first iteration hands it over, as :func:`onebit_hook` would, so
        that the saved buckets' positions name the same parameters after a resume as in
        the run that saved them; count no step."""
        if self._learning:
            self._positions(bucket)
            if bucket.is_last():
                self._learning = False

    # ------------------------------------------------------------------ group, thread

    def group(self) -> dist.ProcessGroup:
        """The group every collective of this state runs on: its own, over the ranks of
        ``process_group`` (see the module docstring). Made on first need, on every rank
        alike: when the state is created, or at its first bucket after unpickling, a
        :meth:`close` or a change of ``process_group``."""
        if self._group is not None and self._group_for is not self.process_group:
            self.close()  # process_group was set anew: its ranks may differ
            self._unbind()
        if self._group is None:
            self._group = hook_group(self.process_group)
            self._group_for = self.process_group
        return self._group

    def worker(self) -> HookWorker:
        """The background thread of this state (started on first use)."""
        if self._worker is None:
            self._worker = HookWorker("thinwire-onebit-hook")
            weakref.finalize(self, self._worker.stop)
        return self._worker

    def close(self) -> None:
        """Finish the queued buckets, stop the thread and destroy the state's group (over
        a subgroup it is kept, see :func:`~thinwire.comm.hook_group.release_group`); the
        residuals stay. Call it on every rank: a later bucket starts a new thread and
        makes a new group (collective), and goes on with the same residuals."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.stop()
            worker.thread.join()
        if self._group is not None:
            self._unbind(release=True)

    def _unbind(self, release: bool = False) -> None:
        """Forget the group (destroyed first if ``release`` and it can be, else kept
        bound); park the residuals as if loaded, so that the next bucket binds them to the
        next group (a load's path, which resumes exactly)."""
        buckets = self._buckets()  # while the group lives: a residual's rank is the group's
        if release and self._group is not None and not release_group(self._group):
            return
        self._pending, self._allreduces, self._layout = buckets, {}, {}
        self._group = self._group_for = None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Options, step counter and every bucket's residuals and parameters (this rank's)."""
        if self._worker is not None:
            self._worker.wait_idle()  # no bucket is being reduced while we copy
        return {
            "warmup_steps": self.warmup_steps,
            "nonfinite": self.nonfinite,
            "chunk": self.chunk,
            "overlap": self.overlap,
            "block": self.block,
            "iteration": self.iteration,
            "buckets": self._buckets(),
        }

    def _buckets(self) -> dict[int, dict[str, Any]]:
        """Every bucket's residuals and parameters: those met, and those loaded, not yet met."""
        buckets = dict(self._pending)
        for i, ar in self._allreduces.items():
            positions = self._layout.get(i)
            buckets[i] = ar.state_dict() | {
                "positions": None if positions is None else list(positions)
            }
        return buckets

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._worker is not None:
            self._worker.wait_idle()
        self.warmup_steps = state["warmup_steps"]
        self.nonfinite = state["nonfinite"]
        self.chunk = state["chunk"]
        self.overlap = state.get("overlap", True)  # states saved before the option existed
        self.block = state.get("block")  # ... and before blocks: one scale per bucket
        self.iteration = state["iteration"]
        self._allreduces = {}
        self._layout = {}
        # Loaded on first use, when the process group and the buckets are known.
        self._pending = dict(state["buckets"])

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self._group = self._group_for = None  # made at the first bucket, on every rank
        self._worker = None
        self._order = {}
        self._learning = True
        self.load_state_dict(state)


def onebit_hook(
    state: OneBitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket with 1-bit compression (after ``state.warmup_steps``).

    Register with ``ddp_model.register_comm_hook(state, onebit_hook)``. Returns at once;
    the future completes when the bucket's collective is done (see the module docstring).
    """
    buf = bucket.buffer()
    if state.iteration < state.warmup_steps:
        if state._learning:
            state._positions(bucket)
        fut = allreduce_hook(state.group(), bucket)
    else:
        plan = state.plan(bucket)
        nonfinite, group = state.nonfinite, state.group()

        def work() -> None:
            _run_plan(plan, buf, nonfinite, group)

        fut = state.worker().submit(buf, work) if state.overlap else completed(buf, work)
    if bucket.is_last():
        state.iteration += 1
        state._learning = False
    return fut
