"""Bit packing in pure torch: 8 booleans per byte, and back, on CPU and CUDA alike.

Bit order (the wire format of every 1-bit message thinwire sends): element ``i`` lands
in byte ``i // 8`` at bit ``7 - i % 8``, i.e. the first element is the most significant
bit. This is ``numpy.packbits``'s default (``bitorder="big"``), so a packed tensor
equals ``numpy.packbits(bits)`` byte for byte. A sign bit is 1 for ``x >= 0`` (zero
counts as positive) and 0 for ``x < 0``.

How it is fast without a compiled kernel:

* **Packing** views 8 consecutive 0/1 bytes as one int64 and multiplies it by
  ``0x8040201008040201``. Each of the eight 1-bits is shifted to its own position in the
  top byte and every cross term either lands below that byte (at distinct positions, so
  no carries) or overflows out of the word; the top byte is then the packed byte. One
  in-place multiply and one strided byte copy replace the 8 shifts and ORs (or the
  weighted sum) of a naive formulation.
* **Unpacking** indexes a 256-entry table by byte. The table row is either the 8 bytes
  of 0/1 (one int64 per byte, for :func:`unpack_bits`) or 8 floats ``+-scale`` (for
  :func:`unpack_signs`, which writes the dequantised values straight into the output
  without an intermediate boolean tensor).

Optional compiled kernels (:mod:`thinwire.compress.native`, enabled with
:func:`use_native`) do the same on CPU in one pass each, bit for bit.

Tuning: all functions take ``out=``/``scratch=`` buffers so a caller that runs every
step (the compressed allreduce) allocates nothing; fresh multi-megabyte tensors cost
page faults that show up as a large share of the time on CPU. The multiply relies on
two's complement wrap-around of int64 (what CPUs and GPUs do) and on a little-endian
byte order (checked at import).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import numpy as np
import torch

__all__ = [
    "BIT_ORDER",
    "native_enabled",
    "pack_bits",
    "pack_signs",
    "packed_numel",
    "sign_table",
    "unpack_bits",
    "unpack_signs",
    "use_native",
]

BIT_ORDER = "big"
"""First element in the most significant bit, as ``numpy.packbits(..., bitorder="big")``."""

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch platform in use
    raise ImportError("thinwire.compress.packing assumes a little-endian machine")

# 0x8040201008040201 as a signed int64: byte k of a word (bit 8k) moves to bit 63 - k.
_GATHER_MSB_FIRST = int(np.array(0x8040201008040201, dtype=np.uint64).astype(np.int64))

_NATIVE: dict[str, ModuleType | None] = {}


def use_native(enabled: bool = True) -> bool:
    """Switch CPU packing to the compiled kernels of :mod:`thinwire.compress.native`.

    Returns whether they are now in use (False if they could not be built). The output
    is bit-identical either way; only the speed differs. ``THINWIRE_NATIVE_PACKING=1``
    in the environment turns them on at first use.
    """
    if not enabled:
        _NATIVE["module"] = None
        return False
    from thinwire.compress import native

    _NATIVE["module"] = native.load()
    return _NATIVE["module"] is not None


def _native(device: torch.device) -> ModuleType | None:
    if "module" not in _NATIVE:
        use_native(os.environ.get("THINWIRE_NATIVE_PACKING", "") == "1")
    return _NATIVE["module"] if device.type == "cpu" else None


def native_enabled(device: torch.device) -> bool:
    """Whether packing on ``device`` runs the compiled kernels (CPU only)."""
    return _native(device) is not None


_BITS_TABLE: dict[torch.device, torch.Tensor] = {}
_SIGN_TABLE: dict[torch.device, torch.Tensor] = {}


def packed_numel(numel: int) -> int:
    """Bytes needed for ``numel`` bits: ``ceil(numel / 8)``."""
    return (numel + 7) // 8


def _bits_table(device: torch.device) -> torch.Tensor:
    """256 int64 words; word ``b`` holds the 8 bits of byte ``b`` as 0/1 bytes."""
    table = _BITS_TABLE.get(device)
    if table is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8)
        table = torch.from_numpy(bits.copy()).view(torch.int64).reshape(256).to(device)
        _BITS_TABLE[device] = table
    return table


def sign_table(device: torch.device) -> torch.Tensor:
    """A (256, 8) fp32 table of +-1: row ``b`` is byte ``b`` dequantised with scale 1."""
    table = _SIGN_TABLE.get(device)
    if table is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8)
        table = torch.from_numpy(bits.astype(np.float32) * 2 - 1).to(device)
        _SIGN_TABLE[device] = table
    return table


def _pack_words_(scratch: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack 0/1 bytes held in ``scratch`` (uint8, a multiple of 8 long) into ``out``.

    ``scratch`` is overwritten. ``out`` must hold ``scratch.numel() // 8`` bytes.
    """
    words = scratch.view(torch.int64)
    words.mul_(_GATHER_MSB_FIRST)
    # Byte 7 of each little-endian word is its top byte.
    out.copy_(scratch.view(-1, 8)[:, 7])
    return out


def pack_bits(
    bits: torch.Tensor, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack a tensor of 0/1 values (bool or uint8, any shape) into ``ceil(n/8)`` bytes.

    Args:
        bits: flattened in row-major order; values must be 0 or 1.
        out: optional uint8 output of ``ceil(n/8)`` elements.
        scratch: optional uint8 work buffer of at least ``8*ceil(n/8)`` elements; the
            bits are copied into it so ``bits`` itself is never modified.

    Returns:
        uint8 tensor; trailing bits of the last byte are 0 when ``n % 8 != 0``.
    """
    flat = bits.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects bool or uint8 bits, got {bits.dtype}")
    n = flat.numel()
    nbytes = packed_numel(n)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    out = out[:nbytes]
    native = _native(flat.device)
    if native is not None and n % 8 == 0 and flat.is_contiguous() and out.is_contiguous():
        native.pack_bits(flat, out)
        return out
    if scratch is None:
        scratch = torch.empty(nbytes * 8, dtype=torch.uint8, device=flat.device)
    scratch = scratch[: nbytes * 8]
    if n % 8 == 0 and flat.is_contiguous() and flat.storage_offset() % 8 == 0:
        # One out-of-place multiply instead of a copy and an in-place one.
        torch.mul(flat.view(torch.int64), _GATHER_MSB_FIRST, out=scratch.view(torch.int64))
        return out.copy_(scratch.view(-1, 8)[:, 7])
    scratch[:n].copy_(flat)
    scratch[n:].zero_()
    return _pack_words_(scratch, out)


def unpack_bits(
    packed: torch.Tensor, numel: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a bool tensor of ``numel`` (default ``8*len``) bits.

    ``out``: optional bool/uint8 tensor of ``numel`` elements; written directly (no
    intermediate) when it is contiguous and holds exactly ``8*len(packed)`` elements.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects uint8, got {packed.dtype}")
    packed = packed.reshape(-1)
    total = packed.numel() * 8
    numel = total if numel is None else numel
    if not 0 <= numel <= total:
        raise ValueError(f"cannot unpack {numel} bits from {packed.numel()} bytes")
    direct = (
        out is not None
        and out.dtype in (torch.bool, torch.uint8)
        and out.is_contiguous()
        and out.numel() == total
        and out.storage_offset() % 8 == 0
    )
    if direct:
        words = out.view(torch.uint8).view(-1).view(torch.int64)
    else:
        words = torch.empty(packed.numel(), dtype=torch.int64, device=packed.device)
    native = _native(packed.device)
    if native is not None:
        native.unpack_bits(packed.contiguous(), words.view(torch.uint8))
    else:
        # index_select takes int32/int64 indices; uint8 indexing would mean a mask.
        torch.index_select(_bits_table(packed.device), 0, packed.to(torch.int32), out=words)
    if direct:
        return out  # type: ignore[return-value]
    bits = words.view(torch.uint8).view(torch.bool)[:numel]
    if out is not None:
        out.reshape(-1).copy_(bits)
        return out
    return bits


def pack_signs(
    x: torch.Tensor, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack the sign bits ``x >= 0`` of a flat float tensor; ``len(x)`` a multiple of 8.

    ``scratch``: optional uint8 buffer of ``len(x)`` bytes (reused to avoid allocating).
    NaN packs as negative (NaN >= 0 is false); callers reject NaN before trusting bits.
    """
    n = x.numel()
    if n % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {n}")
    if out is None:
        out = torch.empty(n // 8, dtype=torch.uint8, device=x.device)
    native = _native(x.device)
    if native is not None and x.dtype == torch.float32 and x.is_contiguous():
        native.pack_signs(x.reshape(-1), out)
        return out
    if scratch is None:
        scratch = torch.empty(n, dtype=torch.uint8, device=x.device)
    scratch = scratch[:n]
    torch.ge(x.reshape(-1), 0, out=scratch.view(torch.bool))
    return _pack_words_(scratch, out)


def unpack_signs(
    packed: torch.Tensor,
    scale: torch.Tensor | float,
    out: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise packed sign bits to ``+scale`` (bit 1) / ``-scale`` (bit 0), in fp32.

    Args:
        packed: uint8 tensor of ``m`` bytes.
        scale: fp32 scalar (a 0-dim tensor stays on the device, no host sync).
        out: optional fp32 output of ``8*m`` elements (any shape with that many).
        index: optional int32 copy of ``packed`` (saves the conversion when the caller
            already made one).

    The table holds exactly ``+-scale``, so every output element is bit-exact
    ``scale * (2*bit - 1)``.
    """
    packed = packed.reshape(-1)
    m = packed.numel()
    if out is None:
        out = torch.empty(m * 8, dtype=torch.float32, device=packed.device)
    native = _native(packed.device)
    if native is not None and out.is_contiguous():
        native.unpack_signs(packed.contiguous(), float(scale), out)
        return out
    table = sign_table(packed.device) * scale
    if index is None:
        index = packed.to(torch.int32)
    torch.index_select(table, 0, index, out=out.view(m, 8))
    return out
