"""Optional compiled CPU kernels for bit packing, checked against the pure-torch path.

Pure torch (:mod:`thinwire.compress.packing`) is the reference and the default. On CPU,
eager torch needs 2-3 passes over memory to pack bits (a multiply and a strided copy,
after a comparison), where numpy's SIMD ``packbits`` needs one. These kernels do each
operation in one pass: packing compares 8 floats at once and takes their sign mask
(``_mm256_movemask_ps`` with AVX2, a plain loop otherwise); unpacking copies one
precomputed 8-value row per byte. Output is bit-identical to the pure path
(``tests/test_compress_packing.py`` checks it whenever the kernels build).

They are compiled on first use with ``torch.utils.cpp_extension.load_inline`` (needs a
C++ compiler; about a minute once, cached afterwards under ``TORCH_EXTENSIONS_DIR``)
for the machine they run on (``-march=native``). Enable them with
``thinwire.compress.packing.use_native(True)`` or ``THINWIRE_NATIVE_PACKING=1``; if the
build fails, packing stays on the pure path and :func:`load` returns None.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

__all__ = ["load"]

_log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Bit k of a sign mask is element k; the wire format wants element 0 in bit 7.
struct Tables {
  uint8_t reverse[256];
  uint64_t bits[256];        // 8 bytes of 0/1, element 0 first
  float signs[256][8];       // +-1, element 0 first
  Tables() {
    for (int b = 0; b < 256; ++b) {
      uint8_t r = 0;
      for (int k = 0; k < 8; ++k) r |= ((b >> k) & 1) << (7 - k);
      reverse[b] = r;
      uint8_t row[8];
      for (int k = 0; k < 8; ++k) {
        row[k] = (b >> (7 - k)) & 1;
        signs[b][k] = row[k] ? 1.0f : -1.0f;
      }
      std::memcpy(&bits[b], row, 8);
    }
  }
};
const Tables T;
constexpr int64_t GRAIN = 1 << 14;

void pack_signs(const torch::Tensor& x, torch::Tensor& out) {
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX2__)
    const __m256 zero = _mm256_setzero_ps();
    for (; i < end; ++i) {
      // Ordered >=: NaN gives 0 (negative) and -0.0 gives 1, exactly like torch.ge.
      __m256 v = _mm256_loadu_ps(src + 8 * i);
      dst[i] = T.reverse[_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ))];
    }
#endif
    for (; i < end; ++i) {
      uint8_t b = 0;
      for (int k = 0; k < 8; ++k) b |= static_cast<uint8_t>(src[8 * i + k] >= 0.0f) << (7 - k);
      dst[i] = b;
    }
  });
}

// Input bytes must be 0 or 1 (a bool tensor), as for the pure path.
void pack_bits(const torch::Tensor& bits, torch::Tensor& out) {
  const uint8_t* src = bits.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, out.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX2__)
    // Reverse each group of 8 bytes, move bit 0 of every byte to bit 7, and take the
    // byte mask: 32 inputs become 4 output bytes with element 0 in the top bit.
    const __m256i reverse8 = _mm256_setr_epi8(
        7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8,
        7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
    for (; i + 4 <= end; i += 4) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 8 * i));
      v = _mm256_slli_epi16(_mm256_shuffle_epi8(v, reverse8), 7);
      uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(v));
      std::memcpy(dst + i, &m, 4);
    }
#endif
    for (; i < end; ++i) {
      uint64_t w;
      std::memcpy(&w, src + 8 * i, 8);
      dst[i] = static_cast<uint8_t>((w * 0x8040201008040201ULL) >> 56);
    }
  });
}

void unpack_bits(const torch::Tensor& packed, torch::Tensor& out) {
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, packed.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__AVX2__)
    // 4 input bytes -> 32 output bytes: byte j is copied to output bytes 8j..8j+7, each
    // keeps one bit (element 0 = bit 7), and a compare turns it into 0/1.
    const __m256i spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x0102040810204080ULL));
    const __m256i one = _mm256_set1_epi8(1);
    for (; i + 4 <= end; i += 4) {
      uint32_t word;
      std::memcpy(&word, src + i, 4);
      __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)), spread);
      v = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, select), select), one);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i), v);
    }
#endif
    for (; i < end; ++i) std::memcpy(dst + 8 * i, &T.bits[src[i]], 8);
  });
}

void unpack_signs(const torch::Tensor& packed, double scale, torch::Tensor& out) {
  // +-scale rows, exact: (+-1) * scale in fp32.
  alignas(32) float table[256][8];
  const float s = static_cast<float>(scale);
  for (int b = 0; b < 256; ++b)
    for (int k = 0; k < 8; ++k) table[b][k] = T.signs[b][k] * s;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, packed.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + 8 * i, table[src[i]], 32);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_signs", &pack_signs);
  m.def("pack_bits", &pack_bits);
  m.def("unpack_bits", &unpack_bits);
  m.def("unpack_signs", &unpack_signs);
}
"""

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def load(verbose: bool = False) -> ModuleType | None:
    """Build (once) and return the kernel module, or None if it cannot be built."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(
                name="thinwire_packing_native",
                cpp_sources=[_SOURCE],
                extra_cflags=["-O3", "-march=native"],
                verbose=verbose,
            )
        except Exception as exc:  # no compiler, no headers, ...: stay on pure torch
            _log.warning("thinwire native packing unavailable, using pure torch: %s", exc)
            module = None
        _state["module"] = module
        return module
