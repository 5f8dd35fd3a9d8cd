"""Block-scaled codes (int8, fp8, int4, bf16, and the blocked 1-bit code): error bounds, padding,
wire bytes, refusals."""

from __future__ import annotations

import pytest
import torch

from thinwire.compress import ErrorFeedback, OneBitCompressor, QuantCompressor
from thinwire.compress.quantize import CODE_BITS, block_codec
from thinwire.errors import ConfigError


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    return torch.nn.functional.pad(x.reshape(-1), (0, pad)).view(-1, block)


@pytest.mark.parametrize(("kind", "qmax"), [("int8", 127.0), ("int4", 7.0)])
def test_integer_kinds_round_to_half_a_step_of_their_block(kind: str, qmax: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.linspace(0.01, 10.0, 1000)  # blocks of very different scale
    codec = QuantCompressor(kind, block=64)
    y = codec.decompress(codec.compress(x))
    step = _blocks(x, 64).abs().amax(1, keepdim=True) / qmax
    err = _blocks(y - x, 64).abs()
    assert bool((err <= step / 2 + 1e-6 * step).all())
    assert y.shape == x.shape and y.dtype == x.dtype


def test_fp8_keeps_relative_precision_of_every_element() -> None:
    torch.manual_seed(1)
    # One block holding values 1e3 apart: fp8 keeps ~6% of each, int8 loses the small ones.
    x = torch.cat([torch.full((8,), 1e-3), torch.full((8,), 1.0)]) * torch.randn(16).sign()
    fp8 = QuantCompressor("fp8", block=16)
    y = fp8.decompress(fp8.compress(x))
    assert bool(((y - x).abs() <= 0.0625 * x.abs()).all())
    int8 = QuantCompressor("int8", block=16)
    assert bool((int8.decompress(int8.compress(x))[:8] == 0).all())


def test_bf16_keeps_eight_significant_bits_of_every_element() -> None:
    torch.manual_seed(3)
    # Values 1e6 apart in one block: bf16 over the block's scale rounds each to 2^-9 of
    # itself, however small against the block's largest (int8 would send the small ones
    # as zeros).
    x = torch.randn(64) * torch.logspace(-6, 0, 64)
    codec = QuantCompressor("bf16", block=64)
    y = codec.decompress(codec.compress(x))
    assert bool(((y - x).abs() <= 2.0**-8 * x.abs()).all())
    assert codec.ratio(1 << 20) == pytest.approx(32 / (16 + 32 / 64))


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "bf16"])
def test_padding_zero_blocks_dtype_and_wire_bytes(kind: str) -> None:
    codec = QuantCompressor(kind, block=32)
    x = torch.zeros(3, 37, dtype=torch.bfloat16)  # 111 elements: 4 blocks, the last padded
    x[0, :5] = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
    message = codec.compress(x)
    y = codec.decompress(message)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert bool((y[1:] == 0).all())  # all-zero blocks come back exactly
    assert message.nbytes == codec.wire_bytes(x.numel()) == 128 * CODE_BITS[kind] // 8 + 4 * 4
    out = torch.empty_like(x)
    assert codec.decompress(message, out=out) is out
    assert codec.ratio(1 << 20) == pytest.approx(32 / (CODE_BITS[kind] + 32 / 32))


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "bf16"])
def test_error_feedback_sends_what_rounding_lost_later(kind: str) -> None:
    torch.manual_seed(2)
    ef = ErrorFeedback(QuantCompressor(kind, block=64))
    total_in = torch.zeros(500)
    total_out = torch.zeros(500)
    for _ in range(50):
        x = torch.randn(500)
        total_in += x
        total_out += ef.decompress(ef.compress(x))
    assert ef.residual is not None
    # What was sent differs from what came in by exactly the residual left over.
    torch.testing.assert_close(total_in - total_out, ef.residual, atol=1e-4, rtol=0)
    assert float(ef.residual.abs().max()) < 1.0  # bounded: no drift over 50 calls


def test_bad_kind_or_block_is_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown quantizer 'int2'"):
        QuantCompressor("int2")
    with pytest.raises(ConfigError, match="even integer"):
        QuantCompressor("int4", block=7)
    # The 1-bit code of the quantized allreduce: whole bytes of signs per block.
    with pytest.raises(ConfigError, match="multiple of 8"):
        block_codec("onebit", 12)
    assert isinstance(block_codec("onebit"), OneBitCompressor)
    assert block_codec("onebit").wire_bytes(512) == 512 // 8 + 2 * 4
