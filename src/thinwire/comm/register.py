"""One call to put thinwire's communication under a DDP model: ``register_comm_hook``.

PyTorch DDP averages gradients with its own built-in allreduce, which no Python code
sees, so a plain DDP baseline shows no bytes in :mod:`thinwire.comm.accounting`.
:func:`register_comm_hook` installs one of thinwire's DDP comm hooks instead, each
counted on the wire:

=========== ========================================================== ===============
``method``  what travels, per step                                     vs fp32
=========== ========================================================== ===============
``fp32``    DDP's own average, unchanged (the baseline, now counted)   1x
``fp16``    the average in fp16 (11 significant bits)                  2x fewer bytes
``bf16``    the average in bf16 (8 bits, fp32's range)                 2x fewer bytes
``onebit``  sign bits plus a scale per block, with error feedback     ~28x fewer
=========== ========================================================== ===============

Give it the optimizer and it checks the pairing: behind ``onebit``, an adaptive
optimizer (Adam, AdamW, RMSprop, Adagrad, ...) computes its second moment from 1-bit
gradients, every element of which has its block's magnitude. Adam's per-element scaling
is lost, and it trains like momentum SGD with one step size per block: on thinwire's
model zoo AdamW behind the 1-bit hook came within 3% of AdamW on the CNN, the MLP and
BERT, and lost 12% accuracy on a bag-of-words model and 4.5-5.5% in loss on the two GPTs
(docs/results/zoo.md, "The model zoo"). 1-bit Adam (:class:`thinwire.optim.OneBitAdam`)
exists for exactly this case: it freezes the second moment after a full-precision
warmup and sends the momentum at one bit per element (within 2% on all of them); for a
LAMB-style optimizer, :class:`thinwire.optim.OneBitLamb`. The pairing is allowed, and
says so in one warning line, on rank 0.

thinwire's own optimizers (:class:`thinwire.optim.CommOptimizer`: ``Lamb``, ``OneBitAdam``,
``OneBitLamb``) are refused behind any of these hooks: they do their own communication
(1-bit momentum after the freeze), so a hook would average what they average again,
or feed 1-bit gradients to their full-precision warmup. Under DDP they register
themselves: ``opt.register_ddp(ddp_model)``.

The 1-bit hook talks on a process group of its own, made here on every rank
(:mod:`thinwire.comm.hook_group`), so DDP's own collectives (``find_unused_parameters``,
``broadcast_buffers``) never meet the hook's.
"""

# No `from __future__ import annotations`: DDP inspects a comm hook's annotations at
# registration and rejects string annotations.
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.allreduce import average_bucket
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook
from thinwire.compress.cast import WIRE_DTYPES, cast_name

__all__ = ["HOOK_METHODS", "adaptive_optimizer", "onebit_counterpart", "register_comm_hook"]

HOOK_METHODS: tuple[str, ...] = (*WIRE_DTYPES, "onebit")
"""What :func:`register_comm_hook` can put on the wire: a dtype of
:data:`thinwire.compress.cast.WIRE_DTYPES` (``fp32``, ``fp16``, ``bf16``) or ``onebit``."""

_ADAPTIVE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
)
_ADAPTIVE_NAMES = ("adam", "adafactor", "adagrad", "rmsprop", "lamb", "lars")
_LAYERWISE_NAMES = ("lamb", "lars")
# Matched by name: comm sits below optim and never imports it (tests/test_architecture.py).
_COMM_OPTIMIZER = ("thinwire.optim.base", "CommOptimizer")
_log = logging.getLogger("thinwire.comm")


def adaptive_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` scales each element by a running statistic of its own
    gradients (Adam's second moment and its kin): torch's adaptive optimizers, and any
    class whose name says Adam, Adafactor, Adagrad, RMSprop, LAMB or LARS."""
    if isinstance(optimizer, _ADAPTIVE):
        return True
    name = type(optimizer).__name__.lower()
    return any(word in name for word in _ADAPTIVE_NAMES)


def onebit_counterpart(optimizer: Any) -> str:
    """The thinwire optimizer that compresses what ``optimizer`` needs, for advice:
    :class:`thinwire.optim.OneBitLamb` for a layer-wise one (LAMB, LARS: a trust ratio
    per layer), :class:`thinwire.optim.OneBitAdam` otherwise."""
    name = type(optimizer).__name__.lower()
    if any(word in name for word in _LAYERWISE_NAMES):
        return "thinwire.optim.OneBitLamb"
    return "thinwire.optim.OneBitAdam"


def _communicates_itself(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of thinwire's own (a ``CommOptimizer``)."""
    return any((c.__module__, c.__name__) == _COMM_OPTIMIZER for c in type(optimizer).__mro__)


def _warn_adaptive(optimizer: Any) -> None:
    """One line on rank 0 (every rank has the same optimizer: once is enough)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    _log.warning(
        "thinwire: %s behind the 1-bit comm hook: its second moment will be built from "
        "1-bit gradients, which carry each block's magnitude, not each element's (it "
        "lost up to 12%% accuracy on the model zoo); use %s instead, which freezes the "
        "second moment and compresses the momentum (register it with "
        "opt.register_ddp(ddp_model), no comm hook)",
        type(optimizer).__name__,
        onebit_counterpart(optimizer),
    )


class _CastState:
    """State of the fp32/fp16/bf16 hooks: the group and the wire dtype."""

    __slots__ = ("process_group", "wire_dtype")

    def __init__(self, process_group: Any, wire_dtype: torch.dtype) -> None:
        self.process_group = process_group
        self.wire_dtype = wire_dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"wire_dtype": str(self.wire_dtype).removeprefix("torch.")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.wire_dtype = getattr(torch, state["wire_dtype"])


def _cast_hook(
    state: _CastState, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    wire = cast_name(state.wire_dtype)
    name = "ddp.allreduce" if wire == "fp32" else f"ddp.{wire}"
    return average_bucket(bucket.buffer(), state.process_group, state.wire_dtype, name)


def register_comm_hook(
    ddp_model: DistributedDataParallel,
    method: str = "onebit",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: Any = None,
    wrap: Any = None,
    **options: Any,
) -> Any:
    """Install one of thinwire's DDP comm hooks on ``ddp_model``; return its state.

    Call it once, before the first backward pass (DDP's own rule for comm hooks).

    Args:
        ddp_model: the model wrapped in ``DistributedDataParallel``.
        method: ``fp32`` (DDP's average, with its bytes counted), ``fp16``, ``bf16`` or
            ``onebit`` (see the module docstring).
        optimizer: the optimizer that steps this model, if you want the pairing
            checked: an adaptive one behind ``onebit`` logs one warning (rank 0) that
            points to :class:`thinwire.optim.OneBitAdam` (or ``OneBitLamb`` for a
            LAMB-style one); one of thinwire's own optimizers is refused with a
            ``TypeError`` on every rank, before anything is sent: they communicate
            themselves, call ``opt.register_ddp(ddp_model)`` instead.
        process_group: the ranks to average over (default: DDP's group). The 1-bit
            hook runs its collectives on a group of its own over these ranks, made here
            (collectively: call this on every rank, in the same order), so DDP's own
            collectives never meet them.
        wrap: a function that wraps the hook before it is registered, as
            :meth:`thinwire.comm.step_record.StepRecorder.wrap_hook` does to time it.
        options: for ``onebit``, :class:`~thinwire.comm.onebit_hook.OneBitHookState`'s
            arguments (``warmup_steps``, ``block``, ``overlap``, ...).

    Returns:
        The hook's state: for ``onebit`` a ``OneBitHookState`` (its ``state_dict()``
        belongs in your checkpoint: it holds the error-feedback residuals; ``close()``
        it on every rank when done, to stop its thread and destroy its group).
    """
    if method not in HOOK_METHODS:
        raise ValueError(f"unknown comm hook method {method!r}; choose one of {HOOK_METHODS}")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"register_comm_hook needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}: wrap it first"
        )
    if optimizer is not None and _communicates_itself(optimizer):
        # Every rank has the same optimizer class, so every rank raises here, before any
        # collective: no rank is left waiting in one.
        name = type(optimizer).__name__
        raise TypeError(
            f"thinwire: {name} does its own communication and takes no comm hook: "
            f"call opt.register_ddp(ddp_model) instead of register_comm_hook"
        )
    if process_group is None:
        process_group = ddp_model.process_group
    if method != "onebit":
        if options:
            raise TypeError(f"the {method} hook takes no options, got {sorted(options)}")
        state = _CastState(process_group, WIRE_DTYPES[method])
        ddp_model.register_comm_hook(state, wrap(_cast_hook) if wrap else _cast_hook)
        return state
    if optimizer is not None and adaptive_optimizer(optimizer):
        _warn_adaptive(optimizer)
    state = OneBitHookState(process_group=process_group, **options)
    try:
        ddp_model.register_comm_hook(state, wrap(onebit_hook) if wrap else onebit_hook)
    except Exception:
        state.close()  # e.g. a second hook, refused alike on every rank: free its group
        raise
    return state
