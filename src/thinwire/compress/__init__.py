"""What goes on the wire: the 16-bit cast codec, the 1-bit sign+scale compressor, the
block-scaled quantizers (int8, fp8, int4), error feedback, and bit packing."""

from thinwire.compress.base import Compressed, Compressor
from thinwire.compress.cast import (
    BF16,
    CAST_DTYPES,
    FP16,
    WIRE_DTYPES,
    CastCompressor,
    cast_decode,
    cast_encode,
    cast_name,
    parse_cast,
)
from thinwire.compress.error_feedback import ErrorFeedback
from thinwire.compress.onebit import OneBitCompressor, rms_scale, subtract_signs_
from thinwire.compress.packing import (
    BIT_ORDER,
    pack_bits,
    pack_signs,
    packed_numel,
    unpack_bits,
    unpack_signs,
)
from thinwire.compress.quantize import QUANT_KINDS, QuantCompressor

__all__ = [
    "BF16",
    "BIT_ORDER",
    "CAST_DTYPES",
    "FP16",
    "QUANT_KINDS",
    "WIRE_DTYPES",
    "CastCompressor",
    "Compressed",
    "Compressor",
    "ErrorFeedback",
    "OneBitCompressor",
    "QuantCompressor",
    "cast_decode",
    "cast_encode",
    "cast_name",
    "pack_bits",
    "pack_signs",
    "packed_numel",
    "parse_cast",
    "rms_scale",
    "subtract_signs_",
    "unpack_bits",
    "unpack_signs",
]
