"""Block-scaled quantizers: int8, fp8 (e4m3) or int4 on the wire, one fp32 scale per block.

The codecs of Streaming DiLoCo's quantized pseudo-gradients
(:class:`thinwire.localsgd.StreamingDiLoCo`) and of the quantized allreduce behind it
(:class:`thinwire.comm.QuantizedAllreduce`). A tensor is cut into blocks of ``block``
elements; each block is divided by its own scale (its largest magnitude over the
format's largest value) and rounded to the format:

============  =====================================================  ==================
kind          values on the wire                                     bits per element
============  =====================================================  ==================
``int8``      integers -127..127 (symmetric: 0 is exact)             8 + 32/block
``fp8``       float8 e4m3 (3 mantissa bits, largest 448), saturating  8 + 32/block
``int4``      integers -7..7, two per byte                           4 + 32/block
``bf16``      bfloat16 (8 significant bits) of the block over its     16 + 32/block
              largest magnitude
============  =====================================================  ==================

At the default block of 256 the scales add 0.125 bits per element: int8 and fp8 send
3.9x fewer bytes than fp32, int4 7.8x fewer, bf16 2.0x fewer.

``bf16`` is not one of :data:`QUANT_KINDS`: Streaming DiLoCo's ``compress="bf16"`` is a
plain cast (:mod:`thinwire.compress.cast`). Here it serves the 1-bit optimizers'
momentum exchange (``exchange="bf16"``), where the two-phase allreduce sums in fp32 and
keeps what each rounding lost as error feedback, as for the quantizers.

Tuning guide:

* **int8** keeps the most of a pseudo-gradient with one block scale: its error is
  uniform, at most half a step of ``absmax / 127``, so a block's small elements keep
  ~1% relative precision when its largest is 100x them.
* **fp8** (e4m3) spends its bits on range instead: relative precision is ~6% for every
  element, however small against its block's largest. Choose it when blocks mix scales
  (embeddings, outlier channels). Where the hardware has no fp8, torch's conversion runs
  in software (thinwire's only use of the format is this cast), so it works on any CPU.
* **int4** is the Streaming DiLoCo paper's regime (4-bit outer gradients). Alone it
  rounds every element smaller than ``absmax / 14`` of its block to zero; with error
  feedback (the default of every user in thinwire) what is rounded away is sent later,
  so nothing is lost for good.
* **bf16** keeps ~0.4% of every element, whatever its block's scale: the finest code
  here, at twice int8's bytes.
* **onebit** (:func:`block_codec`; thinwire's 1-bit code, sign bits and an RMS scale
  per block, 28x fewer bytes than fp32) keeps only each element's sign: biased on its
  own, it needs error feedback, and with it is the cheapest code here. Through the
  quantized allreduce a tensor's last, partial block is zero-filled first, so its RMS
  is over the whole block (the compressor alone takes its real elements).
* **block**: smaller blocks follow the tensor's scale more closely and cost more scale
  bytes (32 / block bits per element); 256 is the 1-bit codec's default too.

Non-finite input cannot be encoded (a NaN has no integer); the collectives check for it
on every rank before they encode (:class:`thinwire.comm.QuantizedAllreduce`).
"""

from __future__ import annotations

import torch

from thinwire.compress.base import Compressed, Compressor
from thinwire.compress.onebit import OneBitCompressor
from thinwire.errors import ConfigError

__all__ = [
    "BLOCK_CODES",
    "CODE_BITS",
    "DEFAULT_QUANT_BLOCK",
    "QUANT_BITS",
    "QUANT_KINDS",
    "QuantCompressor",
    "block_codec",
]

QUANT_BITS: dict[str, int] = {"int8": 8, "fp8": 8, "int4": 4}
"""Bits per element of each quantizer's payload (before its scales)."""
QUANT_KINDS = tuple(QUANT_BITS)
"""The quantizers' names, in the order the help texts list them."""
CODE_BITS: dict[str, int] = {**QUANT_BITS, "bf16": 16}
"""Every code :class:`QuantCompressor` takes: the quantizers and block-scaled bf16."""
DEFAULT_QUANT_BLOCK = 256
"""Elements per scale unless told otherwise."""
BLOCK_CODES = (*QUANT_KINDS, "onebit")
"""The codes of the error-compensated quantized allreduce behind Streaming DiLoCo's
fragments: the quantizers and ``onebit``, thinwire's sign code with an RMS scale per
block (:class:`~thinwire.compress.onebit.OneBitCompressor`), 1 + 32/block bits per
element."""

# The largest value of each format: a block's largest magnitude is scaled onto it.
# (bf16 keeps its relative precision at any scale: 1 only keeps blocks far from overflow.)
_QMAX = {
    "int8": 127.0,
    "fp8": float(torch.finfo(torch.float8_e4m3fn).max),
    "int4": 7.0,
    "bf16": 1.0,
}


class QuantCompressor(Compressor):
    """One block-scaled quantizer (see the module docstring for the formats).

    Args:
        kind: ``int8``, ``fp8``, ``int4`` or ``bf16``.
        block: elements per fp32 scale (an even number, so int4 packs whole bytes).

    The message is ``(payload, scales)``: ``payload`` a flat ``uint8`` tensor (int8 and
    fp8: one byte per element; int4: two elements per byte) over the tensor padded with
    zeros to whole blocks, ``scales`` one fp32 per block.
    """

    def __init__(self, kind: str = "int8", block: int = DEFAULT_QUANT_BLOCK) -> None:
        if kind not in CODE_BITS:
            raise ConfigError(f"unknown quantizer {kind!r}; choose one of {', '.join(CODE_BITS)}")
        if int(block) != block or block < 2 or block % 2:
            raise ConfigError(f"quantizer block must be an even integer >= 2, got {block}")
        self.kind = kind
        self.block = int(block)
        self.name = kind

    def padded_numel(self, numel: int) -> int:
        """``numel`` rounded up to whole blocks."""
        return -(-numel // self.block) * self.block

    def wire_bytes(self, numel: int) -> int:
        padded = self.padded_numel(numel)
        return padded * CODE_BITS[self.kind] // 8 + 4 * (padded // self.block)

    def compress(self, x: torch.Tensor) -> Compressed:
        flat = x.detach().reshape(-1).to(torch.float32)
        padded = self.padded_numel(flat.numel())
        if padded != flat.numel():
            flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
        blocks = flat.view(-1, self.block)
        scales = blocks.abs().amax(dim=1) / _QMAX[self.kind]
        # An all-zero block has scale 0; dividing by 1 instead sends its zeros as zeros.
        scaled = blocks / torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        return Compressed((self._encode(scaled.reshape(-1)), scales), x.shape, x.dtype)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        if self.kind == "bf16":
            return scaled.to(torch.bfloat16).view(torch.uint8)
        q = torch.round(scaled).clamp_(-_QMAX[self.kind], _QMAX[self.kind])
        if self.kind == "int8":
            return q.to(torch.int8).view(torch.uint8)
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)  # 1..15, two per byte
        return nibbles[:, 0] | (nibbles[:, 1] << 4)

    def _decode(self, payload: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return payload.view(torch.float8_e4m3fn).to(torch.float32)
        if self.kind == "bf16":
            if payload.storage_offset() % 2:  # a slice of a message: realign to view pairs
                payload = payload.clone()
            return payload.view(torch.bfloat16).to(torch.float32)
        if self.kind == "int8":
            return payload.view(torch.int8).to(torch.float32)
        pairs = torch.stack((payload & 0x0F, payload >> 4), dim=1)
        return pairs.reshape(-1).to(torch.float32) - 8.0

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        payload, scales = message.tensors
        values = self._decode(payload).view(-1, self.block) * scales.unsqueeze(1)
        n = message.numel
        result = values.reshape(-1)[:n].view(message.shape).to(message.dtype)
        if out is None:
            return result
        return out.copy_(result)


def block_codec(kind: str, block: int = DEFAULT_QUANT_BLOCK) -> QuantCompressor | OneBitCompressor:
    """The compressor of one of :data:`BLOCK_CODES` (or ``bf16``), ``block`` elements per
    scale: a :class:`QuantCompressor`, or for ``onebit`` a blocked
    :class:`~thinwire.compress.onebit.OneBitCompressor` (``block`` a multiple of 8)."""
    if kind == "onebit":
        try:
            return OneBitCompressor(block)
        except ValueError as err:  # its block rule, as the quantizers' one-line error
            raise ConfigError(str(err)) from None
    return QuantCompressor(kind, block)
