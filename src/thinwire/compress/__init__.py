"""What goes on the wire: compressors (fp16/bf16 casting, 1-bit sign+scale) and error feedback."""

from thinwire.compress.base import Compressed, Compressor
from thinwire.compress.cast import BF16, FP16, CastCompressor
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

__all__ = [
    "BF16",
    "BIT_ORDER",
    "FP16",
    "CastCompressor",
    "Compressed",
    "Compressor",
    "ErrorFeedback",
    "OneBitCompressor",
    "pack_bits",
    "pack_signs",
    "packed_numel",
    "rms_scale",
    "subtract_signs_",
    "unpack_bits",
    "unpack_signs",
]
