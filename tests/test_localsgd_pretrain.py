"""Where Local-SGD starts (thinwire.localsgd.algorithm.pretrain): N steps of ordinary training, or a
file, then the simulator from there; bad start files are refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimClock, Task, for_method, simulate
from thinwire.localsgd.algorithm.pretrain import Start, load_start_state, pretrain

_W = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    return x, x @ _W


class _Shard:
    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(1_000_003 * (self.index + 1) + step)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


@torch.no_grad()
def _evaluate(model: nn.Module) -> float:
    return float(_loss(model, _batch(777)))


def _task(lr: float = 0.05) -> Task:
    return Task(
        model=_model,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr),
        shards=lambda n: [_Shard(i) for i in range(n)],
        loss=_loss,
        evaluate=_evaluate,
    )


def test_pretraining_is_data_parallel_sgd_over_the_shards() -> None:
    """One step over 2 shards is one SGD step on the mean of the two shards' losses:
    what DDP on 2 ranks computes."""
    state = pretrain(_task(), steps=1, shards=2)
    ref = _model()
    loss = 0.5 * (_loss(ref, _Shard(0)(0)) + _loss(ref, _Shard(1)(0)))
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.05 * p.grad
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value)


def test_a_start_gives_the_task_its_weights_and_continues_the_data() -> None:
    task = _task()
    started = Start(pretrain_steps=5).apply(task, shards=2)
    assert started is not task
    trained = pretrain(task, 5, 2)
    for name, value in started.model().state_dict().items():
        assert torch.equal(value, trained[name])
    before, after = task.shards(2), started.shards(2)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new(0)[0], old(5)[0])  # the Local-SGD phase reads on after it
    assert Start().apply(task, shards=2) is task
    assert Start().describe() == "from scratch"
    assert Start(pretrain_steps=1000).describe() == "after 1,000 steps of ordinary training"


def test_the_simulator_starts_from_the_pretrained_model() -> None:
    """Pretrain, then Local-SGD in the simulator: the curve starts where the pretraining
    ended, well below the fresh model's loss, and the summary says how it started."""
    cfg = AsyncConfig(steps=10, local_steps=5, warmup_steps=2, pretrain_steps=20)
    clock = SimClock(seconds_per_step=(1.0, 2.0), eval_points=2)
    run = simulate(_task(), cfg, clock)
    scratch = simulate(_task(), AsyncConfig(steps=10, local_steps=5, warmup_steps=2), clock)
    # The pretraining warms its lr up over the run's warmup_steps, as the inner steps do.
    assert cfg.start() == Start(pretrain_steps=20, warmup_steps=2)
    pretrained = cfg.start().apply(_task(), shards=2).model()
    assert run["curve"][0]["val_loss"] == pytest.approx(_evaluate(pretrained))
    assert run["curve"][0]["val_loss"] < 0.5 * scratch["curve"][0]["val_loss"]
    assert run["start"] == "after 20 steps of ordinary training"
    assert scratch["start"] == "from scratch"
    # The inner-state default follows the start: keep from a trained model.
    assert (run["config"]["inner_momentum"], scratch["config"]["inner_momentum"]) == (
        "keep",
        "restart",
    )


def test_init_from_a_file(tmp_path: Path) -> None:
    weights = pretrain(_task(), 3, 2)
    plain, wrapped = tmp_path / "plain.pt", tmp_path / "wrapped.pt"
    torch.save(weights, plain)
    torch.save({"model": weights, "step": 3}, wrapped)
    for path in (plain, wrapped):
        model = Start(init_from=str(path)).apply(_task(), shards=2).model()
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights[name])
    cfg = AsyncConfig(steps=10, local_steps=5, init_from=str(plain))
    run = simulate(_task(), cfg, SimClock(seconds_per_step=(1.0, 1.0), eval_points=2))
    assert run["start"] == f"from {plain}"


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_start_state(path, _model())
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


def test_a_start_file_that_does_not_fit_is_refused_in_one_line(tmp_path: Path) -> None:
    weights = _model().state_dict()
    cases = {
        "shape": {**weights, "0.weight": torch.zeros(3, 4)},
        "missing": {k: v for k, v in weights.items() if k != "2.bias"},
        "extra": {**weights, "head.weight": torch.zeros(1)},
        "nan": {**weights, "0.bias": torch.full((8,), float("nan"))},
        "list": [1, 2, 3],
    }
    said = {}
    for name, blob in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save(blob, path)
        said[name] = _refusal(path)
    assert "'0.weight' has shape [3, 4], the model's is [8, 4]" in said["shape"]
    assert "lacks '2.bias'" in said["missing"]
    assert "has 'head.weight', which the model lacks" in said["extra"]
    assert "NaN or Inf" in said["nan"]
    assert "does not hold a model state_dict" in said["list"]
    assert "is missing" in _refusal(tmp_path / "absent.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    assert "corrupt or unreadable" in _refusal(junk)
    evil = tmp_path / "evil.pt"
    torch.save({"call": print}, evil)  # names a global to call: never loaded
    assert "not plain data" in _refusal(evil)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pretrain_steps": -1}, "pretrain-steps must be an integer >= 0"),
        ({"pretrain_steps": True}, "pretrain-steps must be an integer >= 0"),
        ({"pretrain_steps": 1.5}, "pretrain-steps must be an integer >= 0"),
        ({"init_from": "a.pt", "pretrain_steps": 5}, "not both"),
        ({"init_from": " "}, "init-from is an empty path"),
        ({"grad_clip": -1.0}, "grad-clip must be a number >= 0"),
    ],
)
def test_bad_starts_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Start(**kwargs)


def test_a_diverging_pretraining_stops_with_one_line() -> None:
    with pytest.raises(ConfigError, match=r"pretraining diverged at step \d+"):
        pretrain(_task(lr=1e6), 50, 2)


def _async_rank(rank: int, world: int, cfg: AsyncConfig) -> dict:
    from thinwire.localsgd import run_async

    del world
    out = run_async(_task(), cfg)
    if rank != 0:
        return {}
    return {"start": out["start"], "loss": out["final_val_loss"], "steps": out["inner_steps"]}


@pytest.mark.timeout(150)
def test_run_async_starts_from_a_file(tmp_path: Path) -> None:
    """One server and two workers: the server reads the start file and its weights become
    theta. (A pretraining under run_async runs in tests/test_localsgd_async.py, through
    thinwire train.)"""
    from thinwire.comm.launch import spawn

    base = {"steps": 10, "local_steps": 5, "warmup_steps": 2, "eval_interval": 10}
    scratch = simulate(_task(), AsyncConfig(**base), SimClock((1.0, 1.0), eval_points=2))
    path = tmp_path / "start.pt"
    torch.save(pretrain(_task(), 20, 2, warmup_steps=2), path)
    cfg = AsyncConfig(**base, init_from=str(path))
    filed = spawn(_async_rank, 3, (cfg,), timeout_s=120)[0]
    assert filed["start"] == f"from {path}"
    assert filed["loss"] < 0.5 * scratch["final_val_loss"]


def test_a_sweep_pretrains_once_per_seed_and_keeps_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from thinwire.localsgd import run_sweep
    from thinwire.localsgd.algorithm import pretrain as module

    calls = []
    real = module.pretrain

    def counted(*args: object, **kwargs: object) -> dict:
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "pretrain", counted)
    base = AsyncConfig(steps=6, local_steps=3, warmup_steps=1, pretrain_steps=8)
    clock = SimClock(seconds_per_step=(1.0, 2.0), eval_points=2)
    grid = {"naive": {}, "dn": {"outer_lr": (0.2, 0.4)}}
    steps: list[tuple[int, int]] = []

    def on_pretrain(seed: int, start: Start, ckpt: object) -> object:
        assert start.pretrain_steps == 8 and ckpt is not None  # where it is kept as it goes
        return lambda step, loss: steps.append((seed, step))

    runs = run_sweep(
        lambda seed: _task(), base, clock, grid, (0, 1), tmp_path, on_pretrain=on_pretrain
    )
    assert len(runs) == 6 and calls == [8, 8]  # one pretraining per seed, not per run
    assert steps == [(s, k) for s in (0, 1) for k in range(1, 9)]  # progress, step by step
    kept = sorted(p.name for p in (tmp_path / "runs").glob("pretrained-seed*.pt"))
    assert len(kept) == 2 and kept[0].startswith("pretrained-seed0-")
    assert {r["start"] for r in runs} == {"after 8 steps of ordinary training"}
    # A widened sweep in the same directory reads the kept weights: no new pretraining,
    # and the new run starts exactly where a fresh pretraining would have.
    grid["dn"]["outer_lr"] = (0.2, 0.4, 0.6)
    wider = run_sweep(
        lambda seed: _task(), base, clock, grid, (0, 1), tmp_path, on_pretrain=on_pretrain
    )
    assert calls == [8, 8] and len(wider) == 8 and len(steps) == 16  # read back, not rerun
    fresh = simulate(_task(), for_method(replace(base, outer_lr=0.6), "dn"), clock)
    new = next(r for r in wider if r["setting"] == {"outer_lr": 0.6} and r["seed"] == 0)
    assert new["curve"] == fresh["curve"]


def test_the_simulate_command_pretrains_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from thinwire.cli.main import main

    common = ["simulate", "--methods", "dn", "--seconds-per-step", "1,3"]
    common += ["--local-steps", "2", "--steps", "4", "--model", "tiny", "--batch-size", "2"]
    common += ["--eval-points", "2"]
    out = tmp_path / "sim"
    assert main([*common, "--pretrain-steps", "3", "--out", str(out)]) == 0
    blob = json.loads((out / "results.json").read_text())
    assert [r["start"] for r in blob["runs"]] == ["after 3 steps of ordinary training"]
    assert len(list((out / "runs").glob("pretrained-seed0-*.pt"))) == 1
    said = capsys.readouterr().out
    assert "every method starts after 3 steps of ordinary training" in said
    assert "outer lr/momentum where not swept: dn 0.3/0.9" in said  # what "defaults" were
    assert "Every method starts after 3 steps" in (out / "table.md").read_text()
    for flags, said in (
        (["--init-from", str(tmp_path / "absent.pt")], "absent.pt is missing"),
        (["--init-from", "x.pt", "--pretrain-steps", "3"], "not both"),
        (["--pretrain-steps", "-2"], "pretrain-steps must be an integer >= 0"),
    ):
        assert main([*common, *flags, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err


def test_the_train_command_maps_the_start_onto_asynchronous_local_sgd() -> None:
    from thinwire.cli.main import build_parser
    from thinwire.cli.train_config import config_from_args
    from thinwire.train.async_task import async_config

    flags = ["train", "--algo", "async-diloco", "--pretrain-steps", "50", "--out", "o"]
    cfg = config_from_args(build_parser().parse_args(flags))
    acfg = async_config(cfg)
    assert acfg.pretrain_steps == 50 and acfg.start().describe().startswith("after 50 steps")
    flags = ["train", "--algo", "async-diloco", "--init-from", "base.pt", "--out", "o"]
    assert async_config(config_from_args(build_parser().parse_args(flags))).init_from == "base.pt"
    # Synchronous DiLoCo starts there too (thinwire.train.start; tests/test_train_start.py).
    flags = ["train", "--algo", "diloco", "--pretrain-steps", "50", "--out", "o"]
    cfg = config_from_args(build_parser().parse_args(flags))
    assert cfg.pretrain_steps == 50 and cfg.unused_options() == []


def test_the_pretraining_reads_every_shard_of_the_run() -> None:
    """With more shards than workers, each pretraining step takes one batch from every
    shard the Local-SGD phase will read on from."""
    cfg = AsyncConfig(steps=6, local_steps=3, warmup_steps=1, pretrain_steps=5, shards=3)
    run = simulate(_task(), cfg, SimClock(seconds_per_step=(1.0, 2.0), eval_points=2))
    three = cfg.start().apply(_task(), shards=3).model()
    two = cfg.start().apply(_task(), shards=2).model()
    assert run["curve"][0]["val_loss"] == pytest.approx(_evaluate(three))
    assert _evaluate(three) != _evaluate(two)
