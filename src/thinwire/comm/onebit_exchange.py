"""What the 1-bit allreduce puts on the wire, and the three exchanges that carry it.

Per call each rank takes part in three collectives (see
:mod:`thinwire.comm.onebit_allreduce` for the algorithm):

1. a small gather of its metadata (``META`` below: scale, lengths, piece plan), sent to
   every peer at once (one ``all_to_all_single`` of W copies: one step);
2. phase 1, ``all_to_all_single`` of its packed sign bits, segment ``r`` to rank ``r``
   (with block scales, each segment's scales ride ahead of its bits);
3. phase 2, ``all_gather`` of its server message: the fp32 server scale as 4 bytes
   (with block scales, one per block of the segment), then its packed segment. gloo's
   all_gather walks a ring of W - 1 steps, one after the other; ``phase2="fanout"``
   sends the message to every peer at once instead, as the metadata goes (the same
   bytes, one step).

Once the ranks have agreed on the length in a call that succeeded and the call's piece
count is known before its metadata (fixed, tuned, or a trial planned a call ahead), a
call starts phase 1 right behind the metadata instead of waiting for it: on a link with
latency the metadata's round trip then overlaps the bits', and a call waits for two
round trips instead of three. The order of the collectives is the same either way, so
a rank that waits (after its own ``reset()`` or ``load_state_dict()``) still meets the
others' phase 1.

:func:`check_metas` reads the gathered metadata and fails the same way on every rank,
before the bits are used, when the ranks disagree or some input is not finite; where
some rank had already sent phase 1, the others first send theirs (zeros, sized as the
early ranks' by :func:`match_early_phase1`), so no collective of the call is left in
flight. :class:`LoopbackExchange` stands in for the network when only the compute is
timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from thinwire.comm.accounting import gather_bytes, record
from thinwire.comm.onebit_pieces import piece_cuts, piece_views
from thinwire.compress.onebit import DEFAULT_BLOCK

__all__ = [
    "META_BYTES",
    "PHASE2_SCHEMES",
    "SCALE_BYTES",
    "GroupExchange",
    "LengthMismatchError",
    "LoopbackExchange",
    "NonFiniteError",
    "check_metas",
    "match_early_phase1",
    "onebit_padded_numel",
    "onebit_scale_bytes",
    "onebit_wire_bytes",
]

META_BYTES = 72
"""Per rank, before phase 1, as fp64: scale (with blocks: the sum of the block scales),
length, length the state was built for, seconds the previous call took, fixed piece
count (0: tuned), tuner's call count (-1: none), elements per scale (0: one scale), the
caller's side number (averaged over the ranks and handed back; the 1-bit optimizers
send how large their local gradients are, see :mod:`thinwire.optim.stale`), and the
pieces of phase 1 this rank sent without waiting for the metadata (0: it waited)."""
SCALE_BYTES = 4
"""Per rank, phase 2: one fp32 scale, ahead of the packed segment."""
PHASE2_SCHEMES = ("ring", "fanout")
"""How phase 2 travels: gloo's ring ``all_gather`` (W - 1 steps in sequence) or a
fan-out (one ``all_to_all`` carrying W copies, every peer at once)."""


class NonFiniteError(FloatingPointError):
    """Some rank's input held NaN or Inf; raised on every rank, error buffers unchanged."""


class LengthMismatchError(ValueError):
    """The ranks called the collective with buffers of different lengths."""


def onebit_padded_numel(numel: int, world_size: int, block: int | None = DEFAULT_BLOCK) -> int:
    """``numel`` rounded up to a multiple of ``8 * world_size`` (whole bytes per segment),
    or of ``block * world_size`` with block scales (whole blocks per segment)."""
    unit = (8 if block is None else block) * world_size
    return (numel + unit - 1) // unit * unit


def onebit_scale_bytes(numel: int, world_size: int, block: int | None = DEFAULT_BLOCK) -> int:
    """Bytes of scales ahead of one segment's bits in each phase's message: none in phase
    1 and :data:`SCALE_BYTES` in phase 2 with one scale, ``4 * segment / block`` in both
    with block scales."""
    if block is None:
        return 0
    return SCALE_BYTES * onebit_padded_numel(numel, world_size, block) // (world_size * block)


def onebit_wire_bytes(numel: int, world_size: int, block: int | None = DEFAULT_BLOCK) -> int:
    """Analytical bytes one rank sends per call for ``numel`` elements.

    ``2 (W-1)/W * N/8`` for the sign bits of both phases (``N`` padded) plus the scale
    exchanges: ``(W-1) * (M + 4)`` with one scale, ``(W-1) * M + 2 (W-1)/W * 4 N/B``
    with a scale per block of ``B`` (``M`` = :data:`META_BYTES`); 0 for a single rank.
    """
    if world_size <= 1:
        return 0
    padded = onebit_padded_numel(numel, world_size, block)
    meta = (world_size - 1) * META_BYTES
    if block is None:
        nbytes = padded // 8
        return 2 * gather_bytes(nbytes, world_size) + meta + (world_size - 1) * SCALE_BYTES
    nbytes = padded // 8 + SCALE_BYTES * padded // block
    return 2 * gather_bytes(nbytes, world_size) + meta


def _describe(pieces: int, calls: int) -> str:
    """One rank's piece plan, from the metadata, for an error message."""
    if pieces:
        return f"uses {pieces} pieces"
    return f"tunes them (call {calls})" if calls >= 0 else "uses 1 piece (CUDA)"


def check_metas(metas: torch.Tensor, n: int) -> None:
    """Raise, on every rank alike, if the gathered metadata (``[W, 9]``) shows ranks that
    disagree on the length, the buffers' length, the piece plan or the elements per
    scale, or a non-finite scale.
    """
    lengths = [int(v) for v in metas[:, 1].tolist()]
    if len(set(lengths)) > 1:
        listing = ", ".join(f"rank {r} has {k}" for r, k in enumerate(lengths))
        raise LengthMismatchError(f"1-bit allreduce: ranks disagree on the length: {listing}")
    built = [int(v) for v in metas[:, 2].tolist()]
    if any(k != n for k in built):
        r = next(i for i, k in enumerate(built) if k != n)
        raise ValueError(
            f"1-bit allreduce: rank {r} holds error buffers for {built[r]} elements but got {n}; "
            "use one OneBitAllreduce per buffer, or call reset() on every rank"
        )
    plans = [(int(p), int(c)) for p, c in metas[:, 4:6].tolist()]
    if len(set(plans)) > 1:  # the collectives would not match: fail instead of hanging
        listing = ", ".join(f"rank {r} {_describe(*plan)}" for r, plan in enumerate(plans))
        raise ValueError(
            f"1-bit allreduce: ranks disagree on the piece count: {listing}; give every "
            "rank the same pieces= and device, and reset() or load_state_dict() on all of them"
        )
    blocks = [int(v) for v in metas[:, 6].tolist()]
    if len(set(blocks)) > 1:
        listing = ", ".join(
            f"rank {r} {'one scale' if k == 0 else f'block={k}'}" for r, k in enumerate(blocks)
        )
        raise ValueError(
            f"1-bit allreduce: ranks disagree on the elements per scale: {listing}; give "
            "every rank the same block="
        )
    scales = metas[:, 0].tolist()
    bad = [r for r, v in enumerate(scales) if not math.isfinite(v)]
    if bad:
        raise NonFiniteError(
            f"1-bit allreduce: non-finite input (NaN/Inf) on rank(s) {bad}; "
            "error buffers left unchanged"
        )


def match_early_phase1(exchange: GroupExchange, metas: torch.Tensor, device: torch.device) -> None:
    """Send and receive, as zeros, the phase 1 that the ranks which did not wait for the
    metadata started (``metas[:, 8] > 0``), and wait for it: a call that raises after
    the metadata leaves none of its collectives in flight. Every rank that waited calls
    this; the early ones wait for their own phase 1 instead. Nothing if none was early.

    The early ranks agreed on their length in the same successful call, so their first
    one's row gives the layout all of them used."""
    early = (metas[:, 8] > 0).nonzero()
    if early.numel() == 0:
        return
    row = metas[int(early[0, 0])]
    numel, block, pieces = int(row[2]), int(row[6]) or None, int(row[8])
    w = metas.shape[0]
    seg8 = onebit_padded_numel(numel, w, block) // w // 8
    sb = onebit_scale_bytes(numel, w, block)
    cuts = piece_cuts(seg8, pieces, 1 if block is None else block // 8)
    msg_cuts = [0] + [sb + c for c in cuts[1:]]
    zeros = torch.zeros(w * (sb + seg8), dtype=torch.uint8, device=device)
    recv = torch.empty_like(zeros)
    views = piece_views(zeros, msg_cuts, w), piece_views(recv, msg_cuts, w)
    sends, recvs = ([v.reshape(-1) for v in side] for side in views)
    for wait in exchange.start_all_to_all(recvs, sends):
        wait()


# torch >= 2.11 renamed all_gather_into_tensor; both gather into one flat tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupExchange:
    """The three exchanges of the collective over a process group (recording bytes).

    :attr:`waited_s` adds up the seconds this rank spent blocked in the waits: the part
    of a call that is the network's (and the other ranks'), not this rank's compute.
    """

    waited_s: float = 0.0

    def __init__(self, group: dist.ProcessGroup | None, phase2: str = "ring") -> None:
        if phase2 not in PHASE2_SCHEMES:
            raise ValueError(f"1-bit allreduce: phase2 must be ring or fanout, got {phase2!r}")
        self.group = group
        self.phase2 = phase2

    def _timed(self, wait: Callable[[], object]) -> Callable[[], None]:
        def timed() -> None:
            t0 = time.perf_counter()
            wait()
            self.waited_s += time.perf_counter() - t0

        return timed

    # Looked up at call time, so an instance made before init_process_group still works.
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def start_meta(self, meta: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start gathering every rank's (scale, length, built-for length); returns a wait.

        Always a fan-out (one ``all_to_all_single`` of W copies, the ring's bytes): one
        round trip instead of the ring's W - 1, for a message far too small for the
        ring's bandwidth to matter; and it does not depend on anything a rank could
        have dropped alone (``reset``), so every rank's metadata always meets."""
        w = self.world_size
        out = meta.new_empty(w * meta.numel())
        work = dist.all_to_all_single(out, meta.repeat(w), group=self.group, async_op=True)
        record("onebit.meta", META_BYTES, (w - 1) * META_BYTES)

        done = self._timed(work.wait)

        def wait() -> torch.Tensor:
            done()
            return out.view(w, -1)

        return wait

    def start_all_to_all(
        self, recvs: list[torch.Tensor], sends: list[torch.Tensor]
    ) -> list[Callable[[], None]]:
        """Start phase 1, one all_to_all per piece, all at once; returns one wait per piece
        (compute may run while the bits travel)."""
        works = [
            dist.all_to_all_single(recv, send, group=self.group, async_op=True)
            for recv, send in zip(recvs, sends, strict=True)
        ]
        total = sum(send.numel() for send in sends)
        record("onebit.phase1", total, gather_bytes(total, self.world_size))
        return [self._timed(work.wait) for work in works]

    def start_all_gather(
        self, outs: list[torch.Tensor], msgs: list[torch.Tensor]
    ) -> list[Callable[[], None]]:
        """Start phase 2, one all_gather per piece of every rank's message (its fp32 scale
        as 4 bytes, then its packed segment), all at once; returns one wait per piece."""
        if self.phase2 == "fanout":
            w = self.world_size
            works = [
                dist.all_to_all_single(out, msg.repeat(w), group=self.group, async_op=True)
                for out, msg in zip(outs, msgs, strict=True)
            ]
        else:
            works = [
                _all_gather_flat(out, msg, group=self.group, async_op=True)
                for out, msg in zip(outs, msgs, strict=True)
            ]
        total = sum(out.numel() for out in outs)
        record("onebit.phase2", total // self.world_size, gather_bytes(total, self.world_size))
        return [self._timed(work.wait) for work in works]


class LoopbackExchange(GroupExchange):
    """Stand-in exchange for timing the compute alone: every 'rank' sent what we send."""

    def __init__(self, world_size: int) -> None:
        self.group = None
        self.phase2 = "ring"
        self._world_size = world_size

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return 0

    def start_meta(self, meta: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: meta.reshape(1, -1).expand(self.world_size, -1)

    def start_all_to_all(
        self, recvs: list[torch.Tensor], sends: list[torch.Tensor]
    ) -> list[Callable[[], None]]:
        w = self.world_size
        for recv, send in zip(recvs, sends, strict=True):
            chunk = send.numel() // w
            recv.view(w, chunk).copy_(send[:chunk].expand(w, chunk))
        return [lambda: None for _ in sends]

    def start_all_gather(
        self, outs: list[torch.Tensor], msgs: list[torch.Tensor]
    ) -> list[Callable[[], None]]:
        for out, msg in zip(outs, msgs, strict=True):
            out.view(self.world_size, -1).copy_(msg.expand(self.world_size, -1))
        return [lambda: None for _ in msgs]
