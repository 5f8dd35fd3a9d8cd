"""The compressor interface: what a tensor becomes on the wire, and back.

A :class:`Compressor` turns a tensor into a :class:`Compressed` message (the tensors
that are actually sent, plus what is needed to rebuild the original shape and dtype),
rebuilds an approximation from it, and states how many bytes that message costs for
``n`` elements. fp16/bf16 casting (:mod:`thinwire.compress.cast`) and the 1-bit sign
quantiser (:mod:`thinwire.compress.onebit`) are two implementations of this one idea;
error feedback (:mod:`thinwire.compress.error_feedback`) wraps any of them.

Compressors are stateless: state that must survive a step (a residual) belongs to a
wrapper that owns it and exposes ``state_dict()``.

Where this interface is used: the asynchronous 1-bit pushes of Local-SGD
(:mod:`thinwire.localsgd.algorithm.compression`) send ``ErrorFeedback(OneBitCompressor())``
messages as they are; the 16-bit cast codec is :class:`~thinwire.compress.CastCompressor`
behind it. And it is the single-process reference of the 1-bit allreduce
(:class:`thinwire.comm.OneBitAllreduce`), which keeps its own buffers for speed: its tests
check, call after call, that the collective's output and both residuals are bit-identical
to ``ErrorFeedback(OneBitCompressor())`` applied per rank and per segment on one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["Compressed", "Compressor"]


@dataclass
class Compressed:
    """One compressed tensor: the wire tensors and the metadata to decompress them.

    Attributes:
        tensors: what goes on the wire, in a fixed order defined by the compressor.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (decompression returns this dtype).
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the wire tensors (what a point-to-point send of this message costs)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Compressor(ABC):
    """Lossy encoding of a tensor for transmission.

    Subclasses implement :meth:`compress`, :meth:`decompress` and :meth:`wire_bytes`;
    ``decompress(compress(x))`` has the shape and dtype of ``x``.
    """

    name: str = "compressor"

    @abstractmethod
    def compress(self, x: torch.Tensor) -> Compressed:
        """Encode ``x`` (any shape, contiguous or not); ``x`` is not modified."""

    @abstractmethod
    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rebuild an approximation of the original tensor (into ``out`` if given)."""

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Bytes of the compressed message for a tensor of ``numel`` elements."""

    def ratio(self, numel: int, dtype: torch.dtype = torch.float32) -> float:
        """Compression ratio against sending ``numel`` elements of ``dtype`` uncompressed."""
        raw = numel * torch.empty((), dtype=dtype).element_size()
        return raw / max(1, self.wire_bytes(numel))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
