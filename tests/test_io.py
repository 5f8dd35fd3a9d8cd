"""Files written whole or not at all (thinwire.io)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from thinwire.io import atomic_save, atomic_write_text


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


def test_atomic_save_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    atomic_save({"w": torch.arange(4.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))
