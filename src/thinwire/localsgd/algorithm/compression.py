"""Compressed pushes and pulls of asynchronous Local-SGD: fp16, bf16 or 1-bit, both ways.

Two streams cross the wire every round, each a full parameter vector in fp32 by default:

* **Push** (worker to server): the pseudo-gradient ``theta_pulled - theta_w``.
  ``fp16``/``bf16`` cast it (2x fewer bytes; the cast codec of
  :mod:`thinwire.compress.cast`, the same DiLoCo and the DDP hooks use). ``onebit`` sends its signs, packed 8 per
  byte, and one fp32 RMS scale (32x fewer), through thinwire's own 1-bit compressor
  (:class:`thinwire.compress.OneBitCompressor`) wrapped in error feedback
  (:class:`thinwire.compress.ErrorFeedback`): each worker keeps the residual of what its
  earlier pushes failed to send and adds it to the next one, so the sum of what arrives
  tracks the sum of the pseudo-gradients.
* **Pull** (server to worker): theta. Uncompressed, it is sent whole. Compressed, the
  server keeps, per worker, a copy of the parameters that worker holds (its *view*) and
  sends the difference ``theta - view`` in the codec; both sides then add the decoded
  difference to their copy with the same fp32 operations, so the two copies stay
  bit-identical: the worker's pseudo-gradient is exact with respect to where it really
  started. What a pull fails to send stays in ``theta - view`` and goes out with the next
  one (error feedback without a residual buffer). The first pull of a worker (and of
  every new incarnation) sends theta whole, in fp32.

Wire format of a 1-bit payload: one uint8 tensor, the ``ceil(n/8)`` sign bytes followed
by the 4 bytes of the fp32 scale; its message header says dtype ``uint8``
(:data:`thinwire.localsgd.messages.DTYPES`).

Tuning: 1-bit pushes cost loss that error feedback only partly wins back within a short
run; measured on the tiny GPT in docs/results/localsgd.md ("Compressed pushes"). ``bf16`` is
close to free. Pulls compressed to 1 bit make each worker start from a view of theta
that lags by the residual; prefer ``bf16`` pulls unless the downlink is the bottleneck.
"""

from __future__ import annotations

import torch

from thinwire.compress import ErrorFeedback, OneBitCompressor, packed_numel
from thinwire.compress.base import Compressed
from thinwire.compress.cast import CAST_DTYPES, cast_decode, cast_encode
from thinwire.errors import ConfigError
from thinwire.localsgd.messages import payload_numel

__all__ = [
    "CODECS",
    "PullDecoder",
    "PullEncoder",
    "PushEncoder",
    "codec_dtype",
    "decode",
    "payload_numel",
]

CODECS: dict[str, torch.dtype] = {"none": torch.float32, **CAST_DTYPES, "onebit": torch.uint8}
"""Each codec and the dtype of its payload: fp32 whole, the 16-bit casts of
:mod:`thinwire.compress.cast`, and uint8 (packed 1-bit signs and a scale)."""


def check_codec(name: str, what: str) -> None:
    """Raise a one-line :class:`ConfigError` for an unknown codec."""
    if name not in CODECS:
        raise ConfigError(f"{what} must be one of {', '.join(CODECS)}, got {name!r}")


def codec_dtype(name: str) -> torch.dtype:
    """The payload dtype of codec ``name``."""
    check_codec(name, "compression")
    return CODECS[name]


_ONEBIT = OneBitCompressor()


def _encode(x: torch.Tensor, dtype: torch.dtype, feedback: ErrorFeedback | None) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    if dtype == torch.float32:
        return flat
    if dtype != torch.uint8:
        return cast_encode(flat, dtype)
    msg = feedback.compress(flat) if feedback is not None else _ONEBIT.compress(flat)
    packed, scale = msg.tensors
    return torch.cat([packed.reshape(-1), scale.reshape(1).float().view(torch.uint8)])


def decode(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 vector a payload (any codec, told by its dtype) carries."""
    if payload.dtype != torch.uint8:
        return cast_decode(payload)
    nbytes = packed_numel(numel)
    if payload.numel() != nbytes + 4:
        raise ValueError(f"a 1-bit payload of {numel} values is {nbytes + 4} bytes")
    scale = payload[nbytes:].clone().view(torch.float32)
    msg = Compressed((payload[:nbytes], scale), torch.Size([numel]), torch.float32)
    return _ONEBIT.decompress(msg)


class PushEncoder:
    """A worker's push codec, with its error-feedback residual under ``onebit``.

    Args:
        codec: ``none``, ``fp16``, ``bf16`` or ``onebit``.
        error_feedback: under ``onebit``, keep the residual and add it to the next push
            (default); False sends each push's signs alone (the simulator's sync
            DiLoCo with ``--no-error-feedback``; the asynchronous methods refuse it).
    """

    def __init__(self, codec: str = "none", error_feedback: bool = True) -> None:
        self.dtype = codec_dtype(codec)
        onebit = codec == "onebit" and error_feedback
        self.feedback = ErrorFeedback(OneBitCompressor()) if onebit else None

    def encode(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """The payload of one push (flat, ``self.dtype``)."""
        return _encode(pseudo_grad, self.dtype, self.feedback)

    def reset(self) -> None:
        """Forget the residual (a new incarnation, or a run restarted from a checkpoint)."""
        if self.feedback is not None:
            self.feedback.reset()


class PullEncoder:
    """The server's pull codec: one view of theta per worker (see the module docstring).

    Args:
        codec: ``none`` (theta whole, every time), ``fp16``, ``bf16`` or ``onebit``.
    """

    def __init__(self, codec: str = "none") -> None:
        self.dtype = codec_dtype(codec)
        self.views: dict[int, torch.Tensor] = {}

    @property
    def compressed(self) -> bool:
        return self.dtype != torch.float32

    def encode(self, worker: int, theta: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """``(is_delta, payload)`` to send ``worker`` for ``theta``; updates its view."""
        theta = theta.detach().reshape(-1).float()
        view = self.views.get(worker)
        if not self.compressed or view is None:
            if self.compressed:
                self.views[worker] = theta.clone()
            return False, theta
        payload = _encode(theta - view, self.dtype, None)
        view.add_(decode(payload, view.numel()))  # exactly what the worker adds
        return True, payload

    def forget(self, worker: int) -> None:
        """``worker``'s copy is gone (a new hello, a death): its next pull is whole."""
        self.views.pop(worker, None)


class PullDecoder:
    """A worker's side of the pull codec: the parameters it holds."""

    def __init__(self) -> None:
        self.view: torch.Tensor | None = None

    def whole(self, theta: torch.Tensor) -> torch.Tensor:
        """A whole theta arrived; returns it (fp32) and keeps a copy for later deltas."""
        self.view = theta.reshape(-1).float().clone()
        return self.view.clone()

    def delta(self, payload: torch.Tensor) -> torch.Tensor:
        """A difference arrived; returns the updated parameters."""
        if self.view is None:
            raise RuntimeError("a compressed pull arrived before any whole theta")
        self.view.add_(decode(payload, self.view.numel()))
        return self.view.clone()
