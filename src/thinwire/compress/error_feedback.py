"""Error feedback: a compressor wrapper that owns the residual of what it failed to send.

Each call compresses ``x + residual`` and keeps ``residual = (x + residual) -
decompress(message)``. What one step loses is added back on the next, so the sum of
what was sent tracks the sum of the inputs (the error stays bounded for the sign
quantiser with an RMS scale). This is what makes 1-bit compression converge
(Seide et al. 2014; Karimireddy et al., arXiv 1901.09847).

The residual is state: one per tensor being compressed, saved with ``state_dict()``
and restored with ``load_state_dict()`` so a resumed run continues exactly.

Users: each worker's 1-bit pushes in asynchronous Local-SGD
(:class:`thinwire.localsgd.algorithm.compression.PushEncoder`). The 1-bit allreduce keeps the same
two residuals in its own in-place buffers; its tests hold it bit-identical to this
wrapper (one per rank for the worker error, one per segment for the server error).
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.compress.base import Compressed, Compressor

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Wrap ``compressor`` with a residual for one tensor stream (same shape each call).

    Args:
        compressor: any :class:`Compressor`; :class:`OneBitCompressor` is the usual one.
    """

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residual: torch.Tensor | None = None

    def compress(self, x: torch.Tensor) -> Compressed:
        """Compress ``x + residual`` and update the residual; ``x`` is not modified."""
        target = x.detach().to(torch.float32)
        if self.residual is None:
            self.residual = torch.zeros_like(target, memory_format=torch.contiguous_format)
        elif self.residual.shape != target.shape:
            raise ValueError(
                f"error feedback holds a residual of shape {tuple(self.residual.shape)}, "
                f"got a tensor of shape {tuple(target.shape)}"
            )
        corrected = self.residual.add_(target)  # residual now holds x + e
        message = self.compressor.compress(corrected)
        sent = self.compressor.decompress(message)
        corrected.sub_(sent.to(torch.float32))  # residual = (x + e) - sent
        return Compressed(message.tensors, x.shape, x.dtype)

    def decompress(self, message: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.compressor.decompress(message, out)

    def state_dict(self) -> dict[str, Any]:
        return {"residual": None if self.residual is None else self.residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        residual = state["residual"]
        self.residual = None if residual is None else residual.detach().clone()

    def reset(self) -> None:
        """Forget the residual (e.g. when the tensor's meaning changes)."""
        self.residual = None
