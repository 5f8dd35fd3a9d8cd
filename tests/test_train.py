"""The example trainer: DDP parity with one process, exact resume, per-rank agreement."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from thinwire.comm.launch import spawn
from thinwire.train import checkpoint as ckpt
from thinwire.train.config import TrainConfig
from thinwire.train.metrics import read_metrics
from thinwire.train.trainer import lr_at, train


def _train_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    return train(cfg)


def _losses(out_dir: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in read_metrics(Path(out_dir) / "metrics.jsonl") if "loss" in r
    ]


def _final_params(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    return ckpt.load_model_state(Path(cfg.out_dir), cfg.steps)


@pytest.mark.timeout(180)
def test_ddp_matches_single_process_with_same_global_batch(tmp_path: Path) -> None:
    """2 ranks x batch 4 see exactly the samples of 1 process x batch 8 (see data.py)."""
    multi = tiny_config(tmp_path / "multi", batch_size=4)
    summaries = spawn(_train_rank, 2, (multi,), timeout_s=150)
    # every rank ends bit-identical
    assert summaries[0]["param_sha256"] == summaries[1]["param_sha256"]
    single = tiny_config(tmp_path / "single", batch_size=8)
    train(single)
    multi_losses, single_losses = _losses(multi.out_dir), _losses(single.out_dir)
    assert [s for s, _ in multi_losses] == [s for s, _ in single_losses]
    # Reassociated float sums (two half-batch means averaged vs one mean) differ in the
    # last bits; after 12 Adam steps that stays far below 1e-4.
    for (_, a), (_, b) in zip(multi_losses, single_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    # Adam divides each coordinate by its own RMS, so a coordinate whose gradient is ~0 can
    # turn a last-bit difference into a step of up to lr (3e-3): every coordinate within
    # 1e-3, and on average within 1e-6.
    pm, ps = _final_params(multi), _final_params(single)
    diffs = torch.cat([(pm[k] - ps[k]).abs().flatten() for k in ps])
    assert diffs.max() < 1e-3
    assert diffs.mean() < 1e-6
    # the baseline's bytes: one fp32 ring allreduce of all gradients per step
    n_params = sum(p.numel() for k, p in ps.items() if k != "head.weight")
    assert summaries[0]["comm_bytes"] == multi.steps * n_params * 4  # 2(W-1)/W = 1 at W=2


@pytest.mark.timeout(240)
def test_resume_is_exact(tmp_path: Path) -> None:
    straight = tiny_config(tmp_path / "straight", steps=12)
    s_straight = spawn(_train_rank, 2, (straight,), timeout_s=150)
    half = tiny_config(tmp_path / "resumed", steps=12, stop_after=6)
    spawn(_train_rank, 2, (half,), timeout_s=150)
    rest = tiny_config(tmp_path / "resumed", steps=12, resume=True)
    s_resumed = spawn(_train_rank, 2, (rest,), timeout_s=150)
    assert s_resumed[0]["param_sha256"] == s_straight[0]["param_sha256"]
    assert s_resumed[1]["param_sha256"] == s_straight[1]["param_sha256"]
    a = read_metrics(Path(straight.out_dir) / "metrics.jsonl")
    b = read_metrics(Path(rest.out_dir) / "metrics.jsonl")
    keys = ("step", "samples", "loss", "lr", "val_loss", "comm_bytes")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]
    assert s_resumed[0]["comm_bytes"] == s_straight[0]["comm_bytes"]


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(x >= y for x, y in itertools.pairwise(lrs))


def test_checkpoint_write_interrupted_keeps_previous(tmp_path: Path, monkeypatch) -> None:
    """A save that dies half-way (Ctrl-C, full disk) leaves the last checkpoint readable."""
    out = tmp_path / "run"
    ckpt.save_checkpoint(out, 5, 0, {"w": torch.ones(3)}, {"rank": 0, "x": 1})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(out, 10, 0, {"w": torch.zeros(3)}, {"rank": 0, "x": 2})
    monkeypatch.setattr(torch, "save", real_save)
    assert ckpt.latest_step(out) == 5
    torch.testing.assert_close(ckpt.load_model_state(out, 5)["w"], torch.ones(3))
    # the rank file as written (a real trainer's state holds far more than this stand-in,
    # which load_rank_state would refuse as damaged)
    assert ckpt.safe_load(out / "checkpoints" / "step-00000005" / "rank0.pt")["x"] == 1
    assert not list(out.rglob(".*tmp*"))  # no temporary file left behind


def test_old_checkpoints_are_pruned(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(out, step, 0, {"w": torch.ones(1) * step}, {"rank": 0})
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == ["step-00000003", "step-00000004"]
    assert ckpt.latest_step(out) == 4


def _train_peers(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict]:
    from thinwire.comm.accounting import COUNTER

    out = []
    for cfg in cfgs:
        COUNTER.reset()
        out.append(train(cfg))
    return out


@pytest.mark.timeout(240)
def test_pytorch_peer_hooks_train_in_sync_and_send_less(tmp_path: Path) -> None:
    """The peers a PyTorch user would pick (fp16 hook, PowerSGD) run in the same trainer
    and their bytes land on the same ledger as the fp32 baseline's."""
    cfgs = [
        tiny_config(tmp_path / algo, algo=algo, steps=8, powersgd_start=2)
        for algo in ("adamw", "adamw-fp16", "adamw-powersgd")
    ]
    per_rank = spawn(_train_peers, 2, (cfgs,), timeout_s=200)
    fp32, fp16, psgd = per_rank[0]
    for i in range(3):
        assert per_rank[0][i]["param_sha256"] == per_rank[1][i]["param_sha256"]
        assert per_rank[0][i]["final_val_loss"] < 5.0  # it learned something from ln(256)=5.5
    assert fp16["comm_bytes"] == fp32["comm_bytes"] // 2
    assert 0 < psgd["comm_bytes"] < fp32["comm_bytes"] / 2
    assert "ddp.powersgd" in psgd["comm_by_op"]


@pytest.mark.timeout(240)
def test_adamw_onebit_overlaps_with_the_same_bits_and_resumes_exactly(tmp_path: Path) -> None:
    """DDP+AdamW with the 1-bit hook: overlapped and synchronous runs are bit-identical,
    send 1-bit bytes after the freeze, and a run resumed mid-compression ends bit-identical."""
    common = {"steps": 12, "freeze_step": 3}
    cfgs = [
        tiny_config(tmp_path / "over", algo="adamw-onebit", **common),
        tiny_config(tmp_path / "sync", algo="adamw-onebit-sync", **common),
        tiny_config(tmp_path / "half", algo="adamw-onebit", stop_after=7, **common),
        tiny_config(tmp_path / "half", algo="adamw-onebit", resume=True, **common),
    ]
    per_rank = spawn(_train_peers, 2, (cfgs,), timeout_s=220)
    over, sync, _, resumed = per_rank[0]
    assert over["param_sha256"] == per_rank[1][0]["param_sha256"]
    assert over["param_sha256"] == sync["param_sha256"] == resumed["param_sha256"]
    assert over["final_val_loss"] < 5.0  # it learned something from ln(256)=5.5
    ops = over["comm_by_op"]
    assert ops["onebit.phase1"]["calls"] >= 2 * (12 - 3)  # several buckets per step
    assert ops["ddp.allreduce"]["calls"] >= 3


def test_metrics_are_plain_numbers_or_a_clear_error(tmp_path: Path) -> None:
    import numpy as np

    from thinwire.train.metrics import MetricsWriter, plain

    assert plain("a", torch.tensor(2.5)) == 2.5 and isinstance(plain("a", torch.tensor(2.5)), float)
    assert plain("b", np.float32(1.5)) == 1.5 and plain("c", 3) == 3 and plain("d", None) is None
    with pytest.raises(TypeError, match="metric 'e' is a Tensor"):
        plain("e", torch.ones(3))
    with pytest.raises(TypeError, match="metric 'f' is a list"):
        plain("f", [1, 2])
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"step": 1, "loss": torch.tensor(3.0)})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 3.0}]


@pytest.mark.timeout(60)
def test_every_stage_switch_is_in_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen variance gone stale sends 1-bit LAMB back to its warmup, and it freezes
    again: the metrics hold each switch, not only the first freeze."""
    from thinwire.optim.stale import StaleGuard

    real = StaleGuard.observe
    calls = itertools.count()

    def stale_once(self: StaleGuard, energy: float) -> float | None:
        # the third compressed step reports a stale variance, once
        return 10.0 if next(calls) == 2 else real(self, energy)

    monkeypatch.setattr(StaleGuard, "observe", stale_once)
    cfg = tiny_config(tmp_path, algo="onebit-lamb", steps=40, log_interval=1, freeze_cap=0.1)
    summary = train(cfg)
    events = [r for r in read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if "event" in r]
    kinds = [r["event"] for r in events]
    assert kinds == ["freeze", "rewarm", "freeze"], kinds
    first, rewarm, second = (r["step"] for r in events)
    assert first < rewarm < second
    assert summary["freeze_step"] == events[2]["freeze_step"]
    assert summary["bounded_steps"] == 0  # the summary says whether the step bound acted
