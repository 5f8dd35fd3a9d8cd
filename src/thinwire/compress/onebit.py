"""1-bit sign quantisation with RMS scales: 32x fewer bytes than fp32.

A tensor ``x`` of ``n`` elements is sent as its sign bits (``x >= 0``; zero counts as
positive) packed 8 per byte, plus fp32 scales. With one scale (``block=None``, the
papers' rule) ``s = ||x||_2 / sqrt(n)`` (the RMS) and ``x`` is rebuilt as
``s * sign(x)``; the RMS scale keeps the rebuilt vector's norm equal to the original's
(1-bit Adam, arXiv 2102.02888, section 4; 1-bit LAMB, arXiv 2104.06069).

**Blocks** (``block=B``): every run of ``B`` consecutive elements gets its own RMS scale
(the last, partial block the RMS of its real elements), at 32 bits per block: ``B = 256``
costs 1/8 bit per element more (28x fewer bytes than fp32 instead of 32x). One scale for
a whole buffer gives every element an error of about the buffer's RMS, whatever its own
size: a layer whose values are 100x smaller than its neighbours', the rows of rarely
used embeddings, the weights behind ReLU units that never fire (exactly 0) all receive
+-RMS each step, and an optimizer that divides by their own small second moment turns
that into steps of many times the learning rate. Block scales keep the error local: a
block of zeros is sent exactly, a block of small values with a small scale. (Blockwise
sign compression with error feedback: Zheng et al., NeurIPS 2019, "Communication-efficient
distributed blockwise momentum SGD with error-feedback".)

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

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_CHUNK",
    "OneBitCompressor",
    "block_scales",
    "check_block",
    "onebit_ratio",
    "rms_scale",
    "scale_blocks_",
    "subtract_signs_",
]

DEFAULT_CHUNK = 1 << 18
"""Elements per step of the in-place residual update: 1 MiB of fp32 temporaries, which
stay in a CPU core's L2 cache instead of streaming a full-size temporary through memory.
Larger chunks mean fewer Python-level ops (matters below ~64K); smaller ones more."""


DEFAULT_BLOCK = 256
"""Elements per scale of thinwire's 1-bit exchanges unless told otherwise: 1/8 bit per
element of scales (28x fewer bytes than fp32, not 32x). Measured on the model zoo
(docs/results/zoo.md, "The model zoo"): with one scale per buffer, 1-bit LAMB lost 7% of
a bag-of-words model's accuracy and diverged on ReLU networks with dead units; with
256, every zoo model came within 1% of its uncompressed baseline."""


def onebit_ratio(block: int | None = DEFAULT_BLOCK) -> float:
    """How many times fewer bytes than fp32 the 1-bit code sends per element: 32 with
    one scale, ``32 / (1 + 32 / block)`` with a 32-bit scale per block (28.4 at 256)."""
    return 32.0 if block is None else 32.0 / (1.0 + 32.0 / block)


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


def check_block(block: int | None) -> None:
    """Raise ValueError unless ``block`` is None or a positive multiple of 8 (a block
    must fill whole bytes of sign bits)."""
    if block is not None and (isinstance(block, bool) or block < 8 or block % 8):
        raise ValueError(f"1-bit block must be None or a multiple of 8 >= 8, got {block!r}")


def block_scales(x: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The RMS of every block of ``block`` elements of ``x[:numel]``, as fp32.

    ``x`` is flat and ``ceil(len(x) / block)`` scales come back: a full block's RMS, the
    RMS of the real elements of a partial last block, and 0 for blocks past ``numel``.
    A block whose norm overflows comes out as inf, like a NaN input.
    """
    flat = x.reshape(-1)
    out = torch.zeros(-(-flat.numel() // block), dtype=torch.float32, device=x.device)
    full = numel // block
    if full:
        norms = torch.linalg.vector_norm(flat[: full * block].view(full, block), dim=1)
        torch.div(norms, math.sqrt(block), out=out[:full])
    rest = numel - full * block
    if rest:
        out[full] = torch.linalg.vector_norm(flat[full * block : numel]) / math.sqrt(rest)
    return out


def scale_blocks_(vals: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``vals *= scales[i]`` on block ``i`` of ``vals`` (flat, starting at a block
    boundary; a partial last block takes the next scale); returns ``vals``. Multiplying
    +-1 by a scale is exact, so this equals unpacking with that scale directly."""
    full = vals.numel() // block
    if full:
        vals[: full * block].view(full, block).mul_(scales[:full, None])
    if vals.numel() > full * block:
        vals[full * block :].mul_(scales[full])
    return vals


def subtract_signs_(
    buf: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    numel: int,
    index: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    block: int | None = None,
) -> torch.Tensor:
    """``buf[:numel] -= scale * sign`` in place, signs read from ``packed``; returns ``buf``.

    This is the error-feedback update ``e = x - s * sign(x)``: each element becomes
    exactly ``x - s`` or ``x + s`` (one rounding, as the textbook formula). It runs in
    chunks of ``chunk`` elements so the +-s temporaries never reach full size.

    Args:
        buf: flat fp32 tensor holding ``x``.
        packed: the packed sign bits of ``x`` (as produced by :func:`pack_signs`).
        scale: 0-dim fp32 tensor, or with ``block`` one scale per block of ``buf``.
        numel: number of leading elements to update (the rest is padding, left as is).
        index: optional int32 copy of ``packed`` (avoids converting it again).
        chunk: elements per step (rounded to whole blocks).
        block: elements per scale (None: one scale).
    """
    if numel == 0:
        return buf
    if index is None and not native_enabled(buf.device):
        index = packed.to(torch.int32)
    unit = 8 if block is None else block
    chunk = max(unit, chunk - chunk % unit)
    tmp = torch.empty(min(chunk, packed_numel(numel) * 8), dtype=torch.float32, device=buf.device)
    table_scale = scale.to(torch.float32) if block is None else 1.0
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        rows = packed_numel(stop) - start // 8
        vals = unpack_signs(
            packed[start // 8 : start // 8 + rows],
            table_scale,
            out=tmp[: rows * 8],
            index=None if index is None else index[start // 8 : start // 8 + rows],
        )
        if block is not None:
            scale_blocks_(vals[: stop - start], scale[start // block :], block)
        buf[start:stop].sub_(vals[: stop - start])
    return buf


class OneBitCompressor(Compressor):
    """Sign bits plus fp32 RMS scales: one per tensor, or one per block of ``block``
    elements.

    Wire format: ``(packed, scales)`` with ``packed`` the ``ceil(n/8)`` bytes of sign bits
    in :data:`thinwire.compress.packing.BIT_ORDER` and ``scales`` a 1-element fp32
    tensor, or ``ceil(n/block)`` of them. Computation is in fp32 whatever the input dtype.
    """

    name = "onebit"

    def __init__(self, block: int | None = None) -> None:
        check_block(block)
        self.block = block

    def compress(self, x: torch.Tensor) -> Compressed:
        n = x.numel()
        padded = torch.zeros(packed_numel(n) * 8, dtype=torch.float32, device=x.device)
        padded[:n].copy_(x.detach().reshape(-1))
        if self.block is None:
            scale = rms_scale(padded, n).reshape(1)
        else:
            scale = block_scales(padded[:n], n, self.block)
        packed = pack_signs(padded)
        return Compressed((packed, scale), x.shape, x.dtype)

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = message.tensors
        n = message.numel
        if self.block is None:
            values = unpack_signs(packed, scale.reshape(()))[:n].view(message.shape)
        else:
            flat = scale_blocks_(unpack_signs(packed, 1.0)[:n], scale, self.block)
            values = flat.view(message.shape)
        if out is None:
            return values.to(message.dtype)
        out.copy_(values)
        return out

    def wire_bytes(self, numel: int) -> int:
        blocks = 1 if self.block is None else -(-numel // self.block)
        return packed_numel(numel) + 4 * blocks

    def __repr__(self) -> str:
        if self.block is None:
            return super().__repr__()
        return f"{type(self).__name__}({self.name}, block={self.block})"
