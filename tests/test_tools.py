"""The scripts in tools/: they start, and refuse clearly where they cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_check_says_in_one_line_that_there_is_no_cuda(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 2
    assert res.stderr == "cuda_check: CUDA is not available on this machine\n"
    assert not out.exists()
