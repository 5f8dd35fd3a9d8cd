"""Compression by casting to a 16-bit float: fp16 or bf16, 2x fewer bytes than fp32.

fp16 keeps 10 mantissa bits but overflows above 65504 (large gradients become inf);
bf16 keeps fp32's range with 7 mantissa bits. For gradient averaging bf16 is the safer
default; fp16 is more precise when values are known to be moderate. Neither needs error
feedback in practice (the rounding error is unbiased and tiny compared to 1-bit).
"""

from __future__ import annotations

import torch

from thinwire.compress.base import Compressed, Compressor

__all__ = ["BF16", "FP16", "CastCompressor"]

_ALLOWED = (torch.float16, torch.bfloat16)


class CastCompressor(Compressor):
    """Send a tensor as ``dtype`` (``torch.float16`` or ``torch.bfloat16``).

    Args:
        dtype: the 16-bit wire dtype.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _ALLOWED:
            raise ValueError(f"CastCompressor dtype must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, x: torch.Tensor) -> Compressed:
        wire = x.detach().reshape(-1).to(self.dtype)
        if wire.data_ptr() == x.data_ptr():  # already that dtype: do not alias the input
            wire = wire.clone()
        return Compressed((wire,), x.shape, x.dtype)

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        (wire,) = message.tensors
        if out is None:
            return wire.to(message.dtype).reshape(message.shape)
        out.copy_(wire.view(message.shape))
        return out

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel


FP16 = CastCompressor(torch.float16)
BF16 = CastCompressor(torch.bfloat16)
