"""Files written whole or not at all, and input files read with a limit (thinwire.io)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.io import atomic_save, atomic_write_text, read_input, read_input_bytes


def test_atomic_write_text_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old\n")
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("write", ["text", "torch"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    path = tmp_path / "state"
    path.write_text("old")

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        if write == "text":
            atomic_write_text(path, "new")
        else:
            atomic_save({"x": torch.ones(3)}, path)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_ctrl_c_inside_torch_save_is_an_interrupt_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGINT raised inside a write of torch's zip writer, which then fails to close the
    # file with "unexpected pos": the caller must see the interrupt (thinwire train exits
    # 130 and names its last checkpoint), not a RuntimeError and a traceback.
    import thinwire.io as io

    path = tmp_path / "rank0.pt"
    atomic_save({"x": torch.ones(3)}, path)
    calls = {"n": 0}
    write = io._Recorded.write

    def interrupted(self: io._Recorded, data: object) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return write(self, data)

    monkeypatch.setattr(io._Recorded, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"x": torch.zeros(100_000)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt"]


def test_atomic_save_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    atomic_save({"w": torch.arange(4.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))


# --- read_input: the one guarded reader for input files ---------------------------------


def test_read_input_reads_regular_utf8(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text('{"steps": 3}  # é')
    assert read_input(p, "--config") == '{"steps": 3}  # é'


@pytest.mark.parametrize(
    ("target", "phrase"),
    [("/dev/zero", "character device"), ("DIR", "is a directory"), ("MISSING", "no such file")],
)
def test_read_input_refuses_what_is_not_a_regular_file(
    tmp_path: Path, target: str, phrase: str
) -> None:
    path = {"DIR": str(tmp_path), "MISSING": str(tmp_path / "nope")}.get(target, target)
    with pytest.raises(ConfigError, match=phrase) as e:
        read_input(path, "--config")
    assert "\n" not in str(e.value) and str(e.value).startswith("--config: ")


def test_read_input_does_not_block_on_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a FIFO"):
        read_input(fifo, "the token file")


def test_read_input_caps_the_size(tmp_path: Path) -> None:
    p = tmp_path / "big"
    p.write_bytes(b"x" * 101)
    assert read_input(p, "--config", limit=101) == "x" * 101
    with pytest.raises(ConfigError, match="101 bytes, more than the 100 allowed"):
        read_input(p, "--config", limit=100)


def test_read_input_checks_utf8(tmp_path: Path) -> None:
    p = tmp_path / "latin1"
    p.write_bytes(b'{"a": "\xe9"}')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 7\)"):
        read_input(p, "LATEST")
    assert read_input_bytes(p, "LATEST") == b'{"a": "\xe9"}'


def test_read_input_reads_proc_files_of_unknown_size() -> None:
    assert "processor" in read_input("/proc/cpuinfo", "cpuinfo")


def test_a_fifo_or_device_is_written_in_place_not_replaced(tmp_path: Path) -> None:
    import stat
    import threading

    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    atomic_write_text(fifo, '{"ok": 1}\n')
    reader.join(timeout=30)
    assert got == [b'{"ok": 1}\n']
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # a rename would have made it a file
    atomic_write_text(Path("/dev/null"), "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_full_device_names_itself() -> None:
    with pytest.raises(OSError, match="No space left") as e:
        atomic_write_text(Path("/dev/full"), "x" * 10000)
    assert e.value.filename == "/dev/full"
    with pytest.raises(OSError, match="No space left") as e:
        atomic_save({"t": torch.zeros(100_000)}, Path("/dev/full"))
    assert e.value.filename == "/dev/full"
