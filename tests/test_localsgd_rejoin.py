"""A killed worker process rejoins a running asynchronous Local-SGD run; bad rejoins fail fast.

Every rank is its own process (as under a per-machine launch): the server runs the real
``run``, the launched workers the real ``work_loop`` with a hook, and the restarted worker
is ``thinwire train ... --rejoin 2``, a fresh interpreter that never joins the launch's
process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import TINY_FLAGS, process, tiny_async_config
from thinwire.cli.main import main as cli_main
from thinwire.comm.launch import free_port
from thinwire.comm.start_method import context
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.messages import Hello, RunInfo, Work
from thinwire.localsgd.runtime.auth import RunKey, read_token
from thinwire.localsgd.runtime.launch import make_worker, open_transport
from thinwire.localsgd.runtime.transport import Transport
from thinwire.localsgd.runtime.worker_loop import work_loop
from thinwire.train.async_task import async_config, gpt_task, rejoin, run
from thinwire.train.config import TrainConfig

# The run's settings, once as command-line options (for the rejoining process) and once
# as a config (for the launched ranks); the test asserts they agree.
_ARGS = [
    "--algo",
    "async-diloco",
    "--model",
    "tiny",
    *TINY_FLAGS,
    "--steps",
    "12",
    "--local-steps",
    "2",
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--eval-interval",
    "6",
    "--eval-sequences",
    "8",
    "--checkpoint-interval",
    "4",
    "--device",
    "cpu",
    "--no-progress",
]


def _cfg(out_dir: Path, **kw: Any) -> TrainConfig:
    return tiny_async_config(out_dir, **({"dead_after_s": 3.0} | kw))


def _worker(cfg: TrainConfig, rank: int, workers: int) -> LocalWorker:
    return make_worker(gpt_task(cfg), async_config(cfg), rank, workers)


def _rank_main(
    rank: int, world: int, port: int, cfg: TrainConfig, role: str, events: Any, results: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        if role == "server":
            results.put((rank, run(cfg)))
            return
        transport = open_transport(async_config(cfg))[0]
        deadline = time.monotonic() + 90

        def hook(rounds: int) -> None:
            if role == "victim":
                # One round done and not yet pushed: signal, then wait to be killed.
                events["victim"].set()
                time.sleep(600)
            elif role == "survivor" and rounds == 1:
                # Hold the budget back until the restarted worker 2 is alive (its
                # heartbeat moved), so that it is certain to get rounds of its own.
                while transport.heartbeat(2, 2) < 2:
                    if time.monotonic() > deadline:
                        raise TimeoutError("worker 2 did not come back")
                    time.sleep(0.1)
            elif role == "stalled" and rounds == 1:
                # Alive but stalled while a new process takes over as worker 2; then push
                # the round it computed, which the server must ignore.
                events["victim"].set()
                while transport.heartbeat(2, 2) < 2:
                    if time.monotonic() > deadline:
                        raise TimeoutError("worker 2 was never replaced")
                    time.sleep(0.1)
            elif role in ("paused", "held") and rounds == 1 and not events["go"].wait(90):
                # (The wait keeps the run going while bad rejoins are tried against it.)
                raise TimeoutError("the test never released the run")

        try:
            out = work_loop(_worker(cfg, rank, world - 1), transport, on_round=hook)
        except RuntimeError as exc:
            out = {"error": str(exc).splitlines()[0]}
            events["go"].set()  # a replaced worker's push has been read by now
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _start(cfg: TrainConfig, roles: list[str], events: dict[str, Any]) -> tuple[Any, list, int]:
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        process(_rank_main, r, len(roles), port, cfg, role, events, results)
        for r, role in enumerate(roles)
    ]
    for p in procs:
        p.start()
    return results, procs, port


def _collect(results: Any, want: set[int], deadline: float) -> dict[int, Any]:
    got: dict[int, Any] = {}
    while set(got) != want and time.monotonic() < deadline:
        try:
            r, out = results.get(timeout=1)
            got[r] = out
        except Exception:
            continue
    return got


def _reap(procs: list) -> list[int | None]:
    """Join every process; kill (and report as None) any that hangs."""
    codes: list[int | None] = []
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


@pytest.mark.timeout(180)
def test_killed_worker_process_rejoins(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    ctx = context()
    events = {"victim": ctx.Event(), "go": ctx.Event()}
    results, procs, port = _start(cfg, ["server", "survivor", "victim"], events)
    rejoiner: subprocess.Popen[str] | None = None
    try:
        assert events["victim"].wait(90), "worker 2 never finished a round"
        os.kill(procs[2].pid, signal.SIGKILL)  # mid-run: a round computed, never pushed
        procs[2].join(timeout=10)
        assert procs[2].exitcode == -signal.SIGKILL
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rejoiner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "thinwire",
                "train",
                *_ARGS,
                "--out",
                str(tmp_path),
                "--rejoin",
                "2",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        got = _collect(results, {0, 1}, time.monotonic() + 120)
        out, err = rejoiner.communicate(timeout=60)
    finally:
        if rejoiner is not None and rejoiner.poll() is None:
            rejoiner.kill()
        codes = _reap(procs)
    assert codes[:2] == [0, 0], codes  # server and survivor exit on their own, no hang
    assert rejoiner.returncode == 0, err
    assert "worker 2 (incarnation 2)" in out
    summary = got[0]
    budget = cfg.steps * 2
    assert summary["inner_steps"] == budget
    assert summary["dead_workers"] == []  # worker 2 is back, not dead
    assert summary["incarnations"] == {1: 1, 2: 2}
    assert [j["incarnation"] for j in summary["joins"] if j["worker"] == 2] == [1, 2]
    pushes = {(u["worker"], u["incarnation"]): u for u in summary["updates_by_incarnation"]}
    # The killed incarnation never pushed; the new one's pushes were applied after restart.
    assert (2, 1) not in pushes
    assert pushes[(2, 2)]["updates"] >= 1
    # The killed worker's unfinished round was handed out again: the budget is met exactly
    # by the survivor and the restarted worker.
    rejoined_steps = int(out.split("rounds, ")[1].split(" inner")[0])
    assert pushes[(2, 2)]["inner_steps"] == rejoined_steps
    assert got[1]["steps"] + rejoined_steps == budget


def _rejoin_main(port: int, cfg: TrainConfig, results: Any) -> None:
    torch.set_num_threads(1)
    results.put(("rejoined", rejoin(cfg, 2, host="127.0.0.1", port=port, force=True)))


@pytest.mark.timeout(150)
def test_forced_rejoin_replaces_a_stalled_worker(tmp_path: Path) -> None:
    # The stall is not a death (dead_after_s); the new worker 2 is slowed down, and worker
    # 1 held until the old one has pushed, so that the budget outlasts the stale push.
    cfg = _cfg(tmp_path, slowdown=(1.0, 20.0), dead_after_s=30.0)
    ctx = context()
    events = {"victim": ctx.Event(), "go": ctx.Event()}
    results, procs, port = _start(cfg, ["server", "held", "stalled"], events)
    try:
        assert events["victim"].wait(90), "worker 2 never finished a round"
        procs.append(process(_rejoin_main, port, cfg, results))
        procs[-1].start()
        got = _collect(results, {0, 1, 2, "rejoined"}, time.monotonic() + 120)
    finally:
        codes = _reap(procs)
    assert codes == [0, 0, 0, 0]  # nobody hangs; the replaced process returns an error
    assert "error" in got[2]  # cut off when it pushed to a link the server had closed
    summary = got[0]
    assert summary["incarnations"] == {1: 1, 2: 2}
    assert summary["stale_messages"] >= 1  # its push header was read and ignored
    pushes = {(u["worker"], u["incarnation"]): u for u in summary["updates_by_incarnation"]}
    assert (2, 1) not in pushes
    assert pushes[(2, 2)]["inner_steps"] == got["rejoined"]["steps"] > 0
    assert summary["inner_steps"] == got[1]["steps"] + got["rejoined"]["steps"] == cfg.steps * 2


_KEY = RunKey.from_token(b"the token of the slow test")


def _slow_server(port: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    t = Transport(store, rank=0, run_id="slow", key=_KEY, connect_timeout_s=2, timeout_s=60)
    t.publish(RunInfo(workers=1, numel=4, checksum=0, shards=1))
    while (env := t.poll()) is None:
        time.sleep(0.01)
    assert env.message == Hello(numel=4, checksum=0)
    t.accept(env.src, env.incarnation)
    time.sleep(5)  # longer than the connect timeout: the worker must still be waiting
    t.send(1, Work(epoch=7, version=0), torch.arange(4.0))
    results.put(("server", t.poll() is None))
    t.close()
    time.sleep(1)  # keep the store up until the worker has read everything


@pytest.mark.timeout(60)
def test_link_waits_longer_than_its_connect_timeout() -> None:
    port = free_port()
    ctx = context()
    results = ctx.Queue()
    server = process(_slow_server, port, results)
    server.start()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        t = Transport(store, rank=1, run_id="slow", key=_KEY, connect_timeout_s=2, timeout_s=60)
        assert t.run_info().workers == 1
        t.send(0, Hello(numel=4, checksum=0))  # opens the link
        msg = t.recv(0)
        assert msg == Work(epoch=7, version=0)
        assert torch.equal(t.recv_payload(0, 4, torch.float32), torch.arange(4.0))
        assert t.incarnation == 1
        t.close()
    finally:
        assert _reap([server]) == [0]
    assert results.get(timeout=5) == ("server", True)


@pytest.mark.timeout(150)
def test_bad_rejoins_fail_fast_and_leave_the_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A paused worker must keep looking alive on a loaded machine: a longer silence.
    cfg = _cfg(tmp_path, dead_after_s=8.0)
    ctx = context()
    events = {"victim": ctx.Event(), "go": ctx.Event()}
    results, procs, port = _start(cfg, ["server", "paused", "paused"], events)
    host = "127.0.0.1"
    try:
        # The run is up once the server has registered it (after every launched rank
        # joined), published its settings and kept its generated token: poll for that, as
        # a restarted worker arriving this early would have to.
        deadline = time.monotonic() + 60
        while True:
            try:
                token = read_token(run_dir=str(tmp_path))
                key = None if token is None else RunKey.from_token(token)
                probe = Transport.rejoin(host, port, 1, key, connect_timeout_s=60)
                break
            except ConfigError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert (tmp_path / "run.token").stat().st_mode & 0o777 == 0o600
        info = probe.run_info()
        assert (info.workers, info.finished) == (2, False)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=r"has workers 1\.\.2"):
            rejoin(cfg, 3, host=host, port=port)
        with pytest.raises(ConfigError, match="rank 0 is the server"):
            rejoin(cfg, 0, host=host, port=port)
        with pytest.raises(ConfigError, match="rejoin with the run's model settings"):
            rejoin(_cfg(tmp_path, n_layer=2), 1, host=host, port=port)
        with pytest.raises(ConfigError, match="into 6 shards, the run into 2; rejoin with"):
            rejoin(_cfg(tmp_path, shards=6), 1, host=host, port=port)
        with pytest.raises(ConfigError, match="slowdown lists 3 factors"):
            rejoin(_cfg(tmp_path, slowdown=(1.0, 1.0, 1.0)), 1, host=host, port=port)
        # No token (another --out), a wrong one: refused before a word is sent.
        with pytest.raises(ConfigError, match="admits only workers that hold its token"):
            rejoin(_cfg(tmp_path / "elsewhere"), 1, host=host, port=port)
        with monkeypatch.context() as env:
            env.setenv("THINWIRE_RUN_TOKEN", "not-the-token-of-this-run")
            with pytest.raises(ConfigError, match="not the token of the run at"):
                rejoin(cfg, 1, host=host, port=port)
        # The right token, but worker 1 is alive (paused, heartbeating): refused.
        with pytest.raises(ConfigError, match=r"worker 1 is alive.*--force-rejoin"):
            rejoin(cfg, 1, host=host, port=port)
        assert time.monotonic() - t0 < 30  # clear errors, not timeouts
        # No run at all at an address: a clear error after the connect timeout.
        with pytest.raises(ConfigError, match="cannot reach the run's store"):
            rejoin(cfg, 1, host=host, port=free_port(), connect_timeout_s=2)
        # The CLI flag is for asynchronous runs only, and says so in one line.
        assert cli_main(["train", "--algo", "diloco", "--rejoin", "1"]) == 2
        events["go"].set()
        got = _collect(results, {0, 1, 2}, time.monotonic() + 90)
    finally:
        events["go"].set()
        codes = _reap(procs)
    assert codes == [0, 0, 0]
    summary = got[0]
    # None of the bad rejoins said hello: the launched workers finished the run alone.
    assert summary["inner_steps"] == cfg.steps * 2
    assert summary["incarnations"] == {1: 1, 2: 1}
    assert summary["stale_messages"] == 0
    assert summary["refused_rejoins"] == 1  # the live worker 1 was kept
    assert summary["unauthenticated_messages"] == 0  # the others never said a word
    # A finished run turns late joiners away (the server's store may outlive the server
    # under some launchers; here it is gone, which is just as clear).
    with pytest.raises(ConfigError, match=r"has finished|cannot reach"):
        rejoin(cfg, 1, host=host, port=port, connect_timeout_s=2)


def test_cli_arguments_match_the_test_config(tmp_path: Path) -> None:
    from thinwire.cli.main import build_parser
    from thinwire.cli.train import config_from_args

    args = build_parser().parse_args(["train", *_ARGS, "--out", str(tmp_path)])
    from_cli = config_from_args(args).to_dict()
    direct = _cfg(tmp_path).to_dict()
    for key in from_cli.keys() - {"dead_after_s"}:  # a server setting, with no flag
        assert from_cli[key] == direct[key], key


class _Stop(Exception):
    """The rejoin was seen as far as its worker."""


def test_a_rejoined_worker_reads_on_after_the_pretraining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker brought back into a run that started from a pretraining reads its shards
    on after the pretraining's batches, as the launched workers do: none comes back as
    new. (The run's store is stood in for: only the worker that is built is looked at.)"""
    from thinwire.localsgd.runtime import rejoin as module
    from thinwire.localsgd.task import make_sources

    cfg = _cfg(tmp_path, pretrain_steps=5)
    acfg = async_config(cfg)

    class _Link:
        def run_info(self) -> Any:
            return type("Info", (), {"finished": False, "workers": 2})()

    def built(task: Any, cfg: Any, rank: int, workers: int) -> Any:
        first = make_sources(task, acfg.resolved_shards(workers))[0](0)
        raise _Stop(first)

    monkeypatch.setattr(module.Transport, "rejoin", staticmethod(lambda *a, **k: _Link()))
    monkeypatch.setattr(module, "make_worker", built)
    monkeypatch.setattr(module, "read_token", lambda *a, **k: None)
    task = gpt_task(cfg)
    with pytest.raises(_Stop) as stop:
        module.rejoin_async(task, acfg, 1, host="127.0.0.1", port=1)
    after = make_sources(task, acfg.resolved_shards(2))[0](5)  # the batch after step 5
    assert all(torch.equal(a, b) for a, b in zip(stop.value.args[0], after, strict=True))
