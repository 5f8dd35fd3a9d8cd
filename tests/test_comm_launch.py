"""Local spawning, process-group lifecycle, and byte accounting of the plain allreduce."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from thinwire.comm import COUNTER, DistributedError, all_reduce_mean_, spawn
from thinwire.comm.accounting import gather_bytes, ring_allreduce_bytes
from thinwire.comm.allreduce import sum_small_


def _mean_of_ranks(rank: int, world: int) -> tuple[torch.Tensor, dict]:
    x = torch.full((10,), float(rank))
    all_reduce_mean_(x)
    return x, COUNTER.snapshot()


def _raise_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad thing on rank one")
    dist.barrier()  # rank 0 would hang here forever without the launcher's cleanup
    return rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_spawn_allreduce_mean_and_bytes(world: int) -> None:
    results = spawn(_mean_of_ranks, world, timeout_s=100)
    expected = sum(range(world)) / world
    for x, snap in results:
        torch.testing.assert_close(x, torch.full((10,), expected))
        assert snap["allreduce"]["calls"] == 1
        assert snap["allreduce"]["payload_bytes"] == 40
        assert snap["allreduce"]["wire_bytes"] == ring_allreduce_bytes(40, world)


def _small_sums(rank: int, world: int) -> tuple[list[float], list[float], dict, int]:
    COUNTER.reset()
    loss = torch.tensor([0.1 * (rank + 1)], dtype=torch.float32)  # as the trainer logs it
    counts = torch.tensor([[rank, 1.0], [2.0 * rank, 3.0]], dtype=torch.float64)
    big = torch.tensor([2**53 + 1], dtype=torch.int64)  # past float64's exact integers
    sum_small_(loss, op_name="t.loss")
    sum_small_(counts, op_name="t.counts")
    sum_small_(big, op_name="t.big")
    return loss.tolist(), counts.flatten().tolist(), COUNTER.snapshot(), int(big)


@pytest.mark.timeout(120)
def test_small_sums_take_one_step_and_agree_on_every_rank() -> None:
    results = spawn(_small_sums, 3, timeout_s=100)
    losses, counts, snaps, bigs = zip(*results, strict=True)
    assert set(bigs) == {3 * (2**53 + 1)}  # integers add exactly
    assert len({tuple(v) for v in losses}) == 1  # bit-identical on every rank
    assert losses[0][0] == pytest.approx(0.6, rel=1e-6)
    assert list(counts) == [[3.0, 3.0, 6.0, 9.0]] * 3
    for snap in snaps:  # each rank sends its numbers to its 2 peers
        assert snap["t.loss"]["wire_bytes"] == 2 * 8
        assert snap["t.counts"]["wire_bytes"] == 2 * 4 * 8
    assert sum_small_(torch.ones(2)).tolist() == [1.0, 1.0]  # one process: unchanged


@pytest.mark.timeout(120)
def test_failing_rank_is_reported_not_hung() -> None:
    with pytest.raises(DistributedError, match="rank 1 failed: ValueError: bad thing on rank one"):
        spawn(_raise_on_rank_one, 2, timeout_s=100)


def _rank_one_dies(rank: int, world: int, how: str, marker: str) -> int:
    if rank == 1:
        Path(marker).touch()
        if how == "exit":
            os._exit(9)  # as a SIGKILLed process: no result, no goodbye
        raise ValueError("worker gave up")
    # The survivor finishes after the failure was noticed: it waits for rank 1 to reach
    # it (ranks start far apart on a loaded machine), then gives the launcher a second.
    deadline = time.monotonic() + 60
    while not Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    return 10 + rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["exit", "raise"])
def test_ranks_that_may_fail_do_not_end_the_run(
    how: str, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = (how, str(tmp_path / "tolerated"))
    assert spawn(_rank_one_dies, 2, args, timeout_s=100, may_fail={1}) == [10, None]
    err = capfd.readouterr().err
    assert "rank 1" in err and "the run continues without it" in err
    # Without the allowance the same failure still ends the run with a clear error.
    with pytest.raises(DistributedError, match="rank 1"):
        spawn(_rank_one_dies, 2, (how, str(tmp_path / "fatal")), timeout_s=100)


def test_byte_formulas() -> None:
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 4) == 1500
    assert gather_bytes(1000, 4) == 750


def _where_am_i(rank: int, world: int) -> dict[str, object]:
    return {
        "env": os.environ.get("THINWIRE_TEST_MARK"),
        "extra": os.environ.get("THINWIRE_TEST_EXTRA"),
        "cwd": os.getcwd(),
        "parent": os.getppid(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_get_the_launchers_environment_and_directory_as_they_are_now(
    method: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fork server (the default) was started earlier, from another directory and
    # environment: each rank must still see the launcher's, as a fresh interpreter would.
    from thinwire.comm.start_method import ENV

    monkeypatch.setenv(ENV, method)
    spawn(_where_am_i, 1)  # a server, if any, starts before the changes below
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("THINWIRE_TEST_MARK", method)
    for out in spawn(_where_am_i, 2, env={"THINWIRE_TEST_EXTRA": "given"}):
        assert out["env"] == method and out["extra"] == "given"
        assert out["cwd"] == str(tmp_path)
        # a fresh interpreter is the launcher's child; a forked rank the server's
        assert (out["parent"] == os.getpid()) == (method == "spawn")


def test_an_unknown_start_method_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from thinwire.comm.start_method import ENV
    from thinwire.errors import ConfigError

    monkeypatch.setenv(ENV, "fork")
    with pytest.raises(ConfigError, match="THINWIRE_START_METHOD='fork' is not a start method"):
        spawn(_where_am_i, 2)


_EARLY = """
import os, sys
import thinwire.cli.entry as entry
assert "torch" not in sys.modules, "the entry point imported torch"
print(entry.starts_ranks(["train"]), entry.starts_ranks(["compare", "a"]),
      entry.starts_ranks(["train", "--help"]), entry.starts_ranks(["analyze", "report"]))
entry_pid = None
if entry.starts_ranks(["train"]):
    from multiprocessing import forkserver
    from thinwire.prestart import warm_up
    warm_up()
    entry_pid = forkserver._forkserver._forkserver_pid
    assert "torch" not in sys.modules  # the server imports it, in the background
from thinwire.comm.launch import spawn
parents = spawn(_parent, 2)
print(entry_pid is not None and set(parents) == {entry_pid})
"""


@pytest.mark.timeout(120)
def test_the_command_starts_the_fork_server_before_it_imports_torch(tmp_path: Path) -> None:
    # The ranks of a `thinwire train` fork from the server its entry point started, not
    # from one started at the launch (after the command's own torch import).
    script = tmp_path / "early.py"
    script.write_text(
        "import os\n\ndef _parent(rank, world):\n    return os.getppid()\n\n"
        "if __name__ == '__main__':\n    from early import _parent\n"
        + textwrap.indent(_EARLY, "    ")
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "False", "False", "True"]
    under_torchrun = subprocess.run(
        [sys.executable, "-c", "import thinwire.cli.entry as e; print(e.starts_ranks(['train']))"],
        env=env | {"RANK": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert under_torchrun.stdout.split() == ["False"]
