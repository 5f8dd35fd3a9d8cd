"""The one 16-bit cast codec: fp16 or bf16 on the wire, 2x fewer bytes than fp32.

Every 16-bit exchange in thinwire goes through this module: DiLoCo's outer allreduce
(``DiLoCo(compress="fp16"|"bf16")``), the asynchronous pushes and pulls
(:mod:`thinwire.localsgd.algorithm.compression`) and the DDP gradient hooks (``grad_dtype``,
:func:`thinwire.comm.allreduce.average_bucket`). It holds

* the one table of dtype names, :data:`WIRE_DTYPES` (``fp32``, ``fp16``, ``bf16``), and
  its 16-bit part :data:`CAST_DTYPES`. Every list of these names elsewhere (argparse
  ``choices``, the DDP hook methods, the benchmark's methods, the Local-SGD codecs, error
  messages) is built from them, so a dtype added here reaches every one;
* :func:`parse_cast`, a name to its dtype, or a one-line :class:`ConfigError`;
* :func:`cast_name`, a dtype back to its name (for byte-accounting labels);
* :func:`cast_encode` and :func:`cast_decode`, what a tensor becomes on the wire and back.

:class:`CastCompressor` is the same codec behind the
:class:`~thinwire.compress.Compressor` interface.

Tuning: fp16 keeps 10 mantissa bits but overflows above 65504 (large gradients become
inf); bf16 keeps fp32's range with 7 mantissa bits. For gradient averaging bf16 is the
safer default; fp16 is more precise when values are known to be moderate. Neither needs
error feedback in practice (the rounding error is unbiased and tiny compared to 1-bit).
When averaging in 16 bits, divide by the world size before the sum (as every caller
here does), so the sum of W values cannot overflow fp16 where their mean does not.
"""

from __future__ import annotations

import torch

from thinwire.compress.base import Compressed, Compressor
from thinwire.errors import ConfigError

__all__ = [
    "BF16",
    "CAST_DTYPES",
    "FP16",
    "WIRE_DTYPES",
    "CastCompressor",
    "cast_decode",
    "cast_encode",
    "cast_name",
    "parse_cast",
]

WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""The dtypes a full-precision or 16-bit exchange can travel in, by name: the one table
of dtype names in thinwire (``--grad-dtype`` takes these names)."""

CAST_DTYPES: dict[str, torch.dtype] = {n: d for n, d in WIRE_DTYPES.items() if d.itemsize == 2}
"""The 16-bit wire dtypes by name (fp16, bf16): the ones the cast codec halves the bytes
with, and what every 16-bit exchange reads."""


def parse_cast(name: str, what: str = "cast", *, plain: str | None = None) -> torch.dtype:
    """The wire dtype called ``name``: fp16 or bf16, or float32 when ``name == plain``.

    Args:
        name: the user's choice.
        what: the setting's name, for the error message (e.g. ``"grad-dtype"``).
        plain: the caller's name for "uncompressed" (``"fp32"``, ``"none"``), if allowed.

    Raises:
        ConfigError: ``name`` is none of these (one line, listing the choices).
    """
    if plain is not None and name == plain:
        return torch.float32
    if name in CAST_DTYPES:
        return CAST_DTYPES[name]
    choices = ([plain] if plain is not None else []) + list(CAST_DTYPES)
    raise ConfigError(f"{what} must be one of {', '.join(choices)}, got {name!r}")


def cast_name(dtype: torch.dtype) -> str:
    """The name of a wire dtype in :data:`WIRE_DTYPES` (``torch.bfloat16`` -> ``"bf16"``)."""
    for name, d in WIRE_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not a wire dtype; choose one of {list(WIRE_DTYPES.values())}")


def cast_encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` flattened and rounded to ``dtype`` (round to nearest even): what is sent.

    The result is a new tensor, never a view of ``x``, so an in-place collective on it
    leaves ``x`` alone even when ``x`` already has that dtype.
    """
    wire = x.detach().reshape(-1).to(dtype)
    if wire.data_ptr() == x.data_ptr():
        wire = wire.clone()
    return wire


def cast_decode(
    wire: torch.Tensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What arrived, back in ``dtype`` (flat), or copied into ``out`` (any shape of the
    same number of elements, in ``out``'s dtype)."""
    if out is None:
        return wire.reshape(-1).to(dtype)
    out.copy_(wire.view(out.shape))
    return out


class CastCompressor(Compressor):
    """The cast codec as a :class:`Compressor`: a tensor sent as ``dtype``.

    Args:
        dtype: the 16-bit wire dtype, ``torch.float16`` or ``torch.bfloat16``.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in CAST_DTYPES.values():
            allowed = " or ".join(str(d).removeprefix("torch.") for d in CAST_DTYPES.values())
            raise ValueError(f"CastCompressor dtype must be {allowed}, got {dtype}")
        self.dtype = dtype
        self.name = cast_name(dtype)

    def compress(self, x: torch.Tensor) -> Compressed:
        return Compressed((cast_encode(x, self.dtype),), x.shape, x.dtype)

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        (wire,) = message.tensors
        if out is None:
            return cast_decode(wire, message.dtype).reshape(message.shape)
        return cast_decode(wire, out=out)

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel


FP16 = CastCompressor(torch.float16)
BF16 = CastCompressor(torch.bfloat16)
