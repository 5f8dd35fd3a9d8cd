"""The compressed exchange of the 1-bit optimizers' momentum: 1-bit, or a quantizer.

After the freeze, 1-bit Adam and 1-bit LAMB average their momentum across the ranks
every step through one error-compensated collective. ``exchange="onebit"`` (the
default, the papers') is :class:`~thinwire.comm.OneBitAllreduce`: ~1 bit per element,
about 28x fewer bytes than fp32. ``exchange="int8"``, ``"fp8"``, ``"int4"`` or
``"bf16"`` is :class:`~thinwire.comm.quantized_allreduce.QuantizedAllreduce` with error
feedback on both phases: 3.9x (int8, fp8), 7.8x (int4) or 2.0x (bf16) fewer bytes, and
a far finer code.

Tuning guide: keep ``onebit`` where it trains (the zoo and the long tier say where).
Take ``int8`` when the bytes matter less than the noise, e.g. across the islands of a
sharded job with a fast-enough uplink, or on a model where 1-bit loses quality
(``thinwire bench zoo`` shows it per model); ``int4`` sits between the two, and
``bf16`` is as close to exact momenta as the exchange gets, at twice int8's bytes. The frozen
variance, the floor and the step bound work alike with every code.

:func:`make_exchange` returns an object with the 1-bit collective's call: ``x(flat,
out=flat, side=value)`` averages ``flat`` in place, ``side_mean`` is the ranks' average
of ``value``, ``last_call_s`` / ``last_wait_s`` time the call, and ``state_dict`` holds
the error feedback (tagged with its code, so a state of another code is refused).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.quantized_allreduce import QuantizedAllreduce
from thinwire.compress.quantize import QUANT_KINDS

__all__ = ["EXCHANGES", "QuantizedExchange", "check_exchange", "make_exchange"]

EXCHANGES = ("onebit", *QUANT_KINDS, "bf16")
"""The codes the 1-bit optimizers' compressed stage can exchange its momentum in."""


def check_exchange(kind: str) -> None:
    """A ValueError naming the choices for an ``exchange`` that is none of them."""
    if kind not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {kind!r}")


class QuantizedExchange:
    """:class:`QuantizedAllreduce` behind the 1-bit collective's call (see the module)."""

    tuned = True
    """Nothing to tune: the two phases have one layout."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None = None) -> None:
        self.kind = kind
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self._reduce = QuantizedAllreduce(kind, group, op_name=f"momentum.{kind}")
        self.side_mean = 0.0
        self.last_call_s = 0.0
        self.last_wait_s = 0.0
        """Not split out of the call: the quantized phases are blocking collectives."""

    def __call__(
        self, tensor: torch.Tensor, out: torch.Tensor | None = None, side: float = 0.0
    ) -> torch.Tensor:
        """The average of ``tensor`` over the group (into ``out`` if given); ``side``'s
        average is left in :attr:`side_mean`. A NaN or Inf on any rank raises
        :class:`~thinwire.comm.onebit_exchange.NonFiniteError` on every rank, with the
        error feedback untouched."""
        started = time.perf_counter()
        mean = self._reduce(tensor, side=float(side))  # side rides in the call's check
        self.side_mean = self._reduce.side_sum / self.world_size
        target = tensor if out is None else out
        target.copy_(mean.view_as(target))
        self.last_call_s = time.perf_counter() - started
        return target

    def reset(self) -> None:
        """Drop the error feedback; the next call starts from zero error."""
        self._reduce.load_state_dict({"worker_error": None, "server_error": None})

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._reduce.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"the saved momentum exchange is {state.get('kind') or 'onebit'}, this "
                f"optimizer exchanges {self.kind}: resume with the exchange it was saved with"
            )
        self._reduce.load_state_dict(state)


def make_exchange(kind: str, group: dist.ProcessGroup | None, block: int | None) -> Any:
    """The collective of ``kind`` (see :data:`EXCHANGES`); ``block`` is the 1-bit code's."""
    check_exchange(kind)
    if kind == "onebit":
        from thinwire.comm.onebit_allreduce import OneBitAllreduce

        return OneBitAllreduce(group, block=block)
    return QuantizedExchange(kind, group)
