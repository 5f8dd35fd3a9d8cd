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

Compiled kernels (:mod:`thinwire.compress.native`, built at set-up) do the same on CPU
in one pass each, bit for bit. They are used wherever they are built; otherwise this
pure path runs and says so once per process. :data:`NATIVE_ENV` or :func:`use_native`
chooses explicitly.

Tuning: all functions take ``out=``/``scratch=`` buffers so a caller that runs every
step (the compressed allreduce) allocates nothing; fresh multi-megabyte tensors cost
page faults that show up as a large share of the time on CPU. The multiply relies on
two's complement wrap-around of int64 (what CPUs and GPUs do) and on a little-endian
byte order (checked at import).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import ModuleType

import numpy as np
import torch

from thinwire.errors import ConfigError

__all__ = [
    "BIT_ORDER",
    "NATIVE_ENV",
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

NATIVE_ENV = "THINWIRE_NATIVE_PACKING"
"""Environment variable choosing CPU packing's path: unset or ``auto`` (native where
built, else pure torch, announced once), ``0`` (pure torch), ``1`` (native required)."""

_NATIVE: dict[str, ModuleType | None] = {}
_NATIVE_LOCK = threading.Lock()
_ANNOUNCED: list[str] = []  # the fallback's reason, once it was announced
_log = logging.getLogger(__name__)


def use_native(enabled: bool | None = True) -> bool:
    """Choose the path of CPU packing in this process; returns whether the kernels are used.

    Args:
        enabled: True uses the compiled kernels of :mod:`thinwire.compress.native` if they
            are built for this machine (else pure torch, announced once); False uses pure
            torch; None returns to the default set by :data:`NATIVE_ENV`.

    Nothing is compiled here: ``thinwire bench native build`` (which
    ``make install`` runs) builds the kernels. The output is bit-identical on either
    path; only the speed differs.
    """
    with _NATIVE_LOCK:
        _NATIVE.clear()
        if enabled is None:
            return _resolve_locked() is not None
        _NATIVE["module"] = _load_native(required=False) if enabled else None
        return _NATIVE["module"] is not None


def _load_native(required: bool) -> ModuleType | None:
    from thinwire.compress import native

    module = native.load()
    if module is None:
        reason = native.unavailable_reason()
        if required:
            raise ConfigError(
                f"{NATIVE_ENV}=1 but the native packing kernels are unavailable: {reason}; "
                "build them with `thinwire bench native build`"
            )
        if not _ANNOUNCED:  # once per process, not per call
            _ANNOUNCED.append(reason)
            _log.warning(
                "thinwire: packing on CPU uses pure torch (slower): the native kernels are "
                "%s; build them with `thinwire bench native build` "
                "(`make install` does), or set %s=0 to choose pure torch",
                reason,
                NATIVE_ENV,
            )
    return module


def _resolve_locked() -> ModuleType | None:
    """The default path, from :data:`NATIVE_ENV` (the caller holds the lock)."""
    if "module" not in _NATIVE:
        raw = os.environ.get(NATIVE_ENV, "")
        mode = raw.strip().lower()
        if mode not in ("", "auto", "0", "1"):
            raise ConfigError(f"{NATIVE_ENV} must be 0, 1 or auto, got {raw!r}")
        _NATIVE["module"] = None if mode == "0" else _load_native(required=mode == "1")
    return _NATIVE["module"]


def _native(device: torch.device) -> ModuleType | None:
    if device.type != "cpu":
        return None  # CUDA tensors always take the pure-torch path
    try:
        return _NATIVE["module"]  # decided: no lock on the hot path
    except KeyError:
        pass
    with _NATIVE_LOCK:
        return _resolve_locked()


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
    if packed.device.type != "cpu":
        return _unpack_signs_by_bits(packed, scale, out)
    table = sign_table(packed.device) * scale
    if index is None:
        index = packed.to(torch.int32)
    torch.index_select(table, 0, index, out=out.view(m, 8))
    return out


def _unpack_signs_by_bits(
    packed: torch.Tensor, scale: torch.Tensor | float, out: torch.Tensor
) -> torch.Tensor:
    """:func:`unpack_signs` as bits, then ``where(bit, scale, -scale)``: elementwise, for
    GPUs, where gathering 8-float rows of the sign table ran 75x slower than
    :func:`unpack_bits` (an H200: 7.6 ms against 0.1 ms for 100M elements). Bit-exact
    ``+-scale`` as the table."""
    bits = unpack_bits(packed).view(out.shape)
    if isinstance(scale, torch.Tensor):
        plus = scale.to(device=out.device, dtype=torch.float32).reshape(())
    else:
        plus = torch.full((), scale, dtype=torch.float32, device=out.device)
    return torch.where(bits, plus, -plus, out=out)
