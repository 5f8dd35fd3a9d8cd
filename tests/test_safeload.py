"""No file runs code: checkpoints and spawned ranks' results load as plain data only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import TINY_FLAGS, tiny_config
from thinwire.cli.main import main
from thinwire.comm.launch import DistributedError, _decode, _encode
from thinwire.errors import ConfigError
from thinwire.safeload import UnsafeContentError, safe_load, safe_loads
from thinwire.train.trainer import train

SMALL = [
    *TINY_FLAGS,
    "--batch-size",
    "4",
    "--eval-sequences",
    "8",
    "--no-progress",
    "--workers",
    "1",
]


class _Planted:
    """A pickle that, if unpickled by a trusting loader, creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def _plant(target: Path, marker: Path, wrap: object = None) -> None:
    payload = _Planted(marker)
    torch.save(wrap(payload) if wrap else payload, target)


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    _plant(evil, marker, lambda p: {"step": 1, "model": p})
    with pytest.raises(UnsafeContentError) as err:
        safe_load(evil)
    msg = str(err.value)
    assert "\n" not in msg and "system" in msg and "nothing of it ran" in msg
    assert not marker.exists()
    # The very same bytes through the in-memory loader (spawned ranks' results).
    with pytest.raises(UnsafeContentError):
        safe_loads(evil.read_bytes())
    assert not marker.exists()


def test_plain_state_loads_and_damage_is_one_line(tmp_path: Path) -> None:
    state = {"w": torch.arange(3.0), "step": 4, "names": ["a", "b"], "pair": (1, 2.5), "x": None}
    path = tmp_path / "ok.pt"
    torch.save(state, path)
    loaded = safe_load(path)
    torch.testing.assert_close(loaded["w"], state["w"])
    assert loaded["pair"] == (1, 2.5) and loaded["names"] == ["a", "b"]
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04not a checkpoint")
    with pytest.raises(ConfigError, match="corrupt or unreadable") as err:
        safe_load(tmp_path / "junk.pt")
    assert not isinstance(err.value, UnsafeContentError)
    with pytest.raises(ConfigError, match="is missing"):
        safe_load(tmp_path / "absent.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["model.pt", "rank0.pt"])
def test_resume_refuses_a_planted_checkpoint_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], victim: str
) -> None:
    """The trainer's --resume: a checkpoint file replaced by a crafted pickle gives one
    line, exit 2, no marker file, and leaves the checkpoint directory as it was."""
    out = tmp_path / "run"
    args = ["train", *SMALL, "--steps", "4", "--checkpoint-interval", "2", "--out", str(out)]
    assert main(args) == 0
    step_dir = out / "checkpoints" / "step-00000004"
    marker = tmp_path / "PWNED"
    _plant(step_dir / victim, marker, lambda p: {"step": 4, "rank": 0, "model": p, "x": p})
    capsys.readouterr()
    assert main([*args, "--steps", "6", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and victim in err and "not plain data" in err, err
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_async_resume_refuses_a_planted_server_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """localsgd_server.pt goes through the same loader (localsgd/runtime/server_process.py calls
    thinwire.train.checkpoint.safe_load): a planted one stops the resume, runs nothing."""
    out = tmp_path / "async"
    out.mkdir()
    identity = {
        "algo": "async-diloco",
        "model": "tiny",
        "seq_len": 16,
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 32,
        "data": None,
        "val_fraction": 0.05,
        "seed": 0,
        "batch_size": 4,
        "workers": 1,
        "outer": "dn",
    }
    (out / "run.json").write_text(json.dumps(identity))
    marker = tmp_path / "PWNED"
    _plant(out / "localsgd_server.pt", marker, lambda p: {"theta": p, "epoch": 0})
    args = ["train", *SMALL[:-1], "2", "--algo", "async-diloco", "--steps", "4"]
    assert main([*args, "--out", str(out), "--resume", "--timeout", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "localsgd_server.pt" in err[-1] and "not plain data" in err[-1], err
    assert not marker.exists()


def test_a_ranks_result_travels_as_plain_data(tmp_path: Path) -> None:
    value = {"loss": 1.5, "t": torch.ones(2), "rows": [{"a": 1}], "msg": ("x", "tb")}
    back = _decode(_encode(value), 0)
    assert back["loss"] == 1.5 and back["rows"] == [{"a": 1}] and back["msg"] == ("x", "tb")
    marker = tmp_path / "PWNED"
    with pytest.raises(DistributedError, match="result of rank 3 is not plain data"):
        _decode(_encode(_Planted(marker)), 3)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_checkpoints_the_trainer_writes_are_plain_data(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, algo="lamb", steps=2, checkpoint_interval=2)
    train(cfg)
    for f in (tmp_path / "run" / "checkpoints").rglob("*.pt"):
        assert isinstance(safe_load(f), dict)  # no allow-list entry needed
