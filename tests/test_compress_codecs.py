"""The codecs: the 16-bit cast codec, the 1-bit quantiser, and error feedback."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from thinwire.compress import (
    BF16,
    CAST_DTYPES,
    FP16,
    WIRE_DTYPES,
    CastCompressor,
    ErrorFeedback,
    OneBitCompressor,
    cast_decode,
    cast_encode,
    cast_name,
    parse_cast,
    rms_scale,
    subtract_signs_,
)
from thinwire.compress.packing import pack_signs
from thinwire.errors import ConfigError


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


@pytest.mark.parametrize(("n", "block"), [(1, 8), (33, 8), (600, 256), (1000, 64)])
def test_onebit_block_scales(n: int, block: int) -> None:
    """One RMS scale per block, the last (partial) block's over its real elements: an
    element is rebuilt at its own block's magnitude, not at the whole tensor's."""
    x = torch.randn(n)
    x[: min(n, block)] *= 1e-3  # a block of small values keeps a small scale
    comp = OneBitCompressor(block=block)
    msg = comp.compress(x)
    blocks = -(-n // block)
    assert msg.nbytes == comp.wire_bytes(n) == (n + 7) // 8 + 4 * blocks
    y = comp.decompress(msg)
    for lo in range(0, n, block):
        part = x[lo : lo + block]
        s = part.norm() / math.sqrt(part.numel())
        torch.testing.assert_close(y[lo : lo + block], s * torch.where(part >= 0, 1.0, -1.0))
    assert y[:block].abs().max() < 1e-2 < y[block:].abs().min() if n > block else True


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


# --- the one 16-bit cast codec ---------------------------------------------------------


def test_parse_cast_names_and_one_line_error() -> None:
    assert parse_cast("fp16") == torch.float16
    assert parse_cast("bf16") == torch.bfloat16
    assert parse_cast("none", plain="none") == torch.float32
    with pytest.raises(ConfigError, match=r"^cast must be one of fp16, bf16, got 'fp32'$"):
        parse_cast("fp32")  # fp32 only where the caller allows the uncompressed choice
    with pytest.raises(ConfigError) as err:
        parse_cast("int8", "grad-dtype", plain="fp32")
    assert str(err.value) == "grad-dtype must be one of fp32, fp16, bf16, got 'int8'"
    assert "\n" not in str(err.value)


def test_cast_name_inverts_the_table() -> None:
    for name, dtype in WIRE_DTYPES.items():
        assert cast_name(dtype) == name
    assert set(CAST_DTYPES) == {"fp16", "bf16"} and WIRE_DTYPES["fp32"] == torch.float32
    with pytest.raises(ValueError, match="not a wire dtype"):
        cast_name(torch.int8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_encode_decode(dtype: torch.dtype) -> None:
    x = torch.randn(4, 3)
    wire = cast_encode(x, dtype)
    assert wire.dtype == dtype and wire.shape == (12,)
    assert torch.equal(wire, x.reshape(-1).to(dtype))  # round to nearest, nothing else
    back = cast_decode(wire)
    assert back.dtype == torch.float32 and torch.equal(back, wire.float())
    out = torch.empty(4, 3)
    assert cast_decode(wire, out=out) is out and torch.equal(out, back.view(4, 3))
    # Already in the wire dtype: still a copy, so an in-place collective leaves x alone.
    same = x.to(dtype)
    assert cast_encode(same, dtype).data_ptr() != same.data_ptr()


def test_every_16_bit_exchange_reads_the_one_table() -> None:
    from thinwire.comm import allreduce
    from thinwire.localsgd import messages
    from thinwire.localsgd.algorithm import compression, diloco

    assert allreduce.WIRE_DTYPES is WIRE_DTYPES
    assert diloco.COMPRESS_CHOICES == ("none", "fp16", "bf16", "onebit")
    assert {k: compression.CODECS[k] for k in CAST_DTYPES} == CAST_DTYPES
    assert set(CAST_DTYPES.values()) <= set(messages.DTYPES.values())


def test_no_other_name_table_of_16_bit_dtypes() -> None:
    """Only compress/cast.py maps names to torch.float16/bfloat16 (a dict display with
    such a value): a second table would let the exchanges drift apart."""
    src = Path(__file__).resolve().parents[1] / "src" / "thinwire"
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and isinstance(value, ast.Attribute)
                    and value.attr in ("float16", "bfloat16")
                ):
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert {f.split(":")[0] for f in found} == {"compress/cast.py"}, found
