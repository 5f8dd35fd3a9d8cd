"""Asynchronous Local-SGD on real ranks: runs, survives a killed worker, resumes, rejects bad input."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import process, tiny_async_config
from thinwire.comm.launch import DistributedError, free_port, spawn
from thinwire.comm.start_method import context
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.inner_state import resolve_inner_momentum
from thinwire.localsgd.algorithm.server_core import Work
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.runtime.launch import make_worker, open_transport
from thinwire.localsgd.runtime.worker_loop import work_loop
from thinwire.localsgd.task import shape_signature
from thinwire.train.async_task import async_config, check_async_config, gpt_loss, gpt_task, run
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import read_metrics
from thinwire.train.model import GPT, GPTConfig


def _cfg(out_dir: Path, **kw: Any) -> TrainConfig:
    return tiny_async_config(
        out_dir, **({"steps": 6, "eval_interval": 3, "checkpoint_interval": 2} | kw)
    )


def _run_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    return run(cfg)


@pytest.mark.smoke  # the fast lane's Local-SGD run
@pytest.mark.timeout(150)
def test_async_run_completes(tmp_path: Path) -> None:
    # From a short pretraining, as a long run would start (thinwire train's whole path).
    cfg = _cfg(
        tmp_path, outer="dn", dylu=True, slowdown=(1.0, 2.0), compress="bf16", pretrain_steps=4
    )
    out = spawn(_run_rank, 3, (cfg,), timeout_s=120)
    summary = out[0]
    assert summary["start"] == "after 4 steps of ordinary training"
    assert summary["inner_steps"] == cfg.steps * 2
    assert summary["updates_applied"] >= cfg.steps * 2 // cfg.local_steps
    assert summary["updates_rejected"] == 0
    assert summary["inner_momentum"] == "keep"  # the default from a trained model
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["step"] == 0 and records[-1]["step"] == cfg.steps * 2
    assert summary["final_val_loss"] < records[0]["val_loss"] - 0.05  # it learned something
    assert summary["comm_by_op"]["localsgd.pull"]["calls"] >= summary["updates_applied"]
    assert sum(w["steps"] for w in out[1:]) == cfg.steps * 2
    assert (tmp_path / "localsgd_server.pt").exists()


@pytest.mark.timeout(200)
def test_resume_continues_from_checkpoint(tmp_path: Path) -> None:
    first = spawn(_run_rank, 3, (_cfg(tmp_path, steps=4),), timeout_s=120)[0]
    blob = torch.load(tmp_path / "localsgd_server.pt", weights_only=False)
    assert blob["steps_applied"] == 8 and blob["epoch"] == 0
    second = spawn(_run_rank, 3, (_cfg(tmp_path, steps=8, resume=True),), timeout_s=120)[0]
    assert second["inner_steps"] == 16
    assert second["updates_applied"] > first["updates_applied"]
    blob = torch.load(tmp_path / "localsgd_server.pt", weights_only=False)
    assert blob["epoch"] == 1 and blob["steps_applied"] == 16
    assert blob["outer"]["state"][0]["step"] == second["updates_applied"]


# --- a worker killed mid-run ----------------------------------------------------------------
def _rank_main(
    rank: int, world: int, port: int, cfg: TrainConfig, kill_rank: int, results: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if rank == kill_rank:
        # Train like any worker, then die abruptly (no goodbye, no cleanup).
        worker = make_worker(gpt_task(cfg), async_config(cfg), rank, world - 1)

        def die(rounds: int) -> None:
            os._exit(17)  # after its first round, before pushing it

        work_loop(worker, open_transport(async_config(cfg))[0], on_round=die)
        raise AssertionError("unreachable: the worker died")
    out = run(cfg)
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_killed_worker_does_not_stop_the_run(tmp_path: Path) -> None:
    # 30 steps per worker: long enough that the victim, however late its process starts,
    # gets a round before the two survivors could spend the whole budget (with 10 they
    # sometimes did, and the victim was told to stop before it could die).
    cfg = _cfg(tmp_path, steps=30, dead_after_s=5.0)
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [process(_rank_main, r, 4, port, cfg, 3, results) for r in range(4)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 120
    try:
        while len(got) < 3 and time.monotonic() < deadline:
            try:
                r, out = results.get(timeout=1)
                got[r] = out
            except Exception:
                continue
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert procs[3].exitcode == 17
    assert set(got) == {0, 1, 2}
    summary = got[0]
    assert summary["dead_workers"] == [3]
    # The survivors meet the budget; the dead worker's lost round was handed out again.
    assert summary["inner_steps"] == cfg.steps * 3
    assert got[1]["steps"] + got[2]["steps"] == cfg.steps * 3


# --- bad input: clear errors at start, never a hang ----------------------------------------
@pytest.mark.timeout(120)
def test_bad_slowdown_fails_fast_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(DistributedError, match="slowdown lists 3 factors but there are 2 workers"):
        spawn(_run_rank, 3, (_cfg(tmp_path, slowdown=(1.0, 2.0, 3.0)),), timeout_s=100)


@pytest.mark.parametrize(
    ("kw", "workers", "match"),
    [
        ({"local_steps": 0}, 2, "local-steps must be >= 1"),
        ({"c": 0.9}, 2, r"c must be in \[0, 1/N\]"),
        ({"outer": "adam"}, 2, "unknown outer optimizer"),
        ({"compress": "int3"}, 2, "compress must be one of none, fp16, bf16, onebit"),
        ({"compress_pull": "int3"}, 2, "compress-pull must be one of none, fp16, bf16, onebit"),
        ({"speeds": (1.0,)}, 2, "--speeds lists 1 values but there are 2 workers"),
        ({"shard_sampling": "random"}, 2, "unknown shard sampling 'random'"),
        ({"staleness": "exp"}, 2, "unknown staleness rule 'exp'"),
        ({"min_local_steps": 0}, 2, "min-local-steps must be >= 1"),
        ({"sync": True, "staleness": "poly"}, 2, "sync mode is synchronous DiLoCo"),
        ({"slowdown": (1.0, 0.5)}, 2, "factors must be >= 1"),
        ({}, 0, "at least 2 ranks"),
        ({"inner_momentum": "reset"}, 2, "unknown inner-state rule 'reset'"),
    ],
)
def test_bad_config_is_rejected_before_any_message(
    tmp_path: Path, kw: dict[str, Any], workers: int, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        check_async_config(_cfg(tmp_path, **kw), workers)


def test_settings_left_in_extra_are_refused() -> None:
    """``sync`` and the other asynchronous settings once lived in the free dict ``extra``;
    a dict that still puts them there would run other settings, so it is refused."""
    with pytest.raises(ConfigError, match="extra is no longer read: powersgd_rank"):
        TrainConfig.from_dict({"algo": "async-diloco", "extra": {"sync": True}})


# --- the inner first moment across rounds ----------------------------------------------
def _first_moment_zero_at_each_step(worker: LocalWorker) -> list[bool]:
    """Record, before every inner step, whether AdamW's first moment is all zeros."""
    seen: list[bool] = []

    def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        moments = [s["exp_avg"] for s in opt.state.values() if "exp_avg" in s]
        seen.append(bool(moments) and not any(bool(m.any()) for m in moments))

    worker.opt.register_step_pre_hook(pre_step)
    return seen


@pytest.mark.parametrize("mode", ["keep", "round", "restart", "fresh"])
def test_worker_applies_the_inner_state_rule_at_each_round(mode: str) -> None:
    torch.manual_seed(0)
    data = TextData(None, 16, 0.05, 0)
    model = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=2, n_embd=32))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    shards = data.shard_batches(2, batch_size=2)
    worker = LocalWorker(
        model, adamw, shards, gpt_loss, warmup_steps=0, min_lr_ratio=0.1, inner_momentum=mode
    )
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    zero_before_step = _first_moment_zero_at_each_step(worker)
    worker.run_round(theta.clone(), Work(0, 0, shard=0, steps=3, lr_clock=0, planned=10))
    worker.run_round(theta.clone(), Work(0, 1, shard=1, steps=2, lr_clock=0, planned=10))
    # Step 1 of round 1 has no state yet (False either way); step 1 of round 2 starts from a
    # zero first moment when restarting, from no state at all when fresh.
    assert zero_before_step == [False, False, False, mode in ("round", "restart"), False]
    for state in worker.opt.state.values():
        # the step count carries over except with a fresh optimizer
        assert int(state["step"]) == (2 if mode == "fresh" else 5)
        assert bool(state["exp_avg_sq"].any())
    with pytest.raises(ConfigError, match="unknown inner-state rule 'reset'"):
        LocalWorker(
            model, adamw, shards, gpt_loss, warmup_steps=0, min_lr_ratio=0.1, inner_momentum="reset"
        )


def test_inner_state_default_is_the_same_for_every_method(tmp_path: Path) -> None:
    assert resolve_inner_momentum(None) == "restart"
    assert resolve_inner_momentum(None, trained=True) == "keep"  # from a trained model
    assert resolve_inner_momentum("keep") == "keep"  # explicit wins
    assert resolve_inner_momentum("restart", trained=True) == "restart"
    with pytest.raises(ConfigError, match="unknown inner-state rule 'Round'"):
        resolve_inner_momentum("Round")
    # The runtime's workers get the resolved mode.
    for kw, mode in [
        ({"dylu": True}, "restart"),
        ({"dylu": False}, "restart"),
        ({"dylu": True, "inner_momentum": "keep"}, "keep"),
        ({"dylu": False, "inner_momentum": "fresh"}, "fresh"),
        ({"dylu": True, "pretrain_steps": 3}, "keep"),
        ({"dylu": True, "pretrain_steps": 3, "inner_momentum": "restart"}, "restart"),
    ]:
        cfg = _cfg(tmp_path, **kw)
        assert make_worker(gpt_task(cfg), async_config(cfg), 1, 2).inner_momentum == mode, kw


def _mismatched_rank(rank: int, world: int, cfg: TrainConfig) -> Any:
    if rank != 2:
        return run(cfg)
    other = replace(cfg, n_layer=2)  # one layer too many
    acfg = async_config(other)
    return work_loop(make_worker(gpt_task(other), acfg, rank, 2), open_transport(acfg)[0])


@pytest.mark.timeout(120)
def test_worker_with_other_model_shape_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(
        DistributedError, match=r"worker rank 2 has a model of|the server's model has"
    ):
        spawn(_mismatched_rank, 3, (_cfg(tmp_path),), timeout_s=100)


def test_shape_signature_differs() -> None:
    a = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=2, n_embd=32))
    b = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=4, n_embd=32))  # same shapes, other heads
    c = GPT(GPTConfig(seq_len=17, n_layer=1, n_head=2, n_embd=32))
    assert shape_signature(a) == shape_signature(b)
    assert shape_signature(a) != shape_signature(c)
    with pytest.raises(ConfigError):
        TrainConfig(local_steps=0).validate()


def _flaky_rank(rank: int, world: int, cfg: TrainConfig) -> Any:
    if rank != 1:
        return run(cfg)
    task = gpt_task(cfg)
    shards = task.shards(world - 1)
    worker = LocalWorker(
        task.model(), task.optimizer, shards, task.loss, warmup_steps=0, min_lr_ratio=0.1
    )

    def fail_once(rounds: int) -> None:
        if rounds == 1:
            raise RuntimeError("simulated failure in round 1")

    return work_loop(worker, open_transport(async_config(cfg))[0], on_round=fail_once)


@pytest.mark.timeout(120)
def test_failed_worker_rejoins(tmp_path: Path) -> None:
    # The flaky worker fails its first round. The steady one runs at a quarter speed and
    # the budget is 32 inner steps, so the flaky worker gets its first round even when it
    # starts last (before, failing in round 2 raced the steady worker for the budget).
    cfg = _cfg(tmp_path, steps=16, slowdown=(1.0, 4.0))
    out = spawn(_flaky_rank, 3, (cfg,), timeout_s=100)
    summary, flaky, steady = out
    assert flaky["restarts"] == 1
    assert summary["inner_steps"] == 32 and summary["dead_workers"] == []
    # The lost round was handed out again: the applied steps are exactly the budget.
    assert flaky["steps"] + steady["steps"] == 32


# --- the built-in launcher outlives a killed worker ----------------------------------------
@pytest.mark.timeout(180)
def test_launcher_keeps_serving_when_a_worker_process_is_killed(tmp_path: Path) -> None:
    """`thinwire train --algo async-diloco --workers 4` spawns the ranks itself; SIGKILL of
    one worker process from outside must neither stop the launcher nor the run."""
    import signal
    import threading

    from thinwire.cli.train import run_training

    cfg = _cfg(tmp_path, steps=120, checkpoint_interval=0, dead_after_s=3.0)
    out: dict[str, Any] = {}

    def launch() -> None:
        try:
            out["summary"] = run_training(cfg, workers=4, timeout_s=150)
        except BaseException as exc:  # reported by the assertion below
            out["error"] = exc

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 90
    victim = None
    while time.monotonic() < deadline and victim is None and thread.is_alive():
        # Once the server has logged an update, kill rank 3 (a worker) mid-run.
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            victim = next((p for p in mp.active_children() if p.name == "thinwire-rank3"), None)
        time.sleep(0.05)
    assert victim is not None, out.get("error", "the run ended before a worker could be killed")
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=160)
    assert not thread.is_alive(), "the launcher hung after a worker was killed"
    assert "error" not in out, out.get("error")
    summary = out["summary"]
    assert summary["inner_steps"] == cfg.steps * 3  # the survivors met the whole budget
    assert 3 in summary["dead_workers"]
