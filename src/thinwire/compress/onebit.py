"""1-bit sign quantisation with one RMS scale: 32x fewer bytes than fp32.

A tensor ``x`` of ``n`` elements is sent as its sign bits (``x >= 0``; zero counts as
positive) packed 8 per byte, plus one fp32 scale ``s = ||x||_2 / sqrt(n)`` (the RMS).
It is rebuilt as ``s * sign(x)``. The RMS scale keeps the rebuilt vector's norm equal to
the original's, which is what error feedback needs to stay bounded (1-bit Adam,
arXiv 2102.02888, section 4; 1-bit LAMB, arXiv 2104.06069).

On its own this quantiser is heavily biased; always use it through error feedback
(:class:`thinwire.compress.error_feedback.ErrorFeedback`, or the compressed allreduce
:class:`thinwire.comm.onebit_allreduce.OneBitAllreduce`, which keeps both residuals and
is tested bit for bit against this compressor wrapped in error feedback).

The helpers :func:`rms_scale` and :func:`subtract_signs_` are the lean building blocks
the compressed allreduce uses: they work in place on caller-owned buffers.
"""

from __future__ import annotations

import math

import torch

from thinwire.compress.base import Compressed, Compressor
from thinwire.compress.packing import native_enabled, pack_signs, packed_numel, unpack_signs

__all__ = ["DEFAULT_CHUNK", "OneBitCompressor", "rms_scale", "subtract_signs_"]

DEFAULT_CHUNK = 1 << 18
"""Elements per step of the in-place residual update: 1 MiB of fp32 temporaries, which
stay in a CPU core's L2 cache instead of streaming a full-size temporary through memory.
Larger chunks mean fewer Python-level ops (matters below ~64K); smaller ones more."""


def rms_scale(x: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """``||x[:numel]||_2 / sqrt(numel)`` as a 0-dim fp32 tensor (0 for an empty range).

    ``numel`` excludes padding, so a padded buffer is scaled by its real elements only.
    An overflowing norm (values around 1e19 and up) comes out as inf, like a NaN input.
    """
    flat = x.reshape(-1)
    n = flat.numel() if numel is None else numel
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(flat[:n]) / math.sqrt(n)


def subtract_signs_(
    buf: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    numel: int,
    index: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """``buf[:numel] -= scale * sign`` in place, signs read from ``packed``; returns ``buf``.

    This is the error-feedback update ``e = x - s * sign(x)``: each element becomes
    exactly ``x - s`` or ``x + s`` (one rounding, as the textbook formula). It runs in
    chunks of ``chunk`` elements so the +-s temporaries never reach full size.

    Args:
        buf: flat fp32 tensor holding ``x``.
        packed: the packed sign bits of ``x`` (as produced by :func:`pack_signs`).
        scale: 0-dim fp32 tensor.
        numel: number of leading elements to update (the rest is padding, left as is).
        index: optional int32 copy of ``packed`` (avoids converting it again).
    """
    if numel == 0:
        return buf
    if index is None and not native_enabled(buf.device):
        index = packed.to(torch.int32)
    chunk = max(8, chunk - chunk % 8)
    tmp = torch.empty(min(chunk, packed_numel(numel) * 8), dtype=torch.float32, device=buf.device)
    table_scale = scale.to(torch.float32)
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        rows = packed_numel(stop) - start // 8
        vals = unpack_signs(
            packed[start // 8 : start // 8 + rows],
            table_scale,
            out=tmp[: rows * 8],
            index=None if index is None else index[start // 8 : start // 8 + rows],
        )
        buf[start:stop].sub_(vals[: stop - start])
    return buf


class OneBitCompressor(Compressor):
    """Sign bits plus one fp32 RMS scale per tensor.

    Wire format: ``(packed, scale)`` with ``packed`` the ``ceil(n/8)`` bytes of sign bits
    in :data:`thinwire.compress.packing.BIT_ORDER` and ``scale`` a 1-element fp32
    tensor. Computation is in fp32 whatever the input dtype.
    """

    name = "onebit"

    def compress(self, x: torch.Tensor) -> Compressed:
        n = x.numel()
        padded = torch.zeros(packed_numel(n) * 8, dtype=torch.float32, device=x.device)
        padded[:n].copy_(x.detach().reshape(-1))
        scale = rms_scale(padded, n)
        packed = pack_signs(padded)
        return Compressed((packed, scale.reshape(1)), x.shape, x.dtype)

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = message.tensors
        n = message.numel
        values = unpack_signs(packed, scale.reshape(()))[:n].view(message.shape)
        if out is None:
            return values.to(message.dtype)
        out.copy_(values)
        return out

    def wire_bytes(self, numel: int) -> int:
        return packed_numel(numel) + 4
