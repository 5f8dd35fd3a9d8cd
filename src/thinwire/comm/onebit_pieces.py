"""The piece plan of the 1-bit allreduce: how many collectives each phase travels in.

Each phase may be sent as several collectives, all started at once, so the server
averages a piece as soon as it lands and the output is unpacked the same way while
later pieces are still on the wire. The count is either fixed (``pieces=``) or, on CPU,
tuned by measuring (:class:`~thinwire.comm.piece_tuner.PieceTuner`). Every rank must use
the same cuts, so the plan travels in the call's metadata and is checked there
(:func:`~thinwire.comm.onebit_exchange.check_metas`).
"""

from __future__ import annotations

import itertools

import torch

from thinwire.comm.piece_tuner import PieceTuner

__all__ = ["PiecePlan", "piece_cuts", "piece_views"]


class PiecePlan:
    """The piece count of one collective instance: fixed, or tuned on CPU.

    Args:
        pieces: a fixed count, or None to tune it by measuring on CPU (1 on CUDA, where
            the host clock would not see the asynchronous kernels).
        phase2: ``ring``, ``fanout``, or ``auto`` (measured on CPU after the count;
            the ring on CUDA).
        ahead: tune with each call's count decided a call early
            (:class:`~thinwire.comm.piece_tuner.PieceTuner`), for a collective that
            sends its bits before the metadata is in.
    """

    def __init__(self, pieces: int | None, phase2: str = "auto", ahead: bool = False) -> None:
        if pieces is not None and pieces < 1:
            raise ValueError(f"1-bit allreduce: pieces must be at least 1, got {pieces}")
        if phase2 not in ("ring", "fanout", "auto"):
            raise ValueError(
                f"1-bit allreduce: phase2 must be ring, fanout or auto, got {phase2!r}"
            )
        self.pieces = pieces
        self.phase2 = phase2
        self.ahead = ahead
        self.tuner: PieceTuner | None = None

    def restart(self, seg8: int, device: torch.device) -> None:
        """Start tuning afresh for segments of ``seg8`` bytes (CPU, no fixed count). Every
        rank does this at the same call, so their choices stay in step."""
        cpu = device.type == "cpu"
        auto = self.phase2 == "auto" and cpu
        schemes = ("ring", "fanout") if auto else (self.fixed_scheme,)
        counts = (max(1, min(self.pieces, seg8)),) if self.pieces is not None else None
        tune = cpu and (self.pieces is None or auto)
        self.tuner = (
            PieceTuner(seg8, schemes=schemes, counts=counts, ahead=self.ahead) if tune else None
        )

    @property
    def fixed_scheme(self) -> str:
        """The phase-2 scheme without tuning: the one set, the ring for ``auto``."""
        return "ring" if self.phase2 == "auto" else self.phase2

    @property
    def scheme(self) -> str:
        """The phase-2 scheme of the latest call (see :meth:`cuts`)."""
        return self.tuner.current_scheme if self.tuner is not None else self.fixed_scheme

    def clear(self) -> None:
        """Forget the tuning (the collective dropped its buffers)."""
        self.tuner = None

    def in_use(self, seg8: int) -> int | None:
        """The count calls use now for segments of ``seg8`` bytes (None while tuning)."""
        if self.pieces is not None:
            return max(1, min(self.pieces, seg8))  # as cuts() clamps it
        return self.tuner.choice if self.tuner is not None else 1

    def meta(self) -> tuple[int, int]:
        """(fixed count or 0, tuner's call count or -1): what the ranks compare."""
        return self.pieces or 0, self.tuner.calls if self.tuner is not None else -1

    def cuts(self, seg8: int, previous_seconds: float, align: int = 1) -> list[int]:
        """Byte offsets of this call's pieces inside a segment's bits (same on every rank),
        multiples of ``align`` bytes (a block's bits, so no block straddles two pieces)."""
        k = self.tuner.next(previous_seconds) if self.tuner is not None else self.pieces or 1
        return piece_cuts(seg8, k, align)

    def upcoming_cuts(self, seg8: int, align: int = 1) -> list[int] | None:
        """The next call's cuts when they are known before its metadata arrives (a fixed
        count, a tuned one, or a trial decided ahead), else None. Does not advance the
        tuner: :meth:`cuts` does, once the metadata is in, and returns the same."""
        if self.tuner is None:
            return piece_cuts(seg8, self.pieces or 1, align)
        upcoming = self.tuner.upcoming
        return None if upcoming is None else piece_cuts(seg8, upcoming[0], align)


def piece_cuts(seg8: int, pieces: int, align: int = 1) -> list[int]:
    """Byte offsets of ``pieces`` pieces (at most one per ``align`` bytes) of a segment's
    ``seg8`` bytes of bits, each a multiple of ``align``."""
    units = seg8 // align
    k = max(1, min(pieces, units))
    return [units * j // k * align for j in range(k + 1)]


def piece_views(buf: torch.Tensor, cuts: list[int], world_size: int) -> list[torch.Tensor]:
    """Views of a piece-major buffer: piece j is a contiguous ``[W, cuts[j+1] - cuts[j]]``
    block (one row per rank) starting at ``W * cuts[j]``."""
    w = world_size
    return [buf[w * a : w * b].view(w, b - a) for a, b in itertools.pairwise(cuts)]
