"""The arithmetic of the 1-bit allreduce on packed sign bits, free of any exchange.

Two steps of :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce` that read many
ranks' packed bits at once: the server average of one segment (step 3 of the
collective) and the unpacking of the gathered output (step 4). Both work on rows, one
row per source rank, and both run in cache-sized pieces with the caller's buffers, so a
call allocates nothing.
"""

from __future__ import annotations

import torch

from thinwire.compress.packing import unpack_signs
from thinwire.compress.scratch import PackerScratch

__all__ = ["average_signs_", "unpack_rows_"]


def average_signs_(
    y: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    tmp: torch.Tensor,
    scratch: PackerScratch,
) -> torch.Tensor:
    """``y = (sum over source ranks i of s_i * sign_i) / W``, chunk by chunk, in rank order.

    ``bits`` is ``[W, len(y) / 8]`` (row i from rank i), ``scales`` the W scales, ``tmp``
    an fp32 buffer whose length sets the chunk (a multiple of 8). Summing in rank order
    makes the result the same on every rank and for every piece count.
    """
    w = bits.shape[0]
    index = scratch.index_of(bits)
    rows_per_chunk = tmp.numel() // 8
    for r0 in range(0, bits.shape[1], rows_per_chunk):
        r1 = min(bits.shape[1], r0 + rows_per_chunk)
        acc = y[r0 * 8 : r1 * 8]
        part = tmp[: (r1 - r0) * 8]
        for i in range(w):
            idx = None if index is None else index[i, r0:r1]
            unpack_signs(bits[i, r0:r1], scales[i], out=part if i else acc, index=idx)
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
) -> None:
    """Unpack ``bits[r]`` (bytes ``row0...`` of rank r's segment of ``seg8`` bytes) as
    ``s_r * sign`` into ``dst`` (fp32, contiguous), for every rank r, clipped to ``dst``'s
    length (the padding of the last segments is never written)."""
    n = dst.numel()
    rows = bits.shape[1]
    index = scratch.index_of(bits)
    for r in range(bits.shape[0]):
        start = 8 * (r * seg8 + row0)
        if start >= n:
            break
        whole = min(rows, (n - start) // 8)  # bytes entirely inside dst
        if whole:
            idx = None if index is None else index[r, :whole]
            end = start + 8 * whole
            unpack_signs(bits[r, :whole], scales[r], out=dst[start:end], index=idx)
        rest = n - start - 8 * whole
        if whole < rows and 0 < rest < 8:  # the last, partial byte
            tail = unpack_signs(bits[r, whole : whole + 1], scales[r])
            dst[n - rest :].copy_(tail[:rest])
