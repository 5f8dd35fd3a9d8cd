"""Compressor interface: fp16/bf16 casting, the 1-bit quantiser, and error feedback."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.compress import (
    BF16,
    FP16,
    CastCompressor,
    ErrorFeedback,
    OneBitCompressor,
    rms_scale,
    subtract_signs_,
)
from thinwire.compress.packing import pack_signs


@pytest.mark.parametrize("comp", [FP16, BF16])
def test_cast_round_trip_shape_dtype_and_bytes(comp: CastCompressor) -> None:
    x = torch.randn(3, 5)
    msg = comp.compress(x)
    assert msg.tensors[0].dtype == comp.dtype
    assert msg.nbytes == comp.wire_bytes(15) == 30
    y = comp.decompress(msg)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, x, atol=0.02, rtol=0.01)
    assert comp.ratio(15) == 2.0


def test_cast_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        CastCompressor(torch.float32)


@pytest.mark.parametrize("n", [1, 7, 8, 33])
def test_onebit_compress_decompress(n: int) -> None:
    x = torch.randn(n)
    comp = OneBitCompressor()
    msg = comp.compress(x)
    assert msg.nbytes == comp.wire_bytes(n) == (n + 7) // 8 + 4
    y = comp.decompress(msg)
    s = x.norm() / math.sqrt(n)
    torch.testing.assert_close(y, s * torch.where(x >= 0, 1.0, -1.0))
    # The RMS scale preserves the norm.
    torch.testing.assert_close(y.norm(), x.norm())


def test_onebit_keeps_input_dtype_and_shape() -> None:
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    y = OneBitCompressor().decompress(OneBitCompressor().compress(x))
    assert y.dtype == torch.bfloat16 and y.shape == (4, 6)


def test_rms_scale_ignores_padding() -> None:
    x = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert rms_scale(x, 2).item() == pytest.approx(5 / math.sqrt(2))
    assert rms_scale(x, 0).item() == 0.0


@pytest.mark.parametrize("n", [8, 13, 1000])
def test_subtract_signs_is_textbook_residual(n: int) -> None:
    pad = (n + 7) // 8 * 8
    buf = torch.zeros(pad)
    buf[:n] = torch.randn(n)
    x = buf.clone()
    s = rms_scale(buf, n)
    packed = pack_signs(buf)
    subtract_signs_(buf, packed, s, n, chunk=16)  # several chunks, one partial
    expected = x[:n] - s * torch.where(x[:n] >= 0, 1.0, -1.0)
    assert torch.equal(buf[:n], expected)
    assert torch.equal(buf[n:], x[n:])  # padding untouched


def test_error_feedback_sum_of_sent_tracks_sum_of_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(OneBitCompressor())
    total_in = torch.zeros(100)
    total_sent = torch.zeros(100)
    for _ in range(200):
        x = torch.randn(100, generator=gen)
        total_in += x
        total_sent += ef.decompress(ef.compress(x))
    # sent - input == -residual exactly (up to rounding), and the residual stays bounded.
    assert ef.residual is not None
    torch.testing.assert_close(total_in - total_sent, ef.residual, atol=1e-3, rtol=1e-3)
    assert ef.residual.abs().max() < 10  # bounded, unlike the accumulated 200 steps


def test_error_feedback_state_round_trip_and_shape_check() -> None:
    ef = ErrorFeedback(OneBitCompressor())
    ef.compress(torch.randn(10))
    state = ef.state_dict()
    other = ErrorFeedback(OneBitCompressor())
    other.load_state_dict(state)
    x = torch.randn(10)
    a = ef.decompress(ef.compress(x))
    b = other.decompress(other.compress(x))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="shape"):
        ef.compress(torch.randn(11))
