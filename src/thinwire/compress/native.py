"""Compiled CPU kernels for bit packing: built once at set-up, loaded by every run.

Pure torch (:mod:`thinwire.compress.packing`) is the reference. On CPU, eager torch
needs 2-3 passes over memory to pack bits (a multiply and a strided copy, after a
comparison), where numpy's SIMD ``packbits`` needs one. These kernels do each operation
in one pass: packing compares 8 floats at once and takes their sign mask
(``_mm256_movemask_ps`` with AVX2, a plain loop otherwise); unpacking copies one
precomputed 8-value row per byte. Output is bit-identical to the pure path
(``tests/test_compress_packing.py`` checks it whenever the kernels are built).

Building is a set-up step, never a side effect of a run::

    thinwire bench native build     # what `make install` runs
    thinwire bench native status    # built? where? why not?

It calls the C++ compiler (``$CXX``, else ``c++``) directly on torch's and Python's
headers (no ninja, no setuptools), for the machine it runs on (``-march=native``), in
about a minute, and writes one shared library into :func:`cache_dir`: by default
``_native/`` beside this file (inside the repository for an editable install, ignored
by git; inside the virtual environment's ``site-packages`` otherwise), or
``$THINWIRE_NATIVE_DIR``. The library's name carries a key of everything it depends
on (this source, torch, Python, the CPU), so a changed source, another torch or
another CPU never loads a stale build: it is simply not found.

At run time :func:`load` only loads a finished library; it never compiles. Which path
packing takes is decided in :mod:`thinwire.compress.packing` (native where built,
announced once when not).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["BuildError", "build", "cache_dir", "library_path", "load", "unavailable_reason"]

_log = logging.getLogger(__name__)

NAME = "thinwire_packing_native"
"""The extension module's name (``PYBIND11_MODULE``), also the library's file stem."""

_FLAGS = ("-O3", "-march=native")
"""Optimisation flags; the build retries without ``-march=native`` where the compiler
does not know it (the AVX2 loops then compile out, the plain loops stay)."""

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


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message ends with the compiler's output."""


def cache_dir() -> Path:
    """Where built libraries live: ``$THINWIRE_NATIVE_DIR`` or ``_native/`` beside this file."""
    env = os.environ.get("THINWIRE_NATIVE_DIR", "").strip()
    return Path(env) if env else Path(__file__).resolve().parent / "_native"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in wanted and key not in seen:
                    seen[key] = value.strip()
    except OSError:  # not Linux: the processor string is the best we have
        return platform.processor()
    return "|".join(f"{k}={seen[k]}" for k in sorted(seen))


@functools.cache
def build_key() -> str:
    """A hash of everything a build depends on; part of the library's path."""
    import torch

    parts = (
        _SOURCE,
        " ".join(_FLAGS),
        torch.__version__,
        sys.version,
        platform.machine(),
        _cpu_id(),
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def library_path() -> Path:
    """The library a build for this machine, torch and Python writes (and :func:`load` reads)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / build_key() / f"{NAME}{suffix}"


_lock = threading.Lock()
_loaded: dict[Path, ModuleType | None] = {}
_reasons: dict[Path, str] = {}


def load() -> ModuleType | None:
    """The built kernels of this machine, or None (see :func:`unavailable_reason`).

    Never compiles. The result is cached per library path (a changed
    ``THINWIRE_NATIVE_DIR`` is looked up afresh).
    """
    path = library_path()
    with _lock:
        if path in _loaded:
            return _loaded[path]
        module = None
        if not path.is_file():
            _reasons[path] = "not built for this machine"
        else:
            try:
                spec = importlib.util.spec_from_file_location(NAME, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except Exception as exc:  # a broken or foreign library: stay on pure torch
                module = None
                _reasons[path] = f"{path} does not load: {exc}"
        _loaded[path] = module
        return module


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (None when the kernels load)."""
    path = library_path()
    if load() is not None:
        return None
    return _reasons.get(path, "unknown reason")


def _compile_command(source: Path, target: Path, flags: Sequence[str]) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    cxx = shlex.split(os.environ.get("CXX", "").strip() or "c++")
    includes = [f"-I{p}" for p in [*include_paths(), python_include] if p]
    libdirs = library_paths()
    return [
        *cxx,
        *flags,
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-DTORCH_EXTENSION_NAME={NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *includes,
        str(source),
        "-o",
        str(target),
        *[f"-L{d}" for d in libdirs],
        *[f"-Wl,-rpath,{d}" for d in libdirs],
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
    ]


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the kernels for this machine into :func:`library_path`; returns that path.

    Does nothing when that library exists (unless ``force``). Safe to run from several
    processes at once: each compiles into a temporary file and renames it into place.

    Raises:
        BuildError: no compiler, no headers, or the compiler failed (its output is in
            the message); packing then keeps using pure torch.
    """
    target = library_path()
    if target.is_file() and not force:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {target.parent}: {exc}; set THINWIRE_NATIVE_DIR") from None
    with tempfile.TemporaryDirectory(prefix="thinwire-native-") as tmp:
        source = Path(tmp) / f"{NAME}.cpp"
        source.write_text(_SOURCE, encoding="utf-8")
        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        errors: list[tuple[int, str]] = []
        for flags in (_FLAGS, tuple(f for f in _FLAGS if f != "-march=native")):
            cmd = _compile_command(source, partial, flags)
            if verbose:
                print(shlex.join(cmd), file=sys.stderr)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            except OSError as exc:  # no compiler at all
                raise BuildError(f"no C++ compiler ({cmd[0]}): {exc}") from None
            if proc.returncode == 0:
                os.replace(partial, target)
                with _lock:  # a later load() finds the new library
                    _loaded.pop(target, None)
                return target
            output = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            errors.append((proc.returncode, "\n".join(output[-20:])))
        partial.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        target.parent.rmdir()  # only if empty: leave no trace of a failed build
    status, tail = errors[-1]
    raise BuildError(f"the C++ compiler failed with exit status {status}\n{tail}".rstrip())
