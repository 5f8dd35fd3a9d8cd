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
warmup and sends the momentum at one bit per element (within 2% on all of them). The
pairing is allowed, and says so in one warning line.
"""

# No `from __future__ import annotations`: DDP inspects a comm hook's annotations at
# registration and rejects string annotations.
import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm.allreduce import average_bucket
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook
from thinwire.compress.cast import WIRE_DTYPES, cast_name

__all__ = ["HOOK_METHODS", "adaptive_optimizer", "register_comm_hook"]

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
_log = logging.getLogger("thinwire.comm")


def adaptive_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` scales each element by a running statistic of its own
    gradients (Adam's second moment and its kin): torch's adaptive optimizers, and any
    class whose name says Adam, Adafactor, Adagrad, RMSprop, LAMB or LARS."""
    if isinstance(optimizer, _ADAPTIVE):
        return True
    name = type(optimizer).__name__.lower()
    return any(word in name for word in _ADAPTIVE_NAMES)


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
            checked: an adaptive one behind ``onebit`` logs one warning that points to
            :class:`thinwire.optim.OneBitAdam`.
        process_group: the group to average over (default: DDP's).
        wrap: a function that wraps the hook before it is registered, as
            :meth:`thinwire.comm.step_record.StepRecorder.wrap_hook` does to time it.
        options: for ``onebit``, :class:`~thinwire.comm.onebit_hook.OneBitHookState`'s
            arguments (``warmup_steps``, ``block``, ``overlap``, ...).

    Returns:
        The hook's state: for ``onebit`` a ``OneBitHookState`` (its ``state_dict()``
        belongs in your checkpoint: it holds the error-feedback residuals).
    """
    if method not in HOOK_METHODS:
        raise ValueError(f"unknown comm hook method {method!r}; choose one of {HOOK_METHODS}")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"register_comm_hook needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}: wrap it first"
        )
    if method != "onebit":
        if options:
            raise TypeError(f"the {method} hook takes no options, got {sorted(options)}")
        state = _CastState(process_group, WIRE_DTYPES[method])
        ddp_model.register_comm_hook(state, wrap(_cast_hook) if wrap else _cast_hook)
        return state
    if optimizer is not None and adaptive_optimizer(optimizer):
        _log.warning(
            "thinwire: %s behind the 1-bit comm hook: its second moment will be built from "
            "1-bit gradients, which carry each block's magnitude, not each element's (it "
            "lost up to 12%% accuracy on the model zoo); for Adam-style training use "
            "thinwire.optim.OneBitAdam, which freezes the second moment and compresses the "
            "momentum",
            type(optimizer).__name__,
        )
    state = OneBitHookState(process_group=process_group, **options)
    ddp_model.register_comm_hook(state, wrap(onebit_hook) if wrap else onebit_hook)
    return state
