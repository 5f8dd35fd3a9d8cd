"""The arithmetic of the 1-bit allreduce on packed sign bits, free of any exchange.

Two steps of :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce` that read many
ranks' packed bits at once: the server average of one segment (step 3 of the
collective) and the unpacking of the gathered output (step 4). Both work on rows, one
row per source rank, and both run in cache-sized pieces with the caller's buffers, so a
call allocates nothing.
"""

from __future__ import annotations

import torch

from thinwire.compress.onebit import scale_blocks_
from thinwire.compress.packing import unpack_signs
from thinwire.compress.scratch import PackerScratch

__all__ = ["average_signs_", "unpack_rows_"]


def average_signs_(
    y: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    tmp: torch.Tensor,
    scratch: PackerScratch,
    block: int | None = None,
) -> torch.Tensor:
    """``y = (sum over source ranks i of s_i * sign_i) / W``, chunk by chunk, in rank order.

    ``bits`` is ``[W, len(y) / 8]`` (row i from rank i), ``scales`` the W scales (with
    ``block``: ``[W, len(y) / block]``, one per block of ``y``), ``tmp`` an fp32 buffer
    whose length sets the chunk (a multiple of 8, and of ``block``). Summing in rank
    order makes the result the same on every rank and for every piece count.
    """
    w = bits.shape[0]
    index = scratch.index_of(bits)
    unit = 8 if block is None else block
    rows_per_chunk = tmp.numel() // unit * unit // 8
    for r0 in range(0, bits.shape[1], rows_per_chunk):
        r1 = min(bits.shape[1], r0 + rows_per_chunk)
        acc = y[r0 * 8 : r1 * 8]
        part = tmp[: (r1 - r0) * 8]
        for i in range(w):
            idx = None if index is None else index[i, r0:r1]
            out = part if i else acc
            if block is None:
                unpack_signs(bits[i, r0:r1], scales[i], out=out, index=idx)
            else:
                unpack_signs(bits[i, r0:r1], 1.0, out=out, index=idx)
                scale_blocks_(out, scales[i, r0 * 8 // block :], block)
            if i:
                acc.add_(part)
    return y.div_(w)


def unpack_rows_(
    dst: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    row0: int,
    seg8: int,
    scratch: PackerScratch,
    block: int | None = None,
) -> None:
    """Unpack ``bits[r]`` (bytes ``row0...`` of rank r's segment of ``seg8`` bytes) as
    ``s_r * sign`` into ``dst`` (fp32, contiguous), for every rank r, clipped to ``dst``'s
    length (the padding of the last segments is never written). With ``block``,
    ``scales[r]`` holds one scale per block of rank r's whole segment and ``row0`` starts
    a block."""
    n = dst.numel()
    rows = bits.shape[1]
    index = scratch.index_of(bits)
    unit = 1.0 if block is not None else None
    for r in range(bits.shape[0]):
        start = 8 * (r * seg8 + row0)
        if start >= n:
            break
        scale = scales[r] if unit is None else unit
        whole = min(rows, (n - start) // 8)  # bytes entirely inside dst
        if whole:
            idx = None if index is None else index[r, :whole]
            end = start + 8 * whole
            unpack_signs(bits[r, :whole], scale, out=dst[start:end], index=idx)
        rest = n - start - 8 * whole
        if whole < rows and 0 < rest < 8:  # the last, partial byte
            tail = unpack_signs(bits[r, whole : whole + 1], scale)
            dst[n - rest :].copy_(tail[:rest])
        if block is not None:
            stop = min(n, start + 8 * rows)
            scale_blocks_(dst[start:stop], scales[r, 8 * row0 // block :], block)
