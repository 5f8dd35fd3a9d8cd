"""What the Local-SGD server and its workers say to each other: every message, by name.

Each message is a frozen dataclass whose fields are named here and nowhere else; the
transport (:mod:`thinwire.localsgd.runtime.transport`) only moves the encoded numbers.

===========  ===========  ===============================================  ===============
kind         direction    fields                                           payload after it
===========  ===========  ===============================================  ===============
``HELLO``    worker->srv  :class:`Hello` numel, checksum, late, force      none
``UPDATE``   worker->srv  :class:`Update` epoch, steps, seconds_per_step,  pseudo-gradient,
                          loss, dtype, version                             ``dtype``
``WORK``     srv->worker  :class:`Work` epoch, version, shard, steps,      theta, ``dtype``
                          lr_clock, planned, dtype
``DELTA``    srv->worker  :class:`Work` with ``delta=True``, same fields   theta minus the
                                                                           worker's copy,
                                                                           ``dtype``
``STOP``     srv->worker  :class:`Work` with ``stop=True``: epoch, version none
``ERROR``    srv->worker  :class:`Refused` numel, checksum, reason,        none
                          detail
===========  ===========  ===============================================  ===============

**Header**: ``HEADER_LEN`` (8) float64 numbers: the kind, the fields in the order above,
then zeros. A server-to-worker header is that float64 tensor on the worker's link (64
bytes). A worker-to-server header goes through the store queue, packed with the
sender's rank and incarnation in front (:func:`pack_queued`, ``<qq8d``, 80 bytes).
float64 holds every field exactly: counts and versions stay far below 2**53, the shape
checksum is a crc32.

**Payload**: a flat tensor on the link right after its header. The receiver knows its
length from the model's parameter count (agreed in the hello) and the header's
``dtype`` (:func:`payload_numel`). ``dtype`` uint8 means 1-bit: the packed sign bits
followed by the 4 bytes of one fp32 scale (:mod:`thinwire.localsgd.algorithm.compression`).

**Seal**: every header is followed by a seal that authenticates it and its payload
(:mod:`thinwire.localsgd.runtime.auth`); the transport adds and checks it.

**Run information**: :class:`RunInfo`, JSON in the run's store, which a restarted worker
reads before it says hello.

Decoding checks everything it can (a known kind, whole numbers where counts belong,
0/1 flags, a known dtype, zero padding) and raises :class:`MessageError` with one line
saying what was wrong, so a malformed or forged header never becomes a half-read message.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import ClassVar

import torch

from thinwire.compress.cast import CAST_DTYPES

__all__ = [
    "DTYPES",
    "HEADER_LEN",
    "Envelope",
    "Hello",
    "Kind",
    "Message",
    "MessageError",
    "Refused",
    "RunInfo",
    "Update",
    "Why",
    "Work",
    "decode",
    "dtype_code",
    "encode",
    "pack_queued",
    "payload_numel",
    "unpack_queued",
]

HEADER_LEN = 8
"""Numbers in every header: the kind and up to 7 fields."""

_QUEUED = f"<qq{HEADER_LEN}d"  # sender rank, sender incarnation, header

DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: CAST_DTYPES["fp16"],
    2: CAST_DTYPES["bf16"],
    3: torch.uint8,
}
"""Payload dtype codes in a header (part of the wire format: a code never changes
meaning); 1 and 2 are the 16-bit casts of :mod:`thinwire.compress.cast`, uint8 is a
1-bit payload (signs, then an fp32 scale)."""


def payload_numel(numel: int, dtype: torch.dtype) -> int:
    """Elements of a payload carrying ``numel`` parameters in ``dtype``."""
    return (numel + 7) // 8 + 4 if dtype == torch.uint8 else numel


class MessageError(ValueError):
    """A header that is not a valid message (unknown kind, bad field, wrong length)."""


class Kind(IntEnum):
    """The first number of every header."""

    HELLO = 1
    UPDATE = 2
    WORK = 3
    STOP = 4
    ERROR = 5
    DELTA = 6


def dtype_code(dtype: torch.dtype) -> int:
    """The header code of a payload dtype (see :data:`DTYPES`)."""
    for code, d in DTYPES.items():
        if d == dtype:
            return code
    raise MessageError(f"unsupported payload dtype {dtype}; supported: {list(DTYPES.values())}")


@dataclass(frozen=True)
class Hello:
    """A worker asks for work: on first contact, and again after a round that failed."""

    numel: int
    """Parameters in the worker's model."""
    checksum: int
    """crc32 of the parameter shapes (:func:`~thinwire.localsgd.task.shape_signature`)."""
    late: bool = False
    """A process joining a running run (a rejoin): a mismatch turns only it away."""
    force: bool = False
    """A rejoin that replaces its rank even if the server considers that worker alive."""

    kind: ClassVar[Kind] = Kind.HELLO


@dataclass(frozen=True)
class Update:
    """A worker's finished round; its pseudo-gradient ``theta - theta_w`` follows."""

    epoch: int
    """The server epoch of the theta the round started from (stale if it changed)."""
    steps: int
    """Inner steps the round ran."""
    seconds_per_step: float
    """Mean wall time of one inner step (DyLU's speed measurement)."""
    loss: float
    """Mean training loss over the round (for logs; NaN is allowed)."""
    dtype: torch.dtype = torch.float32
    """dtype of the pseudo-gradient payload (fp32; fp16/bf16/uint8 when pushes are
    compressed, uint8 meaning 1-bit)."""
    version: int = 0
    """The theta version the round started from (the :class:`Work`'s): the server's
    version now minus this is the update's staleness."""

    kind: ClassVar[Kind] = Kind.UPDATE


@dataclass(frozen=True)
class Work:
    """The server's order: run ``steps`` inner steps from theta ``version``, or stop.

    A round's theta follows a ``WORK`` header, or with ``delta=True`` (a ``DELTA``
    header) the difference between theta and the worker's copy of it (compressed
    pulls); ``stop=True`` is sent as ``STOP`` with only ``epoch`` and ``version`` and no
    payload.
    """

    epoch: int
    """Server epoch: a server resumed from a checkpoint starts a new one."""
    version: int
    """Outer updates applied to the theta handed out."""
    shard: int = 0
    """Data shard to train on."""
    steps: int = 0
    """Inner steps of the round (H, or DyLU's H_w)."""
    lr_clock: int = 0
    """Steps the shard had already been trained for: where its inner lr schedule is."""
    planned: int = 1
    """Steps planned for the shard over the whole run (the length of its schedule)."""
    stop: bool = False
    """No more rounds: the budget is spent."""
    dtype: torch.dtype = torch.float32
    """dtype of the payload (theta in fp32; a delta in its codec's dtype)."""
    delta: bool = False
    """The payload is ``theta - the worker's copy``, to add to that copy (sent as ``DELTA``)."""

    @property
    def kind(self) -> Kind:
        if self.stop:
            return Kind.STOP
        return Kind.DELTA if self.delta else Kind.WORK


class Why(IntEnum):
    """Why the server turns a worker away (:attr:`Refused.reason`)."""

    MODEL = 0
    """Its model differs from the server's."""
    ALIVE = 1
    """A rejoin for a rank whose worker the server considers alive (not forced)."""
    EVICTED = 2
    """The server refused too many of its pushes (:attr:`Refused.detail` names the last
    reason)."""


@dataclass(frozen=True)
class Refused:
    """The server turns a worker away (why: :class:`Why`)."""

    numel: int
    """Parameters in the server's model."""
    checksum: int
    """crc32 of the server's parameter shapes."""
    reason: int = Why.MODEL
    """A :class:`Why` code."""
    detail: int = 0
    """For :attr:`Why.EVICTED`: the last refusal's reason, as 1 + its place in
    :data:`thinwire.localsgd.algorithm.push_guard.REASONS` (0: not named)."""

    kind: ClassVar[Kind] = Kind.ERROR


Message = Hello | Update | Work | Refused


@dataclass(frozen=True)
class Envelope:
    """A worker-to-server message as the server reads it from the queue."""

    src: int
    """The sender's worker rank."""
    incarnation: int
    """The sender process's incarnation (1 for the launched one, +1 per restart)."""
    message: Message


def _wire_fields(msg_type: type) -> list[tuple[str, str]]:
    """(name, type) of the fields a header carries for ``msg_type``, in order."""
    out = [(f.name, str(f.type)) for f in fields(msg_type)]
    return [(n, t) for n, t in out if n not in ("stop", "delta")]


_STOP_FIELDS = [("epoch", "int"), ("version", "int")]
_TYPES: dict[Kind, type] = {
    Kind.HELLO: Hello,
    Kind.UPDATE: Update,
    Kind.WORK: Work,
    Kind.STOP: Work,
    Kind.ERROR: Refused,
    Kind.DELTA: Work,
}


def _layout(kind: Kind) -> list[tuple[str, str]]:
    return _STOP_FIELDS if kind == Kind.STOP else _wire_fields(_TYPES[kind])


def encode(msg: Message) -> list[float]:
    """The header of ``msg``: ``HEADER_LEN`` numbers, kind first, zero-padded."""
    if not isinstance(msg, (Hello, Update, Work, Refused)):
        raise MessageError(f"cannot encode {type(msg).__name__}: not a Local-SGD message")
    kind = msg.kind
    values = [float(kind)]
    for name, typ in _layout(kind):
        value = getattr(msg, name)
        values.append(float(dtype_code(value)) if typ == "torch.dtype" else float(value))
    return values + [0.0] * (HEADER_LEN - len(values))


def decode(values: Sequence[float]) -> Message:
    """The message a header holds; :class:`MessageError` if it holds none."""
    if len(values) != HEADER_LEN:
        raise MessageError(f"a header has {HEADER_LEN} numbers, got {len(values)}")
    head = values[0]
    if head not in {float(k) for k in Kind}:
        raise MessageError(f"unknown message kind {head!r}; known: {[int(k) for k in Kind]}")
    kind = Kind(int(head))
    layout = _layout(kind)
    if any(v != 0.0 for v in values[1 + len(layout) :]):
        raise MessageError(f"{kind.name} header has numbers past its {len(layout)} fields")
    kwargs: dict[str, object] = {}
    for (name, typ), v in zip(layout, values[1:], strict=False):
        kwargs[name] = _field(kind, name, typ, float(v))
    if kind == Kind.STOP:
        kwargs["stop"] = True
    if kind == Kind.DELTA:
        kwargs["delta"] = True
    return _TYPES[kind](**kwargs)


def _field(kind: Kind, name: str, typ: str, v: float) -> object:
    where = f"{kind.name} field {name}"
    if typ == "float":
        return v
    if typ == "bool":
        if v not in (0.0, 1.0):
            raise MessageError(f"{where} must be 0 or 1, got {v!r}")
        return v == 1.0
    if not (math.isfinite(v) and v == int(v) and 0 <= v < 2**53):
        raise MessageError(f"{where} must be a whole number >= 0, got {v!r}")
    if typ == "torch.dtype":
        if int(v) not in DTYPES:
            raise MessageError(f"{where}: unknown dtype code {int(v)}; known: {sorted(DTYPES)}")
        return DTYPES[int(v)]
    return int(v)


def pack_queued(rank: int, incarnation: int, msg: Message) -> bytes:
    """A worker-to-server header as it goes into the store queue."""
    return struct.pack(_QUEUED, rank, incarnation, *encode(msg))


def unpack_queued(blob: bytes) -> Envelope:
    """Inverse of :func:`pack_queued`; :class:`MessageError` for a malformed blob."""
    if len(blob) != struct.calcsize(_QUEUED):
        raise MessageError(f"a queued header is {struct.calcsize(_QUEUED)} bytes, got {len(blob)}")
    src, incarnation, *values = struct.unpack(_QUEUED, blob)
    if src < 0 or incarnation < 0:
        raise MessageError(f"bad sender rank {src} / incarnation {incarnation}")
    return Envelope(int(src), int(incarnation), decode(values))


@dataclass(frozen=True)
class RunInfo:
    """What the server publishes for processes that join a running run."""

    workers: int
    """W, the worker ranks of the run (1..W)."""
    numel: int
    """Parameters in the server's model."""
    checksum: int
    """crc32 of the server's parameter shapes."""
    shards: int
    """Data shards the run cuts its data into."""
    finished: bool = False
    """The run is over; late joiners are turned away (a key of its own in the store)."""

    def to_json(self) -> str:
        """The published form (``finished`` is not part of it)."""
        info = {"workers": self.workers, "numel": self.numel, "checksum": self.checksum}
        return json.dumps(info | {"shards": self.shards})

    @classmethod
    def from_json(cls, text: str | bytes, finished: bool = False) -> RunInfo:
        """Parse :meth:`to_json`'s output; :class:`MessageError` if it is not that."""
        try:
            d = json.loads(text)
            workers, numel, checksum = int(d["workers"]), int(d["numel"]), int(d["checksum"])
            shards = int(d["shards"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            # OverflowError: an infinite number; RecursionError: nesting deeper than the
            # parser goes. Either way not what a server publishes.
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise MessageError(f"the run's published settings are unreadable ({reason})") from None
        if workers < 1 or numel < 0 or shards < 1:
            raise MessageError(
                f"the run's published settings are impossible: {workers} workers, "
                f"{numel} parameters, {shards} shards"
            )
        return cls(workers, numel, checksum, shards, bool(finished))
