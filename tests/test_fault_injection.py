"""Fault injection on loopback: kill a rank, kill the launcher, two runs into one --out,
resume a finished run. Each checks that nothing accepted is lost (a resume ends
bit-identical to a run that was never disturbed) and that nothing is reported done that
was not (no summary.json, a non-zero exit status, one line naming the failure).

The asynchronous runtime's cases (a killed server or only worker, forged or NaN pushes)
belong with its own tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import TINY_FLAGS
from thinwire import runlock
from thinwire.train import checkpoint as ckpt
from thinwire.train.metrics import read_metrics

STEPS = 60
RUN = [
    "-m",
    "thinwire",
    "train",
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--eval-sequences",
    "4",
    "--no-progress",
    "--steps",
    str(STEPS),
    "--checkpoint-interval",
    "10",
    "--log-interval",
    "10",
    "--eval-interval",
    "30",
    "--timeout",
    "150",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(out: Path, *extra: str, workers: str = "2") -> subprocess.Popen[str]:
    """The run in a process group of its own, so the test can pause all of it at once."""
    return subprocess.Popen(
        [sys.executable, *RUN, "--workers", workers, "--out", str(out), *extra],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _pause(p: subprocess.Popen[str]) -> None:
    """SIGSTOP the launcher and its ranks: the run cannot finish before it is disturbed,
    however fast this machine is."""
    os.killpg(p.pid, signal.SIGSTOP)


def _go_on(p: subprocess.Popen[str]) -> None:
    """SIGCONT whatever is left of the run's process group (ranks, resource tracker)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGCONT)


@contextlib.contextmanager
def _cleaned_up(p: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """Whatever happens in the test, the run's process group does not outlive it (a
    paused group left behind would sit stopped forever)."""
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def _run(out: Path, *extra: str, workers: str = "2") -> subprocess.CompletedProcess[str]:
    p = _start(out, *extra, workers=workers)
    stdout, stderr = p.communicate(timeout=170)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def _wait_for_checkpoint(out: Path, p: subprocess.Popen[str], step: int) -> int:
    """Wait until LATEST names ``step`` or later; return it (the run must still be going)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        latest = ckpt.latest_step(out) if (out / "checkpoints" / "LATEST").exists() else None
        if latest is not None and latest >= step:
            assert p.poll() is None, "the run ended before it could be disturbed"
            return latest
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def _ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the ``thinwire-rank<r>`` descendants of ``launcher`` (their ps name;
    forked from its fork server, or its own children)."""
    names, parents = {}, {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            names[int(proc.name)] = (proc / "comm").read_text().strip()
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        for _ in range(3):  # the launcher, or the fork server it started
            pid = parents.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return {
        int(comm.removeprefix("thinwire-rank")): pid
        for pid, comm in names.items()
        if comm.startswith("thinwire-rank") and descends(pid)
    }


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _resume_matches(out: Path, reference: dict) -> None:
    """--resume finishes the run, bit-identical to the undisturbed one, logging each
    step once (what the disturbed run did after its last checkpoint is not kept)."""
    # Checkpoint cadence is not part of the run's identity: fewer saves, same result.
    res = _run(out, "--resume", "--checkpoint-interval", "100")
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["param_sha256"] == reference["param_sha256"]
    assert summary["comm_bytes"] == reference["comm_bytes"]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(10, STEPS + 1, 10))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An undisturbed run, with a second run trying the same --out while it trains."""
    out = tmp_path_factory.mktemp("fault") / "reference"
    with _cleaned_up(_start(out)) as first:
        _wait_for_checkpoint(out, first, 10)
        _pause(first)
        holder = runlock.holder(out)
        intruder = _run(out, "--seed", "1", workers="1")
        _go_on(first)
        _, stderr = first.communicate(timeout=170)
    assert first.returncode == 0, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    return {"out": out, "holder": holder, "intruder": intruder, **summary}


@pytest.mark.timeout(300)
def test_two_runs_into_one_out(reference: dict) -> None:
    out, intruder = reference["out"], reference["intruder"]
    assert intruder.returncode == 2
    err = intruder.stderr.strip().splitlines()
    assert len(err) == 1 and "is in use by another run" in err[0], intruder.stderr
    assert f"pid {reference['holder']['pid']}" in err[0]
    # The run that holds the directory was not disturbed: its identity is its own.
    assert json.loads((out / "run.json").read_text())["seed"] == 0
    # Once it is done, a new run still may not overwrite it, nor resume it as another.
    again = _run(out, "--seed", "1", workers="1")
    assert again.returncode == 2 and "already holds a run" in again.stderr
    other = _run(out, "--seed", "1", "--resume", workers="1")
    assert other.returncode == 2 and "seed: checkpoint has 0, this run has 1" in other.stderr


@pytest.mark.timeout(300)
def test_resume_of_a_finished_run_changes_nothing(reference: dict) -> None:
    out = reference["out"]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = _run(out, "--resume")
    assert res.returncode == 0, res.stderr
    assert f"already reached step {STEPS}; nothing was changed" in res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.timeout(300)
def test_a_killed_worker_rank_fails_the_run_and_resume_loses_nothing(
    reference: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    with _cleaned_up(_start(out)) as p:
        _wait_for_checkpoint(out, p, 20)
        _pause(p)
        ranks = _ranks_of(p.pid)
        assert set(ranks) == {0, 1}  # named for ps: thinwire-rank0, thinwire-rank1
        os.kill(ranks[1], signal.SIGKILL)
        _go_on(p)
        _, stderr = p.communicate(timeout=60)
    assert p.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("thinwire: error: rank 1 exited with code -9 before reporting"), stderr
    assert "Traceback" not in stderr, stderr
    assert _gone(ranks[0], 15)  # the launcher stopped the other rank
    assert not (out / "summary.json").exists()  # not reported as done
    latest = ckpt.latest_step(out)
    assert latest is not None and latest < STEPS
    run_id = ckpt.read_run_id(out)
    for r in (0, 1):
        assert ckpt.load_rank_state(out, latest, r, run_id)["step"] == latest
    _resume_matches(out, reference)


@pytest.mark.timeout(300)
def test_a_killed_launcher_takes_its_ranks_along_and_resume_loses_nothing(
    reference: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    with _cleaned_up(_start(out)) as p:
        _wait_for_checkpoint(out, p, 20)
        _pause(p)
        ranks = _ranks_of(p.pid)
        assert set(ranks) == {0, 1}
        p.send_signal(signal.SIGKILL)  # the launcher cannot catch this
        p.wait(timeout=30)
        _go_on(p)  # the ranks find their launcher gone
        p.communicate(timeout=30)  # EOF once the ranks, which share its pipes, are gone
    for pid in ranks.values():
        assert _gone(pid, 15), f"rank pid {pid} outlived its launcher"
    assert runlock.holder(out) is None  # the lock died with rank 0
    assert not (out / "summary.json").exists()
    _resume_matches(out, reference)
