"""Error-compensated 1-bit compressed allreduce (two phases), on any torch.distributed backend.

The collective behind 1-bit Adam and 1-bit LAMB (arXiv 2102.02888, 2104.06069; the
algorithm is written out in ``spec/onebit.md`` section 2). Each rank sends about
``2 (W-1)/W * (N/8 + 4N/B)`` bytes instead of the ``2 (W-1)/W * 4N`` of an fp32 ring
allreduce: 28x less with a scale per block of ``B = 256`` elements (the default), 32x
with the papers' one scale (``block=None``). Every rank gets the same output.

Per call, with ``x`` the rank's input (flat, fp32, padded with zeros to a multiple of
``8W``; ``n`` real elements):

1. worker: ``x += worker_error``; ``s = ||x[:n]|| / sqrt(n)`` (with blocks, one such RMS
   per block of ``x``); sign bits ``x >= 0``
   packed 8 per byte; ``worker_error = x - s * sign``.
2. phase 1: one small ``all_gather`` of ``(s, n)`` from every rank, and
   ``all_to_all_single`` of the packed bits: rank ``r`` receives every rank's bits for
   segment ``r`` (``N/W`` elements), in one or more pieces. The bits wait for the
   metadata's check on a first call; once the ranks agreed on the length and the piece
   plan is final they leave right behind it (one round trip fewer; the check still
   comes before the bits are used).
3. server (rank ``r`` for segment ``r``): ``y = (sum_i s_i * sign_i) / W`` (summed in
   rank order) ``+ server_error``; ``s2 = ||y|| / sqrt(len)``; ``server_error = y -
   s2 * sign(y)``; its sign bits are packed.
4. phase 2: ``all_gather`` of every rank's message, its ``s2`` as 4 bytes followed by
   its packed segment, in the same pieces; every rank unpacks ``s2_r * sign`` into
   segment ``r`` of the output.

Choices this implementation makes (each tested; the reasons in docs/compression.md):
padding is inert (scales are RMS over real elements, padded positions carry no error);
non-finite input raises :class:`NonFiniteError` on every rank before anything changes
(the scales travel first), and ranks that disagree on the length raise
:class:`LengthMismatchError` before the all_to_all could hang; buffers are allocated once
per length and the error updates are in place; both phases start asynchronously and the
error updates run while the bits travel; each phase may travel in pieces, tuned on CPU
(:mod:`thinwire.comm.piece_tuner`), and phase 2 as a ring or a fan-out
(:mod:`thinwire.comm.onebit_exchange`); the result is bit-identical either way.

State (per rank): ``worker_error`` (n) and ``server_error`` (this rank's segment), saved
and restored by :meth:`~OneBitAllreduce.state_dict` / ``load_state_dict`` on every rank
(bit-identical continuation). Tests hold output and both errors bit-identical, call after
call, to ``ErrorFeedback(OneBitCompressor())`` per rank and per segment on one process.

Tuning: one instance per buffer. Fuse everything that is exchanged in a step into one
flat buffer and call once: every call costs at least 2 collective latencies in sequence
(the all_to_all with the metadata gather beside it, then the final gather; 3 on the first
call and on the two tuning calls that choose the count and the scheme, when the metadata
goes first: the tuner plans its trials a call ahead, so they run as tuned calls will),
which dominate below ~1 MiB on a WAN: a 64 KiB call between 4 hosts 50 ms apart took
0.21 s, 0.31 s with the metadata ahead of the bits (``overlap_meta=False``); 4 MiB 0.28
s against 0.38-0.40 s. (The final gather carries the scales inside the bits message: a
separate scale gather running beside it made phase 2 2-7% slower on 4 emulated hosts.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.onebit_exchange import (
    SCALE_BYTES,
    GroupExchange,
    LengthMismatchError,
    LoopbackExchange,
    NonFiniteError,
    check_metas,
    match_early_phase1,
    onebit_padded_numel,
    onebit_scale_bytes,
    onebit_wire_bytes,
)
from thinwire.comm.onebit_math import average_signs_, unpack_rows_
from thinwire.comm.onebit_pieces import PiecePlan, piece_views
from thinwire.comm.piece_tuner import PieceTuner
from thinwire.compress.cast import WIRE_DTYPES
from thinwire.compress.onebit import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    block_scales,
    check_block,
    rms_scale,
    subtract_signs_,
)
from thinwire.compress.packing import pack_signs
from thinwire.compress.scratch import PackerScratch

__all__ = [
    "GPU_CHUNK",
    "LengthMismatchError",
    "NonFiniteError",
    "OneBitAllreduce",
    "onebit_padded_numel",
    "onebit_wire_bytes",
]

GPU_CHUNK = 1 << 24
"""The default ``chunk`` for buffers on a GPU: fewer, larger kernels."""


def _whole_bytes(chunk: int) -> int:
    """``chunk`` rounded down to whole bytes of bits (at least one)."""
    return max(8, chunk - chunk % 8)


_DTYPES = tuple(WIRE_DTYPES.values())
"""What a 1-bit allreduce averages: the wire dtypes (fp32, fp16, bf16)."""


def _check_call(tensor: torch.Tensor, out: torch.Tensor | None) -> None:
    """A dtype the allreduce averages, and an ``out`` of the input's shape."""
    if tensor.dtype not in _DTYPES:
        names = "/".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise TypeError(f"1-bit allreduce takes {names}, got {tensor.dtype}")
    if out is not None and out.shape != tensor.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, input {tuple(tensor.shape)}")


class OneBitAllreduce:
    """Averages a tensor across ranks with 1-bit compression and error feedback.

    Call it on every rank with a tensor of the same length; it returns the compressed
    average (same shape and dtype as the input, identical on every rank)::

        allreduce = OneBitAllreduce()          # default process group
        avg = allreduce(momentum)              # new tensor
        allreduce(momentum, out=momentum)      # in place

    Args:
        process_group: group to average over (default: the default group). With one
            rank the call returns its input untouched.
        chunk: elements per step of the server accumulation and error updates. The
            default depends on the buffer's device: 256K (1 MiB of fp32) on a CPU keeps
            temporaries in a core's L2 cache; 16M on a GPU, where each chunk costs
            kernel launches (on an H200, 64 MiB took 10-18 ms at 256K, 5-6 ms at 16M).
        pieces: how many pieces each phase is sent in (all started at once). The server
            averages a piece while the next ones travel, and the output is unpacked the
            same way, so compute hides behind the wire. ``None`` (default) measures on
            CPU: the first calls try 1, 2, 4, ... pieces and keep the fastest (see
            :mod:`thinwire.comm.piece_tuner`; the slow-link gain was 20-25% on 64 MiB).
            On CUDA it means 1: GPU packing is too fast for the overlap to matter, and
            the host clock would not see the asynchronous kernels. Set it to skip
            tuning, e.g. 1 on a high-latency link where every extra collective costs
            round trips. The result does not depend on it.
        phase2: how phase 2 travels: ``"ring"`` (gloo's all_gather, W - 1 steps one
            after the other), ``"fanout"`` (every rank's message to every peer at once,
            one step) or ``"auto"`` (default: on CPU, after the piece count, a few calls
            try the fan-out and keep it if it is more than 5% faster; the ring on
            CUDA). Same bytes, same result. With hosts 10-50 ms apart the fan-out was
            11-26% faster, on a LAN within noise (docs/results/testbed.md, "What latency
            changes"). Every rank must pass the same.
        overlap_meta: once a call has succeeded and the next call's piece count is
            known ahead (fixed, tuned, or a trial the tuner planned a call early), send
            phase 1 right behind the metadata instead of waiting for it, so that a call
            waits for two round trips instead of three, and the tuning times its trials
            that way (default True; same bytes, same result; a failed check still raises
            on every rank with nothing left in flight). False waits on every call, as
            the first call does, and tunes that way: for
            measuring what the overlap saves. Every rank must pass the same.
        error_feedback: keep what the signs lost, on every worker and in every server
            segment, and add it to the next call (default True: what makes 1 bit
            converge). False sends each call's signs alone and drops the rest: plain
            1-bit quantization, for measuring what the feedback buys (the error buffers
            stay zero). DiLoCo's 1-bit syncs without it ended 0.9% and 1.9% higher on 2
            of 3 runs, level on the third (docs/results/localsgd.md).

    Raises (on every rank alike, nothing changed):
        NonFiniteError: some rank's input (plus its error) holds NaN/Inf or overflows
            the fp32 norm.
        LengthMismatchError: the ranks passed different lengths.
        ValueError: the instance holds error buffers for another length (use one
            instance per buffer, or :meth:`reset`).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        chunk: int | None = None,
        pieces: int | None = None,
        phase2: str = "auto",
        block: int | None = DEFAULT_BLOCK,
        overlap_meta: bool = True,
        error_feedback: bool = True,
    ) -> None:
        check_block(block)
        self.block = block
        self._error_feedback = error_feedback
        self.overlap_meta = overlap_meta
        # With the overlap the count is tuned a call ahead, so the trials are timed as
        # the tuned calls will run (bits behind the metadata).
        self._plan = PiecePlan(pieces, phase2, ahead=overlap_meta)
        self._exchange: GroupExchange = GroupExchange(process_group, self._plan.fixed_scheme)
        self._chunk = chunk  # None: chosen by the buffer's device at the first call
        self.chunk = _whole_bytes(DEFAULT_CHUNK if chunk is None else chunk)
        self.numel: int | None = None
        self._bufs: dict[str, torch.Tensor] = {}
        self._scratch: PackerScratch | None = None
        self._last_seconds = 0.0  # this rank's time for its previous successful call
        # True after a call that succeeded, until the buffers or the tuning start again:
        # the ranks then hold buffers for the length they agreed on (see _early_cuts)
        self._agreed = False
        self.side_mean = 0.0
        """The last call's ``side`` numbers, averaged over the ranks."""
        self.last_call_s = 0.0
        """Seconds the last successful call took on this rank."""
        self.last_wait_s = 0.0
        """Of them, the seconds this rank was blocked waiting for the exchanges (the rest
        is its compute: compression, the server average, decompression)."""

    @classmethod
    def compute_only(
        cls,
        world_size: int,
        chunk: int | None = None,
        pieces: int | None = None,
        block: int | None = DEFAULT_BLOCK,
    ) -> OneBitAllreduce:
        """An instance that does all the arithmetic of a ``world_size``-rank call on one
        process and sends nothing: for timing the compression cost without a network."""
        obj = cls(None, chunk, pieces, block=block)
        obj._exchange = LoopbackExchange(world_size)
        return obj

    @property
    def error_feedback(self) -> bool:
        """Whether calls carry what the signs lost into the next one (fixed at
        construction: switching it between calls would leave the old error behind)."""
        return self._error_feedback

    @property
    def world_size(self) -> int:
        return self._exchange.world_size

    @property
    def rank(self) -> int:
        return self._exchange.rank

    @property
    def pieces(self) -> int | None:
        """The fixed piece count, or None when it is tuned."""
        return self._plan.pieces

    @property
    def phase2_in_use(self) -> str:
        """The phase-2 scheme calls use now (the ring while ``auto`` has not chosen)."""
        tuner = self._plan.tuner
        if tuner is not None and tuner.scheme is not None:
            return tuner.scheme
        return self._plan.fixed_scheme

    @property
    def _tuner(self) -> PieceTuner | None:
        return self._plan.tuner

    # ------------------------------------------------------------------ buffers

    def _layout(self, n: int) -> tuple[int, int, int]:
        """(padded length N, segment length N/W, real elements in this rank's segment)."""
        w = self.world_size
        padded = onebit_padded_numel(n, w, self.block)
        seg = padded // w
        return padded, seg, min(seg, max(0, n - self.rank * seg))

    def _chunk_for(self, device: torch.device, seg: int) -> int:
        """Elements of the server average's fp32 temporary (``tmp``) on ``device``: the
        chunk, or the device's default chunk when none was given; whole blocks."""
        if self._chunk is None:
            self.chunk = DEFAULT_CHUNK if device.type == "cpu" else GPU_CHUNK
        tmp = min(self.chunk, max(8, seg))
        if self.block is not None:
            tmp = max(self.block, tmp - tmp % self.block)
        return tmp

    def _allocate(self, n: int, device: torch.device) -> None:
        padded, seg, _ = self._layout(n)
        w = self.world_size
        sb = onebit_scale_bytes(n, w, self.block)  # phase 1: scales ahead of the bits
        sb2 = SCALE_BYTES if self.block is None else sb  # phase 2

        def zeros(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        tmp = self._chunk_for(device, seg)  # the largest fp32 chunk of the server average
        self._bufs = {
            "worker_error": zeros(padded),
            "work": zeros(padded),  # x = input + worker_error; becomes the next error
            "server_error": zeros(seg),
            "server_work": zeros(seg),  # y; becomes the next server error
            "send": zeros(padded // 8, torch.uint8),
            # phase 1 messages, one per destination: its segment's scales (with blocks),
            # then its bits
            "message1": zeros(w * sb + padded // 8 if sb else 0, torch.uint8),
            "recv": zeros(w * sb + padded // 8, torch.uint8),
            # phase 2 message: this rank's scale(s), then its packed segment
            "message": zeros(seg // 8 + sb2, torch.uint8),
            "gathered": zeros(w * (seg // 8 + sb2), torch.uint8),
            # phase 1 pieces, piece-major: piece j holds slice j of every rank's message
            "send_pieces": zeros(w * sb + padded // 8, torch.uint8),
            "tmp": zeros(tmp),
        }
        self._scratch = PackerScratch(padded, device)
        self.numel = n
        self._new_tuner(device)

    def _new_tuner(self, device: torch.device) -> None:
        """Start tuning the piece count afresh (CPU, no fixed count). Every rank does this
        at the same call (first call, new length, load, device move): their choices stay
        in step."""
        _, seg, _ = self._layout(self.numel or 0)
        self._plan.restart(seg // 8, device)
        self._last_seconds = 0.0
        self._agreed = False

    @property
    def pieces_in_use(self) -> int | None:
        """The piece count calls use now (None before the first call, or while tuning)."""
        if self.numel is None:
            return self.pieces
        return self._plan.in_use(self._layout(self.numel)[1] // 8)

    @property
    def tuned(self) -> bool:
        """True once calls run at their final piece count and phase-2 scheme (always
        with both fixed, or one rank). Tuning takes at most 20 calls on the same buffer
        length: 16 for the count, 3 more for the scheme with ``phase2="auto"``."""
        if self.world_size == 1:
            return True
        if self._tuner is not None:
            return self._tuner.done
        if self.numel is None:  # not called yet: on CPU the first call starts any tuning
            return self.pieces is not None and self._plan.phase2 != "auto"
        return True  # allocated without a tuner: a fixed count and scheme, or CUDA

    def reset(self) -> None:
        """Drop the error buffers; the next call starts from zero error at any length."""
        self.numel = None
        self._bufs = {}
        self._scratch = None
        self._plan.clear()
        self._agreed = False

    # ------------------------------------------------------------------ the call

    def __call__(
        self,
        tensor: torch.Tensor,
        out: torch.Tensor | None = None,
        side: torch.Tensor | float = 0.0,
    ) -> torch.Tensor:
        """Return the compressed average of ``tensor`` over the group (into ``out`` if given).

        ``side``: one number of this rank's that travels exactly, in the metadata that
        already goes ahead of the bits (no extra message); its average over the ranks is
        left in :attr:`side_mean`, alike on every rank.
        """
        _check_call(tensor, out)
        w = self.world_size
        if w == 1:
            self.side_mean = float(side)
            if out is None or out is tensor:
                return tensor
            return out.copy_(tensor)

        started = time.perf_counter()
        waited0 = self._exchange.waited_s
        n = tensor.numel()
        fresh = self._ready_for(n, tensor.device)
        # Reported to every rank's piece tuner; stays 0 (unknown) if this call raises.
        previous, self._last_seconds = self._last_seconds, 0.0
        ours = self.numel == n
        _, seg, real = self._layout(n)
        sb = onebit_scale_bytes(n, w, self.block)  # scales ahead of a segment's bits, phase 1
        seg8 = seg // 8

        scale, scales = self._compensate(tensor, ours)
        plan = self._plan.meta()  # before this call's cuts, as every rank sends it
        early = self._early_cuts()
        wait_meta = self._start_meta(scale, n, previous, side, plan, early)
        if ours:  # packing overlaps the tiny gather; the bits are only used if all is well
            pack_signs(self._bufs["work"], out=self._bufs["send"], scratch=self._scratch.bools)
        sent = None if early is None else self._phase1(early, scale, scales, n if ours else None)
        metas = self._checked_metas(wait_meta, n, fresh, sent)
        # The last rank to arrive waited least: its time is closest to the call's own.
        cuts = self._plan.cuts(seg8, float(metas[:, 3].min()), self._align)
        if sent is None:
            sent = self._phase1(cuts, scale, scales, n)
        elif cuts != sent[0]:  # the plan decided ahead is the plan: a bug otherwise
            for wait in sent[2]:  # leave nothing in flight
                wait()
            raise RuntimeError(f"1-bit allreduce: sent pieces {sent[0]}, planned {cuts}")
        cuts, recvs, waits = sent
        y = self._server_average(metas, recvs, waits, cuts, sb, real)
        gathered, waits, scales2, sb2 = self._phase2(y, cuts, sb, real)

        # All ranks passed every check: commit both error updates by swapping buffers.
        self._swap("worker_error", "work")
        self._swap("server_error", "server_work")
        if not self.error_feedback:
            self._drop_errors()

        out = self._unpack_output(tensor, out, gathered, waits, scales2, cuts, sb2, seg8)
        self._agreed = True
        self._last_seconds = time.perf_counter() - started
        self.last_call_s = self._last_seconds
        self.last_wait_s = self._exchange.waited_s - waited0
        return out

    # The steps of a call, in order; each works in the buffers of :meth:`_allocate`.

    def _ready_for(self, n: int, device: torch.device) -> bool:
        """Allocate the buffers on the first call, or move them to ``device``; True when
        this call allocated them (a first call that fails must leave none behind)."""
        if self.numel is None:
            self._allocate(n, device)
            return True
        if self._bufs["work"].device != device:
            self._bufs = {k: v.to(device) for k, v in self._bufs.items()}
            # e.g. a state loaded on the CPU, then called on a GPU: the GPU's chunk
            tmp = self._chunk_for(device, self._layout(n)[1])
            if tmp != self._bufs["tmp"].numel():
                self._bufs["tmp"] = torch.zeros(tmp, device=device)
            self._scratch = self._scratch.to(device)
            self._new_tuner(device)
        return False

    def _compensate(
        self, tensor: torch.Tensor, ours: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 1: ``x = input + worker_error`` and its scale (with blocks, the sum of the
        block scales, and the scales themselves)."""
        # Step 1 into the work buffer, so the error is untouched until everything passed.
        # With blocks, the metadata carries the sum of this rank's block scales: NaN or
        # Inf in any block shows there, on every rank, before a bit is sent.
        b, block, n = self._bufs, self.block, tensor.numel()
        scales: torch.Tensor | None = None
        if ours:
            shape = tensor.shape
            torch.add(
                tensor.detach(), b["worker_error"][:n].view(shape), out=b["work"][:n].view(shape)
            )
            if block is None:
                scale = rms_scale(b["work"], n)
            else:
                scales = block_scales(b["work"], n, block)
                scale = scales.sum()
        else:
            scale = torch.zeros((), device=tensor.device)
        return scale, scales

    def _early_cuts(self) -> list[int] | None:
        """This call's piece cuts when it sends phase 1 without waiting for the metadata,
        else None.

        Only after a call that succeeded (the ranks then hold buffers for the length they
        agreed on) and with the call's piece count known before its metadata (fixed,
        tuned, or a trial the tuner decided a call ahead): every rank that kept its
        buffers decides alike, and one that dropped them (``reset``, ``load_state_dict``)
        waits, then meets the others' phase 1 in the same order of collectives. Saves a
        round trip per call on a link with latency; the bytes and the result are the
        same."""
        if not (self.overlap_meta and self._agreed) or self.numel is None:
            return None
        return self._plan.upcoming_cuts(self._layout(self.numel)[1] // 8, self._align)

    @property
    def _align(self) -> int:
        """Bytes per cut between pieces: a block's bits, so no block straddles two."""
        return 1 if self.block is None else self.block // 8

    def _start_meta(
        self,
        scale: torch.Tensor,
        n: int,
        previous: float,
        side: torch.Tensor | float,
        plan: tuple[int, int],
        early: list[int] | None,
    ) -> Callable[[], torch.Tensor]:
        """Start gathering every rank's metadata (scale, length, ...); returns the wait."""
        values = [n, self.numel, previous, plan[0], plan[1], self.block or 0]
        meta = torch.stack(
            [
                scale.double(),
                *(scale.new_tensor(v, dtype=torch.float64) for v in values),
                torch.as_tensor(side, dtype=torch.float64, device=scale.device).reshape(()),
                scale.new_tensor(0 if early is None else len(early) - 1, dtype=torch.float64),
            ]
        )
        return self._exchange.start_meta(meta)

    def _checked_metas(
        self,
        wait_meta: Callable[[], torch.Tensor],
        n: int,
        fresh: bool,
        sent: tuple[list[int], list[torch.Tensor], list[Any]] | None,
    ) -> torch.Tensor:
        """Every rank's metadata, checked alike on every rank; on a failed check, no
        collective of this call is left in flight when it raises."""
        metas = wait_meta().cpu()
        # Summed in rank order: alike on every rank.
        self.side_mean = float(metas[:, 7].sum()) / self.world_size
        try:
            check_metas(metas, n)
        except (ValueError, FloatingPointError):
            if sent is not None:
                for wait in sent[2]:
                    wait()
            else:
                match_early_phase1(self._exchange, metas, self._bufs["send"].device)
            if fresh:  # a first call that fails leaves no buffers behind
                self.reset()
            raise
        return metas

    def _phase1(
        self,
        cuts: list[int],
        scale: torch.Tensor,
        scales: torch.Tensor | None,
        n: int | None,
    ) -> tuple[list[int], list[torch.Tensor], list[Any]]:
        """Start phase 1 in the pieces ``cuts`` gives and compute the next worker error
        while it travels (``n``: the input's length; None when it is not the length of
        the buffers, which then go out as they are, only to keep the collectives matched
        before the call raises); returns the cuts, the receive views and the waits."""
        b, block, w = self._bufs, self.block, self.world_size
        # Phase 1: every rank's sign bits for segment r go to rank r, in pieces (with
        # block scales, segment r's scales ride ahead of its bits, in the first piece).
        # While they travel, the next worker error x - s*sign(x) is computed in the work
        # buffer (x is no longer needed: its bits are packed); it only replaces the error
        # at the commit. Then the server averages each piece as it lands, while later
        # pieces are still on the wire.
        numel = self.numel if n is None else n
        seg8 = self._layout(numel)[1] // 8
        sb = onebit_scale_bytes(numel, w, block)
        msg_cuts = [0] + [sb + c for c in cuts[1:]]
        recvs = piece_views(b["recv"], msg_cuts, w)
        if sb:
            message1 = b["message1"].view(w, sb + seg8)
            if scales is not None:
                message1[:, :sb].copy_(scales.view(torch.uint8).view(w, sb))
            message1[:, sb:].copy_(b["send"].view(w, seg8))
        else:
            message1 = b["send"].view(w, seg8)
        if len(cuts) > 2:
            sends = piece_views(b["send_pieces"], msg_cuts, w)
            for j, piece in enumerate(sends):
                piece.copy_(message1[:, msg_cuts[j] : msg_cuts[j + 1]])
        else:
            sends = [message1]
        waits = self._exchange.start_all_to_all(
            [r.view(-1) for r in recvs], [p.reshape(-1) for p in sends]
        )
        if n is not None:
            subtract_signs_(
                b["work"],
                b["send"],
                scale if block is None else scales,
                n,
                self._scratch.index_of(b["send"]),
                self.chunk,
                block,
            )
        return cuts, recvs, waits

    def _server_average(
        self,
        metas: torch.Tensor,
        recvs: list[torch.Tensor],
        waits: list[Any],
        cuts: list[int],
        sb: int,
        real: int,
    ) -> torch.Tensor:
        """The server's ``y`` for this rank's segment, piece by piece as phase 1 lands."""
        # Server: y = mean_i(s_i * sign_i) + server_error over segment r.
        b, block, scratch = self._bufs, self.block, self._scratch
        y = b["server_work"]
        if block is None:
            rank_scales = metas[:, 0].to(device=y.device, dtype=torch.float32)
        for j, wait in enumerate(waits):
            wait()
            lo, hi = 8 * cuts[j], 8 * cuts[j + 1]
            bits = recvs[j][:, sb:] if j == 0 else recvs[j]
            if block is not None:
                if j == 0:
                    rank_scales = recvs[0][:, :sb].contiguous().view(torch.float32)
                piece_scales = rank_scales[:, lo // block : hi // block]
                average_signs_(y[lo:hi], bits, piece_scales, b["tmp"], scratch, block)
            else:
                average_signs_(y[lo:hi], bits, rank_scales, b["tmp"], scratch)
            if hi > real:  # padding stays exactly zero
                y[max(lo, real) : hi].zero_()
            y[lo:hi].add_(b["server_error"][lo:hi])
        return y

    def _phase2(
        self, y: torch.Tensor, cuts: list[int], sb: int, real: int
    ) -> tuple[list[torch.Tensor], list[Any], torch.Tensor, int]:
        """Pack ``y``, start phase 2, compute the next server error while it travels, and
        check every rank's server scale; returns the gathered views, the waits, the
        scales and their bytes per message."""
        b, block, w = self._bufs, self.block, self.world_size
        self._exchange.phase2 = self._plan.scheme  # this call's, now that it is planned
        sb2 = SCALE_BYTES if block is None else sb
        scale2 = rms_scale(y, real).reshape(1) if block is None else block_scales(y, real, block)
        message = b["message"]
        message[:sb2].copy_(scale2.view(torch.uint8))
        seg_bits = message[sb2:]
        pack_signs(y, out=seg_bits, scratch=self._scratch.bools)

        # Phase 2: every rank gets every segment and its scales (the scales ride in the
        # first piece, so unpacking can start as soon as that piece lands); meanwhile the
        # next server error is computed, again without touching the committed one.
        msg_cuts = [0] + [sb2 + c for c in cuts[1:]]
        gathered = piece_views(b["gathered"], msg_cuts, w)
        waits = self._exchange.start_all_gather(
            [g.view(-1) for g in gathered],
            [message[msg_cuts[j] : msg_cuts[j + 1]] for j in range(len(gathered))],
        )
        index = self._scratch.index_of(seg_bits)
        server_scale = scale2.reshape(()) if block is None else scale2
        subtract_signs_(y, seg_bits, server_scale, real, index, self.chunk, block)
        waits[0]()
        scales2 = gathered[0][:, :sb2].contiguous().view(torch.float32).reshape(w, -1)
        if not bool(torch.isfinite(scales2).all()):
            for wait in waits[1:]:  # leave no collective of this call in flight
                wait()
            finite = torch.isfinite(scales2).all(dim=1).tolist()
            bad = [r for r, ok in enumerate(finite) if not ok]
            raise NonFiniteError(
                f"1-bit allreduce: the server scale of rank(s) {bad} overflowed; "
                "error buffers left unchanged"
            )
        if block is None:
            scales2 = scales2.reshape(w)
        return gathered, waits, scales2, sb2

    def _unpack_output(
        self,
        tensor: torch.Tensor,
        out: torch.Tensor | None,
        gathered: list[torch.Tensor],
        waits: list[Any],
        scales2: torch.Tensor,
        cuts: list[int],
        sb2: int,
        seg8: int,
    ) -> torch.Tensor:
        """The average into ``out`` (new if None), unpacked as phase 2's pieces land."""
        # Output: segment r is s2_r * sign, unpacked piece by piece as the pieces land.
        # The old error buffer is free scratch now.
        if out is None:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        direct = out.dtype == torch.float32 and out.is_contiguous()
        dst = out.view(-1) if direct else self._bufs["work"][: tensor.numel()]
        for j, wait in enumerate(waits):
            wait()
            bits = gathered[j][:, sb2:] if j == 0 else gathered[j]
            unpack_rows_(dst, bits, scales2, cuts[j], seg8, self._scratch, self.block)
        if not direct:
            out.copy_(dst.view(out.shape))
        return out

    def _drop_errors(self) -> None:
        """Error feedback off: the next call starts from the signs of its input alone.
        (The errors are computed as usual, overlapping the wire, and cleared here: the
        call's code path, and so its timing, stays the one that is tuned.)"""
        self._bufs["worker_error"].zero_()
        self._bufs["server_error"].zero_()

    def _swap(self, err: str, work: str) -> None:
        """Commit: the work buffer (holding the new error) becomes the error buffer."""
        self._bufs[err], self._bufs[work] = self._bufs[work], self._bufs[err]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's error buffers (real elements only), plus what they belong to."""
        if self.numel is None:
            return {"numel": None, "world_size": self.world_size, "rank": self.rank}
        _, _, real = self._layout(self.numel)
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "rank": self.rank,
            "worker_error": self._bufs["worker_error"][: self.numel].clone(),
            "server_error": self._bufs["server_error"][:real].clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's error buffers; fails clearly if they belong elsewhere.
        With ``error_feedback=False`` the saved errors are not carried (the buffers stay
        zero): a run saved with the feedback on continues bit for bit only with it on."""
        if state.get("kind", "onebit") != "onebit":
            raise ValueError(
                f"the saved momentum exchange is {state['kind']}, this optimizer exchanges "
                "onebit: resume with the exchange it was saved with"
            )
        for key in ("world_size", "rank"):
            mine = getattr(self, key)
            if state.get(key) != mine:
                raise ValueError(
                    f"1-bit allreduce state is for {key} {state.get(key)}, this rank has {mine}"
                )
        n = state.get("numel")
        if n is None:
            self.reset()
            return
        worker, server = state["worker_error"], state["server_error"]
        _, _, real = self._layout(n)
        if worker.numel() != n or server.numel() != real:
            raise ValueError(
                f"1-bit allreduce state is malformed: {worker.numel()} worker and "
                f"{server.numel()} server error elements for length {n}"
            )
        self._allocate(n, worker.device)
        # Adding to +0.0 turns any -0.0 into +0.0, as the update itself would.
        if self.error_feedback:  # off, there is nothing to carry: the buffers stay zero
            self._bufs["worker_error"][:n].add_(worker.to(torch.float32))
            self._bufs["server_error"][:real].add_(server.to(torch.float32))
