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
