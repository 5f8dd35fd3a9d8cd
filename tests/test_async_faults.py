"""Fault injection on loopback for asynchronous Local-SGD: strangers, bad pushes, deaths.

Each case asserts two things: no accepted update is lost (the updates credited to the
worker incarnations add up to the updates applied, and the inner steps to the budget),
and nothing is reported done that was not done (an incomplete run says so and exits
non-zero; a resume of a finished run changes no file).

* A stranger (no token, a wrong token) and an insider rejoining as a live worker, all
  with ``--lr 50`` (the issue's repro), plus a forged header written into the store.
* Workers holding the token that push NaN or a push 10,000 times too large.
* A worker killed; the only worker killed (then ``--resume``); the server killed (then
  ``--resume``); ``--stop-after`` then ``--resume``; ``--resume`` of a finished run.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from conftest import TINY_FLAGS, process, tiny_async_config
from thinwire.cli.main import main as cli_main
from thinwire.comm.launch import free_port, spawn
from thinwire.comm.start_method import context
from thinwire.localsgd import AsyncConfig, Task, run_async
from thinwire.localsgd.messages import Hello, Update, pack_queued
from thinwire.localsgd.runtime.auth import Channel, RunKey
from thinwire.localsgd.runtime.launch import make_worker, open_transport
from thinwire.localsgd.runtime.worker_loop import work_loop
from thinwire.train.async_task import async_config, gpt_task, run
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics

_MODEL = [
    "--model",
    "tiny",
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--warmup-steps",
    "2",
    "--eval-sequences",
    "8",
    "--device",
    "cpu",
    "--no-progress",
]
_TW = ["train", "--algo", "async-diloco", *_MODEL]
# Two workers slowed 8x, 60 steps: long enough to kill something mid-run.
_SLOW_RUN = [*_TW, "--workers", "3", "--steps", "60", "--local-steps", "2", "--slowdown", "8,8"]
_SLOW_RUN += ["--eval-interval", "6"]


def _eval_records_are_one_run(out: Path) -> list[dict[str, Any]]:
    recs = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"duplicated or unordered evaluations: {steps}"
    times = [r["time_s"] for r in recs]
    assert times == sorted(times), f"time_s goes backwards: {times}"
    return recs


# --- a stranger, a wrong token, a live worker, a forged header (the repro) ---------
def _cfg(out: Path, **kw: Any) -> TrainConfig:
    return tiny_async_config(out, **({"steps": 8, "eval_interval": 4, "dead_after_s": 3.0} | kw))


def _rank(rank: int, world: int, port: int, cfg: TrainConfig, events: Any, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        if rank == 0:
            results.put((0, run(cfg)))
            return
        acfg = async_config(cfg)

        def pause(rounds: int) -> None:
            if rounds == 1:  # mid-run, alive and beating, until the test is done with it
                events[rank].set()
                if not events["go"].wait(120):
                    raise TimeoutError("the test never released the run")

        out = work_loop(
            make_worker(gpt_task(cfg), acfg, rank, world - 1),
            open_transport(acfg)[0],
            on_round=pause,
        )
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def _attack(port: int, out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THINWIRE_RUN_TOKEN")} | env
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    args = [*_TW, "--steps", "8", "--local-steps", "2", "--eval-interval", "4"]
    return subprocess.Popen(
        [sys.executable, "-m", "thinwire", *args, "--lr", "50", "--out", str(out), "--rejoin", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _forge(port: int) -> None:
    """Write a forged push header and a forged hello into the run's store."""
    launch = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    where = json.loads(launch.get("thinwire.localsgd/current"))
    store = dist.TCPStore(where["host"], where["port"], is_master=False, wait_for_workers=False)
    queue = dist.PrefixStore(f"thinwire.localsgd/{where['run_id']}/", store)
    push = pack_queued(1, 1, Update(0, 2, 0.1, 1.0))
    queue.queue_push("to_server", push + os.urandom(88))  # worker 1's, with a made-up seal
    hello = pack_queued(2, 9, Hello(21_472, 0, late=True))
    guess = Channel(RunKey.from_token(b"a guess at the run's token"), where["run_id"], 2, 9)
    queue.queue_push("to_server", hello + guess.seal(hello))  # sealed with a wrong key


@pytest.mark.timeout(240)
def test_a_stranger_cannot_join_or_harm_the_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "a")
    ctx = context()
    events = {1: ctx.Event(), 2: ctx.Event(), "go": ctx.Event()}
    results, port = ctx.Queue(), free_port()
    procs = [process(_rank, r, 3, port, cfg, events, results) for r in range(3)]
    for p in procs:
        p.start()
    attackers: list[subprocess.Popen[str]] = []
    got: dict[int, Any] = {}
    try:
        assert events[1].wait(120) and events[2].wait(120), "the run did not start"
        token = tmp_path / "a" / "run.token"
        attackers = [
            _attack(port, tmp_path / "elsewhere", {}),  # no token
            _attack(port, tmp_path / "elsewhere", {"THINWIRE_RUN_TOKEN": "0123456789abcdef-wrong"}),
            _attack(port, tmp_path / "elsewhere", {"THINWIRE_RUN_TOKEN_FILE": str(token)}),
        ]
        _forge(port)
        outs = [a.communicate(timeout=150) for a in attackers]
        events["go"].set()
        while len(got) < 3:
            r, out = results.get(timeout=120)
            got[r] = out
    finally:
        events["go"].set()
        for a in attackers:
            if a.poll() is None:
                a.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [err.strip().splitlines()[-1] for _, err in outs]
    assert [a.returncode for a in attackers] == [2, 2, 2], errors
    assert "admits only workers that hold its token" in errors[0]
    assert "not the token of the run" in errors[1]
    assert "worker 1 is alive" in errors[2] and "--force-rejoin" in errors[2]
    s = got[0]
    assert s["incarnations"] == {1: 1, 2: 1}  # nobody else was admitted
    assert {(u["worker"], u["incarnation"]) for u in s["updates_by_incarnation"]} == {
        (1, 1),
        (2, 1),
    }
    assert sum(u["updates"] for u in s["updates_by_incarnation"]) == s["updates_applied"]
    assert sum(u["inner_steps"] for u in s["updates_by_incarnation"]) == s["inner_steps"] == 16
    assert s["unauthenticated_messages"] == 2 and s["refused_rejoins"] == 1
    assert s["pushes_refused"] == 0 and s["complete"]
    assert math.isfinite(s["final_val_loss"])
    assert not (tmp_path / "a" / "run.token").exists()  # the token is gone with the run


# --- token holders that push NaN, or 10,000x too much -----------------------------------------
_W = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    return x, x @ _W


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _shards(n: int) -> list[Any]:
    return [lambda step, i=i: _batch(1000 * step + i) for i in range(n)]


class _Loss:
    """MSE; with ``nan_after``, NaN from that call on (a worker that diverged)."""

    def __init__(self, nan_after: int | None = None) -> None:
        self.calls, self.nan_after = 0, nan_after

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        loss = F.mse_loss(model(batch[0]), batch[1])
        return loss * math.nan if self.nan_after and self.calls > self.nan_after else loss


class _Wild(torch.optim.AdamW):
    """AdamW whose every step after the first moves the weights 10,000x as far."""

    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        out = super().step(closure)
        self.wild = getattr(self, "wild", 0) + 1
        if self.wild > 1:
            with torch.no_grad():
                for p, b in zip(params, before, strict=True):
                    p.copy_(b + (p - b) * 1e4)
        return out


@torch.no_grad()
def _val(model: nn.Module) -> float:
    x, y = _batch(123_456)
    return float(F.mse_loss(model(x), y))


def _poisoned(rank: int, world: int, evicted: Any) -> Any:
    task = Task(
        model=_mlp,
        optimizer=lambda p: (_Wild if rank == 3 else torch.optim.AdamW)(p, lr=1e-2),
        shards=_shards,
        loss=_Loss(nan_after=1 if rank == 2 else None),
        evaluate=_val,
    )
    cfg = AsyncConfig(steps=20, local_steps=1, warmup_steps=0, push_warmup=1, dead_after_s=3.0)
    if rank == 0:
        return run_async(task, cfg)
    if rank == 1:  # the good worker holds its first round until both bad ones are out

        def hold(rounds: int) -> None:
            if rounds == 1 and not (evicted[2].wait(90) and evicted[3].wait(90)):
                raise TimeoutError("the bad workers were not stopped")

        worker = make_worker(task, cfg, rank, world - 1)
        return work_loop(worker, open_transport(cfg)[0], on_round=hold)
    try:
        return run_async(task, cfg)
    except Exception as exc:  # the evicted workers: their one-line reason
        return {"error": str(exc)}
    finally:
        evicted[rank].set()


@pytest.mark.timeout(150)
def test_nan_and_absurd_pushes_from_token_holders_are_refused() -> None:
    ctx = context()
    evicted = {2: ctx.Event(), 3: ctx.Event()}
    s, good, nan_worker, wild_worker = spawn(_poisoned, 4, (evicted,), timeout_s=120)
    # Each bad worker's first round was healthy and applied; then three refusals apiece,
    # and the server stopped it, saying why.
    assert s["push_refusals"] == {"non-finite": 3, "norm": 3}
    assert s["evicted_workers"] == [2, 3]
    for out in (nan_worker, wild_worker):
        assert "the server stopped worker" in out["error"]
    pushes = {(u["worker"], u["incarnation"]): u["updates"] for u in s["updates_by_incarnation"]}
    assert pushes[(2, 1)] == 1 and pushes[(3, 1)] == 1
    # No accepted update lost, no step counted that was refused: the good worker trained
    # the rest of the budget; the refused rounds were handed out again.
    assert sum(pushes.values()) == s["updates_applied"] == s["inner_steps"] == 60
    assert good["steps"] == 58
    assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] < _val(_mlp())


# --- deaths and resumes, through the command line ----------------------------------------------
def _launch(args: list[str], out: dict[str, Any]) -> threading.Thread:
    def target() -> None:
        out["rc"] = cli_main(args)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _kill_when(run_dir: Path, rank: int, records: int, thread: threading.Thread) -> None:
    """SIGKILL spawned rank ``rank`` once ``records`` evaluations are logged."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and thread.is_alive():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= records:
            victim = next(p for p in mp.active_children() if p.name == f"thinwire-rank{rank}")
            os.kill(victim.pid, signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError("the run ended before its rank could be killed")


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(200)
def test_a_killed_worker_loses_no_accepted_update(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        *_SLOW_RUN,
        "--dead-after",
        "2",
        "--out",
        str(out),
    ]
    res: dict[str, Any] = {}
    thread = _launch(args, res)
    _kill_when(out, 2, 2, thread)
    thread.join(timeout=150)
    assert res["rc"] == 0
    s = _summary(out)
    assert s["complete"] and 2 in s["dead_workers"] and s["inner_steps"] == 120
    assert sum(u["inner_steps"] for u in s["updates_by_incarnation"]) == 120
    assert sum(u["updates"] for u in s["updates_by_incarnation"]) == s["updates_applied"]
    _eval_records_are_one_run(out)


@pytest.mark.timeout(240)
def test_the_only_worker_killed_is_an_incomplete_run_that_resume_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = [
        *_TW,
        "--workers",
        "2",
        "--steps",
        "60",
        "--local-steps",
        "2",
        "--slowdown",
        "8",
        "--eval-interval",
        "6",
        "--checkpoint-interval",
        "6",
        "--dead-after",
        "2",
        "--out",
        str(out),
    ]
    res: dict[str, Any] = {}
    thread = _launch(args, res)
    _kill_when(out, 1, 2, thread)
    thread.join(timeout=150)
    err = capsys.readouterr().err
    assert res["rc"] == 1
    line = [x for x in err.splitlines() if x.startswith("thinwire: error:")][-1]
    assert "the run is incomplete: every worker is gone" in line and "--resume" in line
    first = _summary(out)
    assert first["complete"] is False and "incomplete" in first
    assert first["inner_steps"] < 60 and first["dead_workers"] == [1]
    ckpt = torch.load(out / "localsgd_server.pt", weights_only=True)
    assert ckpt["steps_applied"] == first["inner_steps"]  # every accepted update is in it
    res2: dict[str, Any] = {}
    _launch([*args, "--resume"], res2).join(timeout=150)
    assert res2["rc"] == 0
    s = _summary(out)
    assert s["complete"] and s["inner_steps"] == 60 and "incomplete" not in s
    assert s["updates_applied"] >= first["updates_applied"] + 1
    assert s["train_time_s"] > first["train_time_s"] and s["comm_bytes"] > first["comm_bytes"]
    _eval_records_are_one_run(out)


@pytest.mark.timeout(240)
def test_a_killed_server_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        *_SLOW_RUN,
        "--checkpoint-interval",
        "6",
        "--out",
        str(out),
    ]
    res: dict[str, Any] = {}
    thread = _launch(args, res)
    _kill_when(out, 0, 3, thread)
    thread.join(timeout=150)
    assert res["rc"] == 1 and not (out / "summary.json").exists()  # nothing claims done
    ckpt = torch.load(out / "localsgd_server.pt", weights_only=True)
    assert 0 < ckpt["steps_applied"] < 120
    res2: dict[str, Any] = {}
    _launch([*args, "--resume"], res2).join(timeout=150)
    assert res2["rc"] == 0
    s = _summary(out)
    assert s["complete"] and s["inner_steps"] == 120
    assert s["updates_applied"] > ckpt["updates_applied"]  # continued from every applied one
    assert s["comm_bytes"] > ckpt["run"]["comm_bytes"]
    assert s["train_time_s"] > ckpt["run"]["elapsed_s"]
    _eval_records_are_one_run(out)


@pytest.mark.timeout(240)
def test_stop_after_then_resume_then_resume_of_the_finished_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = [
        *_TW,
        "--workers",
        "3",
        "--steps",
        "8",
        "--local-steps",
        "2",
        "--eval-interval",
        "2",
        "--out",
        str(out),
    ]
    assert cli_main([*args, "--stop-after", "4"]) == 0
    first = _summary(out)
    assert first["stopped_after"] == 4 and first["complete"] is False
    assert first["inner_steps"] == 8  # exactly 4 steps per worker
    assert "async-diloco on 2 workers plus the server" in capsys.readouterr().out
    assert cli_main([*args, "--resume"]) == 0
    s = _summary(out)
    assert s["complete"] and s["inner_steps"] == 16 and "stopped_after" not in s
    # The whole run's time and bytes, not the resumed part's.
    assert s["train_time_s"] > first["train_time_s"] and s["comm_bytes"] > first["comm_bytes"]
    recs = _eval_records_are_one_run(out)
    assert recs[0]["step"] == 0 and recs[-1]["step"] == 16
    # A resume of the finished run trains nothing and rewrites nothing.
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert cli_main([*args, "--resume"]) == 0
    assert "already reached step 8; nothing was changed" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files


# --- bad settings: one line each, before anything starts ------------------------------------
@pytest.mark.parametrize(
    ("extra", "env", "match"),
    [
        (["--outer-lr", "0"], {}, r"outer-lr must be a number in \(0, inf\), got 0.0"),
        (["--outer-lr", "nan"], {}, r"outer-lr must be a number in \(0, inf\), got nan"),
        (["--outer-momentum", "2"], {}, r"outer-momentum must be a number in \[0, 1\), got 2.0"),
        (["--outer-momentum", "-1"], {}, r"outer-momentum must be a number in \[0, 1\), got -1.0"),
        (["--workers", "1"], {}, "needs at least 2 ranks: rank 0 is the server"),
        (["--shards", "0"], {}, "shards must be >= 1, got 0"),
        (["--slowdown", "1,2,3"], {}, "--slowdown lists 3 factors but there are 2 workers"),
        (["--dead-after", "-1"], {}, "dead_after_s must be > 0"),
        (["--stop-after", "0"], {}, "stop-after must be >= 1"),
        (["--force-rejoin"], {}, "--force-rejoin goes with --rejoin RANK"),
        ([], {"THINWIRE_RUN_TOKEN": "short"}, "has 5 characters; use at least 16"),
        ([], {"THINWIRE_RUN_TOKEN_FILE": "/nonexistent/t"}, "cannot read the run token file"),
        ([], {"THINWIRE_BIND_ADDR": "0.0.0.0"}, "THINWIRE_BIND_ADDR is 0.0.0.0 .the wildcard"),
        ([], {"THINWIRE_BIND_ADDR": "192.0.2.1"}, "which this host cannot listen on"),
    ],
)
def test_nonsense_async_settings_are_one_line_errors(
    extra: list[str],
    env: dict[str, str],
    match: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    workers = [] if "--workers" in extra else ["--workers", "3"]
    assert cli_main([*_TW, *workers, "--steps", "4", "--out", str(tmp_path / "r"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("thinwire: error:"), err
    assert re.search(match, err[0]), err[0]
    assert not (tmp_path / "r").exists()  # nothing was started, nothing written


# --- a --sync run stopped and resumed is the run that never stopped ----------------------------
@pytest.mark.timeout(240)
def test_sync_stop_and_resume_is_bit_identical_to_a_straight_run(tmp_path: Path) -> None:
    args = [*_TW, "--workers", "3", "--steps", "6", "--local-steps", "2", "--sync"]
    assert cli_main([*args, "--out", str(tmp_path / "straight")]) == 0
    chain = [*args, "--out", str(tmp_path / "chain")]
    assert cli_main([*chain, "--stop-after", "2"]) == 0
    first = _summary(tmp_path / "chain")
    # Each worker kept what it carries across rounds (its AdamW moments and step count).
    assert (tmp_path / "chain" / "localsgd_worker1.pt").is_file()
    assert cli_main([*chain, "--resume"]) == 0
    straight, resumed = _summary(tmp_path / "straight"), _summary(tmp_path / "chain")
    assert resumed["complete"] and resumed["inner_steps"] == straight["inner_steps"] == 12
    assert first["param_sha256"] != straight["param_sha256"]  # the digest sees a change
    assert resumed["param_sha256"] == straight["param_sha256"]
    assert resumed["final_val_loss"] == straight["final_val_loss"]


# --- token holders that push twice, or from another epoch: stopped, never waited for --------
def _misbehaving(rank: int, world: int, stopped: Any) -> Any:
    from thinwire.localsgd.runtime.transport import Transport

    task = Task(
        model=_mlp,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        shards=_shards,
        loss=_Loss(),
        evaluate=_val,
    )
    cfg = AsyncConfig(steps=20, local_steps=1, warmup_steps=0, max_push_ratio=0, dead_after_s=3.0)
    if rank == 0:
        t0 = time.monotonic()
        return run_async(task, cfg) | {"served_s": time.monotonic() - t0}
    if rank == 1:  # the good worker holds its first round until the bad one is out

        def hold(rounds: int) -> None:
            if rounds == 1 and not stopped.wait(60):
                raise TimeoutError("the misbehaving worker was not stopped")

        worker = make_worker(task, cfg, rank, world - 1)
        return work_loop(worker, open_transport(cfg)[0], on_round=hold)
    send, recv = Transport.send, Transport.recv
    pushed_twice = threading.Event()

    def twice(self: Transport, dst: int, msg: Any, payload: Any = None) -> Any:
        if isinstance(msg, Update):
            send(self, dst, msg, payload)  # every push twice, header and payload
            pushed_twice.set()
        return send(self, dst, msg, payload)

    def deaf(self: Transport, src: int) -> Any:
        # The Refused on the link is never read, as when the server closes the link while
        # this worker is busy sending (a round under way): the reason must come anyway.
        if pushed_twice.is_set():
            raise RuntimeError("Connection closed by peer")
        return recv(self, src)

    Transport.send, Transport.recv = twice, deaf  # type: ignore[method-assign]
    try:
        return run_async(task, cfg)
    except Exception as exc:  # the stopped worker: its one-line reason
        return {"error": str(exc)}
    finally:
        stopped.set()


@pytest.mark.timeout(150)
def test_a_push_sent_twice_stops_its_sender_at_once_and_nothing_waits() -> None:
    # Before, the server's send of the next round and the worker's send of the copy
    # waited on each other until the link timeout: 98 s for a run of 16.
    stopped = context().Event()
    s, good, twice = spawn(_misbehaving, 3, (stopped,), timeout_s=120)
    # Refused before its payload could matter, counted, and its sender stopped. The
    # first copy is applied if it was in before the second was announced.
    assert s["push_refusals"] == {"duplicate": 1}
    assert s["evicted_workers"] == [2]
    assert "the last one for duplicate" in twice["error"]
    pushes = {(u["worker"], u["incarnation"]): u["updates"] for u in s["updates_by_incarnation"]}
    assert pushes.get((2, 1), 0) <= 1
    assert sum(pushes.values()) == s["updates_applied"] == s["inner_steps"] == 40
    assert good["steps"] == 40 - pushes.get((2, 1), 0)  # the refused round was redone
    # Nothing waited on them: no link timeout (30 minutes) or dead-worker wait.
    assert s["served_s"] < 60
