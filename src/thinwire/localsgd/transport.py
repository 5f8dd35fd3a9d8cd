"""Messages between the Local-SGD server and its workers, on torch.distributed.

A message is a header of up to 8 numbers, optionally followed by one flat tensor whose
size and dtype the header announces.

* **Server to worker**: header and payload by ``dist.send`` (tags 1 and 2); the worker
  blocks in ``dist.recv(src=server)``, which is what a worker has to do anyway.
* **Worker to server**: the header goes into a queue on the process group's key-value
  store (``queue_push``), the payload by ``dist.send`` (tag 2). The server must listen
  to every worker at once *without blocking* (it also has grace periods to close and
  silent workers to declare dead). gloo's ``irecv(src=None)`` cannot be polled (its
  ``is_completed`` stays false until ``wait``) and a ``wait`` that times out breaks the
  connection, so the server polls the store queue (``queue_len``) and then receives the
  announced payload from that one worker with an ordinary ``dist.recv``.

Every message is reported to :mod:`thinwire.comm.accounting`: headers as
``localsgd.ctrl``, parameter vectors as ``localsgd.pull`` (server to worker) and
pseudo-gradients as ``localsgd.push``. Point-to-point traffic crosses the link once, so
payload and wire bytes are equal. The transport always runs on a gloo group: NCCL has
no CPU-side polling, and the traffic (one parameter vector per round of H steps) is small.

Dead peers: a worker that exits closes its sockets; the store queue and receives from
the others keep working, and a send to the dead worker raises, which the server takes as
a death notice. Workers also bump a heartbeat counter in the store from a background
thread (:meth:`Transport.beat`), so the server tells a dead worker from a slow one
without a timeout tied to the round length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record

__all__ = [
    "DTYPES",
    "ERROR",
    "HELLO",
    "STOP",
    "UPDATE",
    "WORK",
    "Message",
    "Transport",
    "dtype_code",
]

HELLO, UPDATE, WORK, STOP, ERROR = 1, 2, 3, 4, 5
_KIND_NAMES = {HELLO: "hello", UPDATE: "push", WORK: "pull", STOP: "stop", ERROR: "error"}
HEADER_LEN = 8
_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_QUEUE = "to_server"

DTYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}


def dtype_code(dtype: torch.dtype) -> int:
    for code, d in DTYPES.items():
        if d == dtype:
            return code
    raise ValueError(f"unsupported payload dtype {dtype}")


@dataclass
class Message:
    """A received header: who sent it, its kind, and the remaining numbers."""

    src: int
    kind: int
    fields: list[float]


class Transport:
    """Header+payload messages between a server rank and worker ranks.

    Args:
        group: a gloo process group holding the server and all workers (None: default).
        store: the key-value store for worker-to-server headers (None: the default
            group's store, which every launcher, torchrun included, provides).
        server: the server's rank.
        op_prefix: accounting name prefix.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        server: int = 0,
        op_prefix: str = "localsgd",
    ) -> None:
        self.group = group
        self.server = server
        self.op_prefix = op_prefix
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore("thinwire.localsgd/", base)
        self.rank = dist.get_rank(group)
        self.bytes_received = 0

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(
        self, dst: int, kind: int, fields: list[float], payload: torch.Tensor | None = None
    ) -> None:
        """Send a header (and ``payload``, flat) to ``dst``; raises if ``dst`` is gone."""
        if len(fields) > HEADER_LEN - 1:
            raise ValueError(f"at most {HEADER_LEN - 1} header fields, got {len(fields)}")
        values = [float(kind), *map(float, fields)] + [0.0] * (HEADER_LEN - 1 - len(fields))
        if dst == self.server:
            blob = struct.pack(f"<q{HEADER_LEN}d", self.rank, *values)
            self.store.queue_push(_QUEUE, blob)
            record(f"{self.op_prefix}.ctrl", len(blob), len(blob))
        else:
            header = torch.tensor(values, dtype=torch.float64)
            dist.send(header, self._global(dst), group=self.group, tag=_HEADER_TAG)
            record(f"{self.op_prefix}.ctrl", header.nbytes, header.nbytes)
        if payload is not None:
            payload = payload.detach().reshape(-1).cpu().contiguous()
            dist.send(payload, self._global(dst), group=self.group, tag=_PAYLOAD_TAG)
            nbytes = payload.numel() * payload.element_size()
            record(f"{self.op_prefix}.{_KIND_NAMES[kind]}", nbytes, nbytes)

    def poll(self) -> Message | None:
        """On the server: the next worker header if one has arrived, else None (no wait)."""
        if self.store.queue_len(_QUEUE) == 0:
            return None
        blob = self.store.queue_pop(_QUEUE, False)
        src, kind, *fields = struct.unpack(f"<q{HEADER_LEN}d", blob)
        self.bytes_received += len(blob)
        return Message(int(src), int(kind), list(fields))

    def beat(self) -> None:
        """Worker liveness signal: bump this rank's heartbeat counter in the store."""
        self.store.add(f"heartbeat/{self.rank}", 1)

    def heartbeat(self, rank: int) -> int:
        """The server's view of ``rank``'s heartbeat counter (0 before its first beat)."""
        return int(self.store.add(f"heartbeat/{rank}", 0))

    def recv(self, src: int) -> Message:
        """On a worker: the next header from the server (blocking)."""
        buf = torch.zeros(HEADER_LEN, dtype=torch.float64)
        dist.recv(buf, self._global(src), group=self.group, tag=_HEADER_TAG)
        self.bytes_received += buf.nbytes
        return Message(src, int(buf[0]), buf[1:].tolist())

    def recv_payload(self, src: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The payload that follows ``src``'s last header."""
        buf = torch.empty(numel, dtype=dtype)
        dist.recv(buf, self._global(src), group=self.group, tag=_PAYLOAD_TAG)
        self.bytes_received += buf.numel() * buf.element_size()
        return buf
