"""How bytes are exchanged: process groups, collectives, DDP comm hooks, byte accounting."""

from thinwire.comm.accounting import COUNTER, ByteCounter, record
from thinwire.comm.allreduce import all_reduce_mean_, allreduce_hook
from thinwire.comm.launch import DistributedError, init_from_env, spawn

__all__ = [
    "COUNTER",
    "ByteCounter",
    "DistributedError",
    "all_reduce_mean_",
    "allreduce_hook",
    "init_from_env",
    "record",
    "spawn",
]

# The 1-bit compressed allreduce, its DDP hook, and the allreduce benchmark.
from thinwire.comm.onebit_allreduce import (
    LengthMismatchError,
    NonFiniteError,
    OneBitAllreduce,
    onebit_wire_bytes,
)
from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook
from thinwire.comm.quantized_allreduce import QuantizedAllreduce, quantized_wire_bytes
from thinwire.comm.register import HOOK_METHODS, register_comm_hook
from thinwire.comm.resumable_ddp import ResumableDDP

__all__ += [
    "HOOK_METHODS",
    "LengthMismatchError",
    "NonFiniteError",
    "OneBitAllreduce",
    "OneBitHookState",
    "QuantizedAllreduce",
    "ResumableDDP",
    "onebit_hook",
    "onebit_wire_bytes",
    "quantized_wire_bytes",
    "register_comm_hook",
]
