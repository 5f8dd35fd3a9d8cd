"""The asynchronous server's rank 0 raises c10's C++ log level while it hosts the run's
store, so garbage sent to the store ports cannot flood its stderr with stack traces
(measured with a probe of about 4,200 malformed requests in 10 s: 125 dumps and 289 kB
before, none after; docs/security-async.md). These tests hold the mechanism: the level
goes up, comes back, and a level the user chose is left alone."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from thinwire.localsgd.runtime.run_store import quiet_store_warnings


def _level() -> ctypes.c_int:
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")


def test_the_store_hosts_quietly_and_puts_the_level_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    flag = _level()
    before = flag.value
    flag.value = 1  # warnings, where the store's dumps are logged
    try:
        restore = quiet_store_warnings()
        assert flag.value == 2  # errors only
        restore()
        assert flag.value == 1
    finally:
        flag.value = before


def test_a_level_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    flag = _level()
    before = flag.value
    flag.value = 0
    try:
        quiet_store_warnings()()
        assert flag.value == 0
        quiet_store_warnings()
        assert flag.value == 0
    finally:
        flag.value = before
