"""The pure-torch packer's reusable buffers, owned in one place.

:func:`~thinwire.compress.packing.pack_signs` needs a uint8 scratch as long as the
input, and the pure-torch unpacking looks bytes up in a 256-entry table by int32
index. A caller that packs and unpacks every step (the 1-bit allreduce) keeps one
:class:`PackerScratch` per buffer length, so no step allocates: fresh multi-megabyte
tensors cost page faults that show up as a large share of the time on CPU. With the
compiled kernels (:mod:`thinwire.compress.native`) the index copy is not needed and
:meth:`PackerScratch.index_of` returns None.
"""

from __future__ import annotations

import torch

from thinwire.compress.packing import native_enabled

__all__ = ["PackerScratch"]


class PackerScratch:
    """Scratch for packing and unpacking messages of up to ``numel`` elements.

    Args:
        numel: the longest message (in elements, a multiple of 8) packed with it.
        device: where the buffers live; :meth:`to` moves them.
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        self.bools = torch.zeros(numel, dtype=torch.uint8, device=device)
        """``pack_signs``'s 0/1 scratch."""
        # Off the CPU signs are unpacked elementwise from the bytes themselves: no copy.
        index_numel = numel // 8 if device.type == "cpu" else 0
        self.index = torch.zeros(index_numel, dtype=torch.int32, device=device)
        """int32 copies of packed bytes, for the pure-torch table lookup (CPU only)."""

    def to(self, device: torch.device) -> PackerScratch:
        """These buffers on ``device`` (self when already there)."""
        if self.bools.device == device:
            return self
        return PackerScratch(self.bools.numel(), device)  # scratch: nothing to carry over

    def index_of(self, bits: torch.Tensor) -> torch.Tensor | None:
        """An int32 copy of ``bits`` (same shape) in the reusable index buffer: the
        pure-torch table lookup needs int32 indices. None with native kernels and off the
        CPU, which read the bytes."""
        if native_enabled(bits.device) or bits.device.type != "cpu":
            return None
        return self.index[: bits.numel()].view(bits.shape).copy_(bits)
