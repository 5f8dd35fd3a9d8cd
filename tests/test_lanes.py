"""The two test lanes: ``make test`` runs every test, ``make check`` (``--lane fast``) the
unit tests and one end-to-end smoke per pillar (see ``FAST_LANE_LIMIT_S`` in conftest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PILLARS = {
    "compress": "tests/test_train_matrix.py::test_checkpoint_log_resume_is_exact[onebit-lamb]",
    "desynchronize": "tests/test_localsgd_async.py::test_async_run_completes",
    "measure": "tests/test_analysis_cli.py::test_profile_simulate_report_chain",
}


# The lane's rule is per test (its markers and declared timeout): the files that hold the
# tests checked below show it; collecting the whole suite twice took half a minute.
FILES = sorted(
    {t.split("::")[0] for t in PILLARS.values()}
    | {"tests/test_optim_freeze.py", "tests/test_train_matrix.py"}
)


def _collect(*flags: str) -> list[str]:
    pytest_cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(
        [*pytest_cmd, *FILES, *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=100,
        check=True,
    )
    return [line for line in res.stdout.splitlines() if "::" in line]


@pytest.mark.timeout(240)
def test_the_fast_lane_keeps_the_units_and_one_smoke_per_pillar() -> None:
    full, fast = _collect(), _collect("--lane", "fast")
    assert set(fast) < set(full)
    for pillar, smoke in PILLARS.items():
        assert smoke in fast, f"the fast lane lost its {pillar} smoke"
    # a unit test stays; a long distributed run goes
    assert "tests/test_optim_freeze.py::test_one_rule_object_serves_two_optimizers" in fast
    slow = [t for t in full if "test_resume_is_exact_at_3_and_4_workers" in t]
    assert slow and not set(slow) & set(fast)
