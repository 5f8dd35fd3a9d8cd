"""Bytes on the wire, per rank, for every collective thinwire issues.

Every collective in thinwire calls :func:`record` with two figures:

* ``payload_bytes``: the bytes of the buffers this rank handed to the collective
  (what the code *believes* it sent, independent of the algorithm);
* ``wire_bytes``: the analytical bytes this rank puts on its link under the algorithm
  the backend uses, e.g. ``2 (W-1)/W * S`` for a ring allreduce of ``S`` bytes, or
  ``(W-1)/W * S`` for an all_to_all / all_gather of ``S`` bytes in total.

The emulated-network testbed reads the NIC counters and compares them with the
``wire_bytes`` figure, so the two can be checked against each other.

The counter is per process (one process is one rank), cheap (a dict update), and
thread-safe enough for DDP's comm-hook thread (the GIL covers the integer updates).
The trainer reads :func:`snapshot` after each step to log bytes per step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = [
    "COUNTER",
    "ByteCounter",
    "OpStats",
    "captured",
    "gather_bytes",
    "record",
    "replay",
    "ring_allreduce_bytes",
]


@dataclass
class OpStats:
    """Totals for one kind of collective (e.g. ``"allreduce"``, ``"onebit.phase1"``)."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0


@dataclass
class ByteCounter:
    """Accumulates bytes per collective kind; one instance per process (:data:`COUNTER`)."""

    ops: dict[str, OpStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, op: str, payload_bytes: int, wire_bytes: int) -> None:
        with self._lock:
            stats = self.ops.get(op)
            if stats is None:
                stats = self.ops[op] = OpStats()
            stats.calls += 1
            stats.payload_bytes += int(payload_bytes)
            stats.wire_bytes += int(wire_bytes)

    @property
    def wire_bytes(self) -> int:
        """Total analytical bytes this rank sent, over all collectives."""
        return sum(s.wire_bytes for s in self.ops.values())

    @property
    def payload_bytes(self) -> int:
        """Total bytes handed to collectives by this rank."""
        return sum(s.payload_bytes for s in self.ops.values())

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.ops.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A JSON-ready copy: ``{op: {"calls", "payload_bytes", "wire_bytes"}}``."""
        with self._lock:
            return {k: dict(vars(v)) for k, v in sorted(self.ops.items())}

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()

    def load_snapshot(self, snapshot: dict[str, dict[str, int]]) -> None:
        """Replace the totals with a :meth:`snapshot` (a resumed run continues its counts)."""
        with self._lock:
            self.ops = {k: OpStats(**v) for k, v in snapshot.items()}

    def wire_bytes_excluding(self, prefix: str) -> int:
        """Wire bytes of every op whose name does not start with ``prefix``."""
        with self._lock:
            return sum(s.wire_bytes for k, s in self.ops.items() if not k.startswith(prefix))


COUNTER = ByteCounter()
"""The process-wide counter that every thinwire collective reports to."""


_CAPTURE = threading.local()


def record(op: str, payload_bytes: int, wire_bytes: int) -> None:
    """Report one collective call to the process-wide :data:`COUNTER` (or, inside
    :func:`captured` on this thread, to the capture's list)."""
    sink = getattr(_CAPTURE, "sink", None)
    if sink is not None:
        sink.append((op, int(payload_bytes), int(wire_bytes)))
        return
    COUNTER.record(op, payload_bytes, wire_bytes)


@contextmanager
def captured() -> Iterator[list[tuple[str, int, int]]]:
    """Collect this thread's :func:`record` calls in a list instead of counting them.

    For collectives that run in a background thread (Streaming DiLoCo's overlapped
    exchange): the thread captures its records and the training loop replays them with
    :func:`replay` when it uses the result, so the bytes of a step do not depend on how
    far the thread had got when the step's metrics were read.
    """
    previous = getattr(_CAPTURE, "sink", None)
    _CAPTURE.sink = sink = []
    try:
        yield sink
    finally:
        _CAPTURE.sink = previous


def replay(records: list[tuple[str, int, int]]) -> None:
    """Count records that :func:`captured` collected."""
    for op, payload_bytes, wire_bytes in records:
        record(op, payload_bytes, wire_bytes)


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2 (W-1)/W * nbytes``."""
    if world_size <= 1:
        return 0
    return (2 * (world_size - 1) * nbytes) // world_size


def gather_bytes(total_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all_to_all or all_gather whose result is ``total_nbytes``.

    Each rank keeps its own ``1/W`` share and sends the rest: ``(W-1)/W * total``.
    """
    if world_size <= 1:
        return 0
    return ((world_size - 1) * total_nbytes) // world_size
