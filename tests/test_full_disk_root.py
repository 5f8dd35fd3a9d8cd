"""A disk that fills up during a run: one line naming the file, exit status 2, nothing
half-written, and the last complete checkpoint still the one a resume finds.

A real full disk, not a patched ``write``: each test mounts a tmpfs of a few pages (root
needed; CI runs as root) and points ``--out`` into it. torch's own checkpoint writer
reports a failed write as ``RuntimeError: ... unexpected pos``; these tests hold
thinwire to naming the cause instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

TINY = [
    "--model", "tiny", "--seq-len", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
    "--batch-size", "4", "--steps", "12", "--checkpoint-interval", "2", "--no-progress",
]  # fmt: skip


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A tmpfs of ``request.param`` bytes, unmounted afterwards whatever happened."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _train(out: Path, workers: int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "thinwire.cli.main", "train", "--workers", str(workers)]
    return subprocess.run(
        [*cmd, *TINY, "--out", str(out)], capture_output=True, text=True, timeout=240
    )


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("small_disk", [4096], indirect=True)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_disk_too_small_for_the_run_record_is_one_line(small_disk: Path, workers: int) -> None:
    # One page: the lock and config.json fit, run.json does not.
    res = _train(small_disk / "run", workers)
    err = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert len(err.splitlines()) == 1, err
    assert "No space left on device" in err and "run.json" in err, err
    assert "Errno" not in err and "Traceback" not in res.stderr
    assert _leftovers(small_disk) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("small_disk", [400 * 1024], indirect=True)
def test_a_disk_that_fills_while_checkpointing_keeps_the_last_checkpoint(small_disk: Path) -> None:
    res = _train(small_disk / "run", 2)
    err = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert len(err.splitlines()) == 1, err
    assert err.startswith("thinwire: error: cannot write checkpoint"), err
    assert "No space left on device" in err and "unexpected pos" not in err, err
    assert _leftovers(small_disk) == []
    latest = small_disk / "run" / "checkpoints" / "LATEST"
    if "is still the latest" in err:
        # the step LATEST names is complete: every rank's file and the model
        step = latest.read_text().strip()
        names = {p.name for p in (latest.parent / step).iterdir()}
        assert {"rank0.pt", "rank1.pt", "model.pt"} <= names, names
    else:
        assert "there is no earlier one" in err and not latest.exists(), err
