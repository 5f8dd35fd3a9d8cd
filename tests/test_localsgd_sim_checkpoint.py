"""Checkpoints inside a simulated run: stopped at any arrival and started again, a run
ends with the very numbers of a run never stopped; other runs' files are not resumed."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from thinwire.cli import simulate as cli_simulate
from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.io import atomic_save
from thinwire.localsgd import AsyncConfig, SimClock, for_method, simulate
from thinwire.localsgd.algorithm.push_guard import PushGuard
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.algorithm.sim_checkpoint import SimCheckpoint
from thinwire.localsgd.algorithm.sweep import parse_grid, run_sweep
from thinwire.localsgd.task import Task
from thinwire.safeload import safe_load
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData

# Every piece of state a resume must carry is exercised: jitter (the clock's generator),
# dropout (torch's), 1-bit pushes (error feedback), compressed pulls (the views), DyLU's
# speeds, PolyThres's drops, a sync round's held arrivals, AdamW's moments kept across
# rounds.
_KW: dict[str, Any] = {
    "local_steps": 4,
    "steps": 10,
    "warmup_steps": 2,
    "compress": "onebit",
    "compress_pull": "fp16",
    "inner_momentum": "keep",
}


class _Killed(Exception):
    """The process 'died' here."""


def _task(data: TextData, n_embd: int = 32) -> Task:
    """A small GPT whose loss draws from torch's generator, as dropout would, and from
    Python's and NumPy's, as a user's data pipeline might."""
    model = TrainConfig(
        n_layer=1, n_embd=n_embd, n_head=2, seq_len=16, batch_size=4, eval_sequences=8
    )
    task = gpt_task(model, data)
    plain = task.loss
    random.seed(0)  # gpt_task seeds torch as it builds the model; these are the user's
    np.random.seed(0)

    def noisy(net: torch.nn.Module, batch: Any) -> torch.Tensor:
        noise = 0.1 * float(torch.rand(())) + 0.05 * random.random() + 0.05 * np.random.rand()
        return plain(net, batch) * (1.0 + noise)

    return replace(task, loss=noisy)


def _run(
    data: TextData,
    method: str,
    checkpoint: SimCheckpoint | None = None,
    kill_at: int | None = None,
    n_embd: int = 32,
    declare_speeds: bool = True,
    **kw: Any,
) -> dict[str, Any]:
    """One small run; ``kill_at``: raise at that arrival (after it landed, before its
    save), as a process killed there would stop."""
    arrivals = [-1]  # the first call is the start's

    def progress(done: int, total: int) -> None:
        arrivals[0] += 1
        if kill_at is not None and arrivals[0] == kill_at:
            raise _Killed

    cfg = replace(for_method(AsyncConfig(**_KW), method), **kw)
    clock = SimClock(
        (0.5, 1.0, 2.3), jitter=0.3, seed=3, eval_points=3, declare_speeds=declare_speeds
    )
    return simulate(_task(data, n_embd), cfg, clock, checkpoint=checkpoint, progress=progress)


@pytest.fixture(scope="module")
def data() -> TextData:
    return TextData(None, 16, 0.05, 0)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("curve", "sim_time_s", "push_bytes", "pull_bytes", "staleness", "shard_steps"):
        assert a[key] == b[key], key
    assert a["updates"] == b["updates"] and a["updates_dropped"] == b["updates_dropped"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("method", "kw", "kills"),
    [
        ("dn-dylu", {}, (2, 4)),  # stopped twice: the second time, a resumed run
        ("dn-dylu", {"declare_speeds": False, "calibration_steps": 2}, (3,)),
        ("sync", {}, (3, 3)),  # a round's arrivals held at both stops
        ("naive", {"grace_s": 0.7, "shard_sampling": "paper"}, (5,)),
        ("poly", {}, (4,)),
        ("polythres", {"max_staleness": 1}, (6,)),
        ("buffer", {}, (3,)),
    ],
)
def test_a_run_stopped_and_started_again_ends_as_if_never_stopped(
    data: TextData, tmp_path: Path, method: str, kw: dict[str, Any], kills: tuple[int, ...]
) -> None:
    reference = _run(data, method, **kw)
    assert reference["updates"] + reference["updates_dropped"] > sum(kills)
    if method == "polythres":
        assert reference["updates_dropped"] > 0  # the drops are part of what resumes
    path = tmp_path / "run.partial.pt"
    held = []
    for i, kill in enumerate(kills):
        ckpt = SimCheckpoint(path, every_s=0, tag="t")
        with pytest.raises(_Killed):
            _run(data, method, ckpt, kill_at=kill, **kw)
        assert (ckpt.resumed_at is not None) == (i > 0)
        held.append(len(safe_load(path)["state"]["core"]["model"]["held"]))
    if method == "sync":
        assert all(n > 0 for n in held)  # saved mid-round: the arrivals held resume too
    again = SimCheckpoint(path, every_s=0, tag="t")
    resumed = _run(data, method, again, **kw)
    assert again.resumed_at is not None and again.resumed_at < reference["inner_steps"]
    _same(resumed, reference)


@pytest.mark.timeout(180)
def test_a_file_of_another_run_or_unreadable_is_not_resumed(
    data: TextData, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = _run(data, "dn-dylu")
    path = tmp_path / "run.partial.pt"
    for other in ({"tag": "other"}, {"method": "dn"}, {"outer_lr": 0.9}):
        with pytest.raises(_Killed):
            ckpt = SimCheckpoint(path, every_s=0, tag=other.get("tag", "mine"))
            cfg = {k: v for k, v in other.items() if k != "tag"}
            _run(data, cfg.pop("method", "dn-dylu"), ckpt, kill_at=3, **cfg)
        ckpt = SimCheckpoint(path, every_s=0, tag="mine")  # starts from its start
        _same(_run(data, "dn-dylu", ckpt), reference)
        assert ckpt.resumed_at is None, other
    path.write_bytes(b"not a checkpoint")
    ckpt = SimCheckpoint(path, every_s=0, tag="mine")
    with caplog.at_level(logging.WARNING):
        _same(_run(data, "dn-dylu", ckpt), reference)
    assert ckpt.resumed_at is None
    assert "corrupt or unreadable" in caplog.text and "starts from its start" in caplog.text
    blob = safe_load(path)
    atomic_save(blob | {"format": 0}, path)  # a layout of another version
    with caplog.at_level(logging.WARNING):
        _run(data, "dn-dylu", SimCheckpoint(path, every_s=0, tag="mine"))
    assert "is of another thinwire version" in caplog.text
    # The run left its last save (the sweep discards it once the result is kept); the
    # same settings on another model: refused in one line, the file left as it was.
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="another run's") as err:
        _run(data, "dn-dylu", SimCheckpoint(path, every_s=0, tag="mine"), n_embd=16)
    assert "\n" not in str(err.value)
    assert path.read_bytes() == before
    with pytest.raises(ConfigError, match="checkpoint interval"):
        SimCheckpoint(path, every_s=-1)


@pytest.mark.timeout(180)
def test_never_saving_still_resumes_and_a_failed_save_is_one_line(
    data: TextData, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = _run(data, "naive")
    path = tmp_path / "run.partial.pt"
    with pytest.raises(_Killed):
        _run(data, "naive", SimCheckpoint(path, every_s=0), kill_at=4)
    saved = path.read_bytes()
    never = SimCheckpoint(path, every_s=math.inf)
    _same(_run(data, "naive", never), reference)
    assert never.resumed_at is not None and path.read_bytes() == saved  # read, not written
    fresh = tmp_path / "fresh.partial.pt"
    _run(data, "naive", SimCheckpoint(fresh, every_s=math.inf))
    assert not fresh.exists()
    # A save that cannot be written (its folder is a file) is said, and the run goes on.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        _same(_run(data, "naive", SimCheckpoint(blocked / "run.pt", every_s=0)), reference)
    assert "could not save the simulation" in caplog.text and "the run goes on" in caplog.text


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kw",
    [
        # Two fragments, applied a step late, int8 with both error feedbacks.
        {"fragments": 2, "fragment_overlap": 1, "compress": "int8", "local_steps": 5},
        {"fragments": 2, "compress": "fp16", "compress_pull": "none", "local_steps": 4},
    ],
)
def test_a_streaming_run_stopped_and_started_again_ends_as_if_never_stopped(
    data: TextData, tmp_path: Path, kw: dict[str, Any]
) -> None:
    kw = {"compress_pull": "none", "inner_momentum": None} | kw
    reference = _run(data, "sync", **kw)
    assert reference["streaming"]["fragments"] == 2
    path = tmp_path / "stream.partial.pt"
    with pytest.raises(_Killed):
        _run(data, "sync", SimCheckpoint(path, every_s=0, tag="s"), kill_at=3, **kw)
    again = SimCheckpoint(path, every_s=0, tag="s")
    resumed = _run(data, "sync", again, **kw)
    assert again.resumed_at is not None and 0 < again.resumed_at < reference["inner_steps"]
    _same(resumed, reference)
    assert resumed["peak_sync_bytes"] == reference["peak_sync_bytes"]


@pytest.mark.timeout(240)
def test_a_sweep_stopped_mid_run_goes_on_from_its_checkpoint(
    data: TextData, tmp_path: Path
) -> None:
    base = AsyncConfig(**_KW)
    clock = SimClock((0.5, 1.0, 2.3), jitter=0.3, eval_points=3)
    grid = parse_grid(["outer-lr=0.3"], ["dn-dylu"])
    started: list[int | None] = []

    def sweep(out: Path, kill_at: int | None) -> list[dict[str, Any]]:
        def on_start(method: str, setting: Any, seed: int, ckpt: Any) -> Any:
            calls = [0]

            def progress(done: int, total: int) -> None:
                if calls[0] == 0:
                    started.append(ckpt.resumed_at)
                calls[0] += 1
                if calls[0] == kill_at:
                    raise _Killed

            return progress

        return run_sweep(
            lambda seed: _task(data),
            base,
            clock,
            grid,
            (0,),
            out,
            on_start=on_start,
            checkpoint_every=0,
        )

    reference = sweep(tmp_path / "whole", None)
    out = tmp_path / "stopped"
    with pytest.raises(_Killed):
        sweep(out, 4)
    partial = list((out / "runs").glob("*.partial.pt"))
    assert len(partial) == 1
    runs = sweep(out, None)
    assert started[-1] is not None and started[-1] > 0  # it resumed, not started over
    _same(runs[0], reference[0])
    assert not partial[0].exists()  # done with once the result is kept
    kept = json.loads(next((out / "runs").glob("*.json")).read_text())
    assert kept["curve"] == reference[0]["curve"]
    # A save left beside a kept result (a stop between the two writes) goes at the rerun.
    partial[0].write_bytes(b"left over")
    sweep(out, None)
    assert not partial[0].exists()


@pytest.mark.timeout(240)
def test_the_cli_goes_on_from_a_run_stopped_by_ctrl_c(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["simulate", "--methods", "dn-dylu", "--seconds-per-step", "1,3", "--model", "tiny"]
    args += ["--local-steps", "2", "--steps", "6", "--batch-size", "2", "--eval-points", "2"]
    args += ["--checkpoint-every", "1e-9"]  # after (nearly) every arrival
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    starting = cli_simulate._starting

    def stopped_at_the_third_arrival(*a: Any) -> Any:
        step, calls = starting(*a), [0]

        def progress(done: int, total: int) -> None:
            step(done, total)
            calls[0] += 1
            if calls[0] == 4:
                raise KeyboardInterrupt

        return progress

    monkeypatch.setattr(cli_simulate, "_starting", stopped_at_the_third_arrival)
    never = [*args, "--checkpoint-every", "0", "--out", str(tmp_path / "never")]
    assert main(never) == 130
    assert "the run in progress had no save yet and starts again" in capsys.readouterr().err
    assert not list((tmp_path / "never" / "runs").glob("*.partial.pt"))
    assert main([*args, "--out", str(tmp_path / "stopped")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "the run in progress goes on from its save in" in err
    monkeypatch.undo()
    assert main([*args, "--out", str(tmp_path / "stopped")]) == 0
    out = capsys.readouterr().out
    at = re.search(r"seed 0: resumed from \S+partial\.pt at (\d+) of 12 inner steps", out)
    assert at is not None and 0 < int(at.group(1)) < 12
    # Not on a terminal: a line at every tenth of the run instead of a bar.
    assert re.search(r"seed 0: 12 of 12 inner steps \(100%\) in \d+ min", out)
    whole, stopped = (
        json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "stopped")
    )
    assert stopped["runs"][0]["curve"] == whole["runs"][0]["curve"]
    assert not list((tmp_path / "stopped" / "runs").glob("*.partial.pt"))
    assert main([*args, "--checkpoint-every", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "--checkpoint-every must be >= 0" in capsys.readouterr().err


def _server(sync: bool) -> ServerCore:
    return ServerCore.of(
        torch.linspace(-1, 1, 6),
        workers=3,
        local_steps=4,
        total_steps=10**6,
        shard_sizes=[50, 30, 20, 40],
        guard=PushGuard(max_strikes=3),
        sync=sync,
        dylu=not sync,
        grace_s=0.5,
        shard_sampling="paper",
        staleness="poly",
    )


def _play(core: ServerCore, rng: random.Random, steps: range) -> None:
    """Arrivals, deaths, rejoins, refused pushes, at random (the same ``rng``, the same
    moves)."""
    for step in steps:
        now = step * 0.7
        w = rng.randint(1, 3)
        if rng.random() < 0.05:
            core.drop(w)
        elif w not in core.live:
            core.join(w, now)
        for due in core.due(now):
            core.work_for(due, now)
        info = core.live.get(w)
        if info is None or not info.busy:
            continue
        honest = rng.random() < 0.9
        steps_sent = info.steps if honest else rng.randint(0, 9)
        grad = torch.randn(6, generator=torch.Generator().manual_seed(step)) * 0.01
        core.submit(w, core.epoch, grad, steps_sent, rng.uniform(0.1, 1.0), now, info.version)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync", [False, True])
def test_a_server_restored_from_its_snapshot_goes_on_as_the_original(
    sync: bool, tmp_path: Path
) -> None:
    rng = random.Random(7)
    core = _server(sync)
    _play(core, rng, range(0, 300))
    assert core.updates_applied > 0 and core.busy > 0
    assert core.dead or core.evicted or core.guard.total_refused  # more than arrivals
    atomic_save(core.snapshot(), tmp_path / "core.pt")  # plain data: the safe loader reads it
    twin = _server(sync)
    twin.restore(safe_load(tmp_path / "core.pt"))
    assert _equal(twin.snapshot(), core.snapshot())
    state = rng.getstate()
    _play(core, rng, range(300, 600))
    rng.setstate(state)
    _play(twin, rng, range(300, 600))
    assert _equal(twin.snapshot(), core.snapshot())
    assert core.updates_applied > 0 and torch.equal(twin.theta, core.theta)
