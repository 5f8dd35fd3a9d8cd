"""Bit packing against numpy.packbits/unpackbits, and sign (de)quantisation."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from thinwire.compress.packing import (
    NATIVE_ENV,
    pack_bits,
    pack_signs,
    packed_numel,
    sign_table,
    unpack_bits,
    unpack_signs,
)
from thinwire.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["pure", "native"])
def packing_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test on the pure-torch path and on the native kernels (where they build)."""
    from thinwire.compress import packing

    if request.param == "native" and not _built_kernels():
        pytest.skip("native packing kernels could not be built here")
    packing.use_native(request.param == "native")
    yield request.param
    packing.use_native(None)


each_path = pytest.mark.usefixtures("packing_path")


@each_path
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000, 4099])
def test_pack_bits_equals_numpy_packbits(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=gen) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(n)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy()))


@each_path
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099])
def test_unpack_bits_equals_numpy_unpackbits(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (packed_numel(n),), dtype=torch.uint8, generator=gen)
    bits = unpack_bits(raw, n)
    assert bits.dtype == torch.bool and bits.numel() == n
    np.testing.assert_array_equal(bits.numpy(), np.unpackbits(raw.numpy(), count=n).astype(bool))


@each_path
def test_all_byte_values_round_trip() -> None:
    raw = torch.arange(256, dtype=torch.uint8)
    np.testing.assert_array_equal(pack_bits(unpack_bits(raw)).numpy(), raw.numpy())


@each_path
def test_pack_bits_accepts_uint8_and_2d_and_keeps_input() -> None:
    bits = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.uint8)
    before = bits.clone()
    packed = pack_bits(bits)
    assert packed.tolist() == [0b10110001]
    assert torch.equal(bits, before)
    with pytest.raises(TypeError, match="bool or uint8"):
        pack_bits(torch.ones(8))


@each_path
def test_first_element_is_most_significant_bit() -> None:
    bits = torch.zeros(16, dtype=torch.bool)
    bits[0] = True
    bits[15] = True
    assert pack_bits(bits).tolist() == [0x80, 0x01]


@each_path
def test_pack_signs_zero_is_positive_and_matches_numpy() -> None:
    x = torch.tensor([0.0, -0.0, -1e-30, 3.0, -2.0, 1e-30, float("-inf"), float("inf")])
    packed = pack_signs(x)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(x.numpy() >= 0))
    assert packed.tolist() == [0b11010101]
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(7))


@each_path
def test_unpack_signs_is_exact_plus_minus_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen)
    scale = torch.tensor(0.7312, dtype=torch.float32)
    out = unpack_signs(pack_signs(x), scale)
    expected = scale * torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(out, expected)


@each_path
def test_sign_table_rows() -> None:
    table = sign_table(torch.device("cpu"))
    assert table.shape == (256, 8)
    assert table[0].tolist() == [-1.0] * 8
    assert table[0x81].tolist() == [1.0, -1, -1, -1, -1, -1, -1, 1.0]


@each_path
def test_scratch_and_out_buffers_are_used() -> None:
    bits = torch.rand(64) < 0.5
    out = torch.empty(8, dtype=torch.uint8)
    scratch = torch.empty(64, dtype=torch.uint8)
    res = pack_bits(bits, out=out, scratch=scratch)
    assert res.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(out.numpy(), np.packbits(bits.numpy()))


@each_path
def test_pack_bits_of_unaligned_and_strided_views() -> None:
    bits = torch.rand(200) < 0.5
    for view in (bits[3:67], bits[::2][:64], bits[8:72]):
        np.testing.assert_array_equal(pack_bits(view).numpy(), np.packbits(view.numpy()))


@each_path
def test_unpack_bits_into_out() -> None:
    raw = torch.randint(0, 256, (16,), dtype=torch.uint8)
    expected = np.unpackbits(raw.numpy()).astype(bool)
    direct = torch.empty(128, dtype=torch.bool)
    assert unpack_bits(raw, out=direct) is direct
    np.testing.assert_array_equal(direct.numpy(), expected)
    short = torch.empty(100, dtype=torch.uint8)
    unpack_bits(raw, 100, out=short)
    np.testing.assert_array_equal(short.numpy(), expected[:100])


@pytest.mark.parametrize("scale", [0.25, torch.tensor(-3.5), torch.tensor([1e-30])])
def test_the_gpus_unpacking_of_signs_matches_the_table_bit_for_bit(scale) -> None:
    # GPUs unpack signs elementwise (bits, then where); the CPU gathers table rows.
    from thinwire.compress.packing import _unpack_signs_by_bits

    gen = torch.Generator().manual_seed(3)
    packed = pack_bits(torch.randn(4_096, generator=gen) >= 0)
    out = torch.empty(64, 64)
    by_bits = _unpack_signs_by_bits(packed, scale, out)
    assert by_bits is out
    assert torch.equal(by_bits.reshape(-1), unpack_signs(packed, scale))


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


@functools.cache
def _built_kernels() -> bool:
    """Whether the native kernels load here, building them first if needed (as
    ``make install`` does); False only where they cannot be built."""
    from thinwire.compress import native

    if native.load() is None:
        try:
            native.build()
        except native.BuildError:
            return False
    return native.load() is not None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_native_kernels_match_pure_torch() -> None:
    from thinwire.compress import packing

    if not _built_kernels():
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
        packing.use_native(None)
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)


_PROBE = """
import threading, torch
from thinwire.compress.packing import native_enabled, pack_signs, unpack_signs
x = torch.randn(4096)
def work():
    for _ in range(5):
        unpack_signs(pack_signs(x), torch.tensor(0.5))
threads = [threading.Thread(target=work) for _ in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print("native" if native_enabled(x.device) else "pure")
"""


def _probe(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """Pack in a fresh process (3 threads x 5 calls); returns its path and stderr lines."""
    full = {k: v for k, v in os.environ.items() if k != NATIVE_ENV}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), full.get("PYTHONPATH", "")])
    full.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=120,
        check=True,
    )
    return proc.stdout.strip(), proc.stderr.strip().splitlines()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_path_is_native_where_built_else_pure_announced_once(tmp_path: Path) -> None:
    # Not built (an empty kernel folder): pure torch, one line saying how to build.
    path, err = _probe(tmp_path, THINWIRE_NATIVE_DIR=str(tmp_path / "empty"))
    assert path == "pure"
    assert len(err) == 1 and "pure torch" in err[0] and "native build" in err[0], err
    # Pure torch by choice: silent.
    assert _probe(tmp_path, THINWIRE_NATIVE_PACKING="0") == ("pure", [])
    if not _built_kernels():
        pytest.skip("native packing kernels could not be built here")
    # Built: native by default, silent.
    assert _probe(tmp_path) == ("native", [])
    assert _probe(tmp_path, THINWIRE_NATIVE_PACKING="1") == ("native", [])


def test_native_required_or_misspelt_fails_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from thinwire.compress import packing

    monkeypatch.setenv("THINWIRE_NATIVE_DIR", str(tmp_path / "empty"))
    try:
        monkeypatch.setenv(NATIVE_ENV, "1")
        with pytest.raises(ConfigError, match=r"THINWIRE_NATIVE_PACKING=1 .* native build"):
            packing.use_native(None)
        monkeypatch.setenv(NATIVE_ENV, "yes")
        with pytest.raises(ConfigError, match="must be 0, 1 or auto, got 'yes'"):
            packing.use_native(None)
        monkeypatch.setenv(NATIVE_ENV, "0")
        assert packing.use_native(None) is False
        assert not packing.native_enabled(torch.device("cpu"))
    finally:
        monkeypatch.undo()
        packing.use_native(None)


@pytest.mark.parametrize("cxx", ["/nonexistent/c++", "false"])
def test_failed_build_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cxx: str
) -> None:
    from thinwire.compress import native

    monkeypatch.setenv("THINWIRE_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", cxx)
    with pytest.raises(native.BuildError, match="compiler"):
        native.build()
    from thinwire.cli.main import main as thinwire

    assert thinwire(["bench", "native", "build", "packing"]) == 1
    assert native.load() is None and native.unavailable_reason() == "not built for this machine"
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no half-written library


def test_scratch_keeps_an_index_copy_only_on_the_cpu() -> None:
    from thinwire.compress.scratch import PackerScratch

    cpu = PackerScratch(64, torch.device("cpu"))
    assert cpu.index.numel() == 8 and cpu.bools.numel() == 64
    elsewhere = cpu.to(torch.device("meta"))  # any device but the CPU: bytes read directly
    assert elsewhere.index.numel() == 0 and elsewhere.bools.numel() == 64
    assert elsewhere.index_of(torch.zeros(8, dtype=torch.uint8, device="meta")) is None
    assert elsewhere.to(torch.device("cpu")).index.numel() == 8  # and back again
