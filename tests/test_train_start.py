"""Where a run of the example trainer starts (thinwire.train.start): after N steps of
ordinary data-parallel AdamW, or from a model file; checked against the Local-SGD
pretraining as an independent single-process reference. The resume of a pretrained run
is in tests/test_train_matrix.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.pretrain import pretrain
from thinwire.localsgd.task import Task
from thinwire.train.algorithms import default_lr
from thinwire.train.async_task import gpt_loss, gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.metrics import read_metrics
from thinwire.train.model import GPT
from thinwire.train.trainer import train

PRETRAIN = 5


def _first_val(run_dir: str) -> float:
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    return next(r["val_loss"] for r in records if r["step"] == 0 and "val_loss" in r)


def _val_loss(cfg: TrainConfig, state: dict[str, torch.Tensor]) -> float:
    model = GPT(cfg.gpt_config())
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return gpt_task(cfg).evaluate(model)


def _reference(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The same pretraining by thinwire.localsgd.algorithm.pretrain: one shard, the trainer's own
    training stream, AdamW at AdamW's tuned lr."""
    data = TextData(cfg.data, cfg.gpt_config().seq_len, cfg.val_fraction, cfg.seed)
    adamw = TrainConfig(**{**cfg.to_dict(), "lr": default_lr("adamw")})
    task = gpt_task(adamw, data)

    def stream(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data.batch(step, cfg.batch_size)

    task = Task(task.model, task.optimizer, lambda n: [stream], gpt_loss, task.evaluate)
    return pretrain(task, cfg.pretrain_steps, 1, warmup_steps=cfg.warmup_steps)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["onebit-lamb", "diloco"])
def test_a_run_starts_from_its_pretraining(tmp_path: Path, algo: str) -> None:
    cfg = tiny_config(tmp_path, algo=algo, lr=default_lr(algo), steps=4, pretrain_steps=PRETRAIN)
    summary = train(cfg)
    assert summary["start"] == f"after {PRETRAIN} steps of ordinary training"
    # From a trained model DiLoCo keeps its inner state across rounds, and says so.
    assert summary["inner_state"] == ("keep" if algo == "diloco" else None)
    # AdamW at its own lr, whatever the algorithm's: the start every algorithm shares
    assert _first_val(cfg.out_dir) == pytest.approx(_val_loss(cfg, _reference(cfg)), rel=1e-6)
    scratch = tiny_config(tmp_path / "scratch", algo=algo, lr=default_lr(algo), steps=4)
    assert train(scratch)["inner_state"] == ("restart" if algo == "diloco" else None)
    assert _first_val(cfg.out_dir) < _first_val(scratch.out_dir) - 0.05
    assert json.loads((tmp_path / "run" / "run.json").read_text())["pretrain_steps"] == PRETRAIN


@pytest.mark.timeout(120)
def test_the_run_reads_the_stream_on_after_the_pretraining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[int] = []
    real = TextData.batch

    def spy(self: TextData, step: int, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        steps.append(step)
        return real(self, step, *args)

    monkeypatch.setattr(TextData, "batch", spy)
    train(tiny_config(tmp_path, algo="adamw", steps=3, pretrain_steps=PRETRAIN))
    assert steps == list(range(PRETRAIN + 3))  # no batch of the pretraining read again


@pytest.mark.timeout(120)
def test_init_from_a_model_file(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, algo="lamb", steps=2, pretrain_steps=PRETRAIN)
    state = _reference(cfg)
    path = tmp_path / "base.pt"
    torch.save({"model": state}, path)
    run = tiny_config(tmp_path / "b", algo="lamb", steps=2, init_from=str(path))
    summary = train(run)
    assert summary["start"] == f"from {path}"
    assert _first_val(run.out_dir) == pytest.approx(_val_loss(cfg, state), rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pretrain_steps": -1}, "pretrain-steps must be an integer >= 0"),
        ({"init_from": "a.pt", "pretrain_steps": 5}, "not both"),
        ({"init_from": "missing.pt"}, "missing.pt"),
    ],
)
def test_bad_starts_are_one_line(tmp_path: Path, overrides: dict, message: str) -> None:
    cfg = tiny_config(tmp_path, algo="adamw", steps=2, **overrides)
    with pytest.raises(ConfigError, match=message) as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.timeout(60)
def test_a_resume_with_another_start_is_refused(tmp_path: Path) -> None:
    train(tiny_config(tmp_path, algo="adamw", steps=4, stop_after=2, pretrain_steps=2))
    other = tiny_config(tmp_path, algo="adamw", steps=4, resume=True, pretrain_steps=3)
    with pytest.raises(ConfigError, match="pretrain_steps"):
        train(other)


def test_every_algorithm_reads_the_start() -> None:
    for algo in ("adamw", "lamb", "onebit-lamb", "diloco", "async-diloco"):
        assert TrainConfig(algo=algo, pretrain_steps=10).unused_options() == []


def _train_on_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    return train(cfg)


@pytest.mark.timeout(180)
def test_two_ranks_start_from_rank_0s_file_and_a_wrong_path_leaves_nothing(
    tmp_path: Path,
) -> None:
    cfg = tiny_config(tmp_path, algo="lamb", steps=2, pretrain_steps=PRETRAIN)
    state = _reference(cfg)
    path = tmp_path / "base.pt"
    torch.save(state, path)
    run = tiny_config(tmp_path / "b", algo="adamw", steps=2, init_from=str(path))
    summaries = spawn(_train_on_rank, 2, (run,), timeout_s=150)
    assert summaries[0]["param_sha256"] == summaries[1]["param_sha256"]
    assert _first_val(run.out_dir) == pytest.approx(_val_loss(cfg, state), rel=1e-6)
    wrong = tiny_config(tmp_path / "c", algo="adamw", steps=2, init_from=str(tmp_path / "x.pt"))
    with pytest.raises(Exception, match=r"init-from file .*x\.pt is missing"):
        spawn(_train_on_rank, 2, (wrong,), timeout_s=150)
    assert not (tmp_path / "c" / "run" / "run.json").exists()  # a fixed path needs no --resume
