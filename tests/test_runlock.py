"""One run per output directory: the lock on --out, existing runs, writable paths."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from thinwire import rundir, runlock
from thinwire.errors import ConfigError
from thinwire.train.metrics import MetricsWriter


def test_a_second_claim_names_the_holder_and_a_release_frees_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    lock = runlock.acquire(out, command="thinwire train --out run")
    assert lock.held and lock.took_over is None
    with pytest.raises(ConfigError) as err:
        runlock.acquire(out)
    msg = str(err.value)
    assert "\n" not in msg and "in use by another run" in msg
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "thinwire train --out run" in msg
    assert runlock.holder(out)["pid"] == os.getpid()
    lock.release()
    assert runlock.holder(out) is None
    with runlock.acquire(out) as again:  # free again; a clean release leaves nothing stale
        assert again.took_over is None


@pytest.mark.timeout(60)
def test_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import time
        from thinwire.runlock import acquire
        acquire({str(out)!r}, command="the doomed run")
        print("held", flush=True)
        time.sleep(60)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {child.pid} on .*the doomed run"):
            runlock.acquire(out)
        child.send_signal(signal.SIGKILL)  # no chance to release
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    assert json.loads((out / runlock.LOCK_NAME).read_text())["pid"] == child.pid  # stale
    with runlock.acquire(out) as lock:
        assert lock.took_over is not None and f"pid {child.pid}" in lock.took_over


def test_without_flock_a_live_record_holds_and_a_dead_one_is_stale(tmp_path: Path) -> None:
    host = socket.gethostname()
    live = {"pid": os.getppid(), "host": host, "started": 0, "command": "x"}
    with pytest.raises(ConfigError, match="cannot lock files"):
        runlock._judge_record(tmp_path, live)
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    dead = {"pid": int(dead_pid), "host": host, "started": 0, "command": "y"}
    assert "pid" in (runlock._judge_record(tmp_path, dead) or "")
    other_host = {"pid": 1, "host": host + "-elsewhere", "started": 0, "command": "z"}
    with pytest.raises(ConfigError, match="elsewhere"):
        runlock._judge_record(tmp_path, other_host)
    assert runlock._judge_record(tmp_path, {}) is None


@pytest.mark.parametrize(
    "files",
    [
        ["run.json"],
        ["metrics.jsonl"],
        ["summary.json"],
        ["localsgd_server.pt"],
        ["checkpoints/LATEST"],
    ],
)
def test_any_earlier_run_is_found(tmp_path: Path, files: list[str]) -> None:
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    assert rundir.existing_run(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds a run .*--resume"):
        rundir.refuse_existing_run(tmp_path)


def test_an_empty_or_unrelated_directory_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert rundir.existing_run(tmp_path) == []
    rundir.refuse_existing_run(tmp_path)


def test_the_metrics_writer_never_deletes_another_runs_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="another run's metrics"):
        MetricsWriter(tmp_path, True, resume_step=None)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 7, "loss": 1.0}\n'


def test_unwritable_output_paths_are_one_line_errors(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        rundir.writable_dir(afile)
    with pytest.raises(ConfigError, match=r"cannot write to --out .*Not a directory"):
        rundir.writable_dir(afile / "sub")
    with pytest.raises(ConfigError, match="is a directory; give a file name"):
        rundir.writable_file(tmp_path)
    with pytest.raises(ConfigError, match=r"afile is a file, not a directory"):
        rundir.writable_file(afile / "sub" / "out.json")
    with pytest.raises(ConfigError, match=r"cannot write to output directory .*Not a directory"):
        runlock.acquire(afile / "run")
    assert rundir.writable_dir(tmp_path / "new" / "dir").is_dir()
    assert not list((tmp_path / "new" / "dir").iterdir())  # the probe file is gone
