"""Bit packing against numpy.packbits/unpackbits, and sign (de)quantisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinwire.compress.packing import (
    pack_bits,
    pack_signs,
    packed_numel,
    sign_table,
    unpack_bits,
    unpack_signs,
)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000, 4099])
def test_pack_bits_equals_numpy_packbits(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=gen) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(n)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy()))


@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099])
def test_unpack_bits_equals_numpy_unpackbits(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (packed_numel(n),), dtype=torch.uint8, generator=gen)
    bits = unpack_bits(raw, n)
    assert bits.dtype == torch.bool and bits.numel() == n
    np.testing.assert_array_equal(bits.numpy(), np.unpackbits(raw.numpy(), count=n).astype(bool))


def test_all_byte_values_round_trip() -> None:
    raw = torch.arange(256, dtype=torch.uint8)
    np.testing.assert_array_equal(pack_bits(unpack_bits(raw)).numpy(), raw.numpy())


def test_pack_bits_accepts_uint8_and_2d_and_keeps_input() -> None:
    bits = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.uint8)
    before = bits.clone()
    packed = pack_bits(bits)
    assert packed.tolist() == [0b10110001]
    assert torch.equal(bits, before)
    with pytest.raises(TypeError, match="bool or uint8"):
        pack_bits(torch.ones(8))


def test_first_element_is_most_significant_bit() -> None:
    bits = torch.zeros(16, dtype=torch.bool)
    bits[0] = True
    bits[15] = True
    assert pack_bits(bits).tolist() == [0x80, 0x01]


def test_pack_signs_zero_is_positive_and_matches_numpy() -> None:
    x = torch.tensor([0.0, -0.0, -1e-30, 3.0, -2.0, 1e-30, float("-inf"), float("inf")])
    packed = pack_signs(x)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(x.numpy() >= 0))
    assert packed.tolist() == [0b11010101]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(7))


def test_unpack_signs_is_exact_plus_minus_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen)
    scale = torch.tensor(0.7312, dtype=torch.float32)
    out = unpack_signs(pack_signs(x), scale)
    expected = scale * torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(out, expected)


def test_sign_table_rows() -> None:
    table = sign_table(torch.device("cpu"))
    assert table.shape == (256, 8)
    assert table[0].tolist() == [-1.0] * 8
    assert table[0x81].tolist() == [1.0, -1, -1, -1, -1, -1, -1, 1.0]


def test_scratch_and_out_buffers_are_used() -> None:
    bits = torch.rand(64) < 0.5
    out = torch.empty(8, dtype=torch.uint8)
    scratch = torch.empty(64, dtype=torch.uint8)
    res = pack_bits(bits, out=out, scratch=scratch)
    assert res.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(out.numpy(), np.packbits(bits.numpy()))


def test_pack_bits_of_unaligned_and_strided_views() -> None:
    bits = torch.rand(200) < 0.5
    for view in (bits[3:67], bits[::2][:64], bits[8:72]):
        np.testing.assert_array_equal(pack_bits(view).numpy(), np.packbits(view.numpy()))


def test_unpack_bits_into_out() -> None:
    raw = torch.randint(0, 256, (16,), dtype=torch.uint8)
    expected = np.unpackbits(raw.numpy()).astype(bool)
    direct = torch.empty(128, dtype=torch.bool)
    assert unpack_bits(raw, out=direct) is direct
    np.testing.assert_array_equal(direct.numpy(), expected)
    short = torch.empty(100, dtype=torch.uint8)
    unpack_bits(raw, 100, out=short)
    np.testing.assert_array_equal(short.numpy(), expected[:100])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packing_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=gen)
    bits = x >= 0
    assert torch.equal(pack_bits(bits.cuda()).cpu(), pack_bits(bits))
    assert torch.equal(pack_signs(x[:9_992].cuda()).cpu(), pack_signs(x[:9_992]))
    packed = pack_bits(bits)
    assert torch.equal(unpack_bits(packed.cuda(), 10_000).cpu(), unpack_bits(packed, 10_000))
    scale = torch.tensor(0.25)
    assert torch.equal(unpack_signs(packed.cuda(), scale.cuda()).cpu(), unpack_signs(packed, scale))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_native_kernels_match_pure_torch() -> None:
    from thinwire.compress import packing
    from thinwire.compress.native import load

    if load() is None:
        pytest.skip("native packing kernels could not be built here")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(100_000, generator=gen)
    x[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-38])
    bits = torch.rand(100_000, generator=gen) < 0.5
    scale = torch.tensor(0.37)
    results = {}
    try:
        for native in (False, True):
            assert packing.use_native(native) == native
            packed = pack_bits(bits)
            results[native] = (
                pack_signs(x),
                packed,
                unpack_bits(packed, 99_999),
                unpack_signs(packed, scale),
                pack_bits(bits[:-3]),  # tail byte: pure fallback inside
                pack_bits(bits[:8008]),  # 1001 bytes: the vector loop leaves one
                pack_signs(x[:8008]),
            )
    finally:
        packing.use_native(False)
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)
