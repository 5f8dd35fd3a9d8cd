"""Property tests of the input readers: any input is a valid result or one clean line.

Seeded generators (``random.Random`` with fixed seeds, so a failure repeats exactly) feed
the config-file reader and the checkpoint loader values of every kind: wrong types,
deep nesting, random bytes, huge numbers, nan and inf, and a valid tiny checkpoint with
keys dropped, tensors reshaped or retyped, values replaced by strings, None or lists.
The property: the reader returns a valid config or state, or raises
:class:`~thinwire.errors.ConfigError` with a one-line message; never another exception,
never a hang.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_config
from thinwire.errors import ConfigError
from thinwire.train import checkpoint as ckpt
from thinwire.train.config import TrainConfig
from thinwire.train.config_file import read_config_file
from thinwire.train.trainer import train

FIELDS = list(TrainConfig().to_dict())


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            rng.randint(-(10**6), 10**6),
            10 ** rng.randint(15, 400),
            -(10 ** rng.randint(15, 60)),
            rng.uniform(-1e3, 1e3),
            float("nan"),
            float("inf"),
            -float("inf"),
            1e308,
            5e-324,
            "",
            "auto",
            "adamw",
            "x" * rng.randint(0, 300),
            "\u00e9\u4e2d\U0001f600",
            "\n\t",
        ]
    )


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value: mostly scalars, sometimes (nested) lists and objects."""
    roll = rng.random()
    if depth < 4 and roll < 0.15:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 4 and roll < 0.25:
        keys = [*FIELDS, "powersgd_rank", "powersgd_start", "bias_correction", "junk", ""]
        return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return _scalar(rng)


def _settings(rng: random.Random) -> dict[str, Any]:
    """Mostly real field names (so the type and range checks are reached), some junk."""
    out: dict[str, Any] = {}
    for _ in range(rng.randint(1, 6)):
        key = rng.choice(FIELDS) if rng.random() < 0.9 else rng.choice(["stesp", "", "x" * 80])
        out[key] = _value(rng)
    if rng.random() < 0.3:  # the PowerSGD and bias-correction knobs, which once sat in extra
        out[rng.choice(["powersgd_rank", "powersgd_start", "bias_correction"])] = _value(rng)
    if rng.random() < 0.05:  # a file from before they had fields of their own: refused
        out["extra"] = {rng.choice(["powersgd_rank", "bias_correction", "k"]): _value(rng)}
    if rng.random() < 0.2:
        out["betas"] = [_scalar(rng) for _ in range(rng.randint(0, 4))]
    return out


def _toml(value: Any) -> str | None:
    """``value`` as a TOML value (None where TOML has none: it has no null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        items = [_toml(v) for v in value]
        return "[" + ", ".join(i for i in items if i is not None) + "]"
    pairs = ((json.dumps(str(k)), _toml(v)) for k, v in value.items())
    return "{" + ", ".join(f"{k} = {v}" for k, v in pairs if v is not None) + "}"


def _one_line(err: ConfigError) -> None:
    text = str(err)
    assert text and "\n" not in text and len(text) < 500, text


def _load_config(path: Path) -> None:
    """What ``thinwire train --config`` does with a file: read, build, validate."""
    cfg = TrainConfig.from_dict(read_config_file(path))
    cfg.validate()
    # A config that passed is really usable: every number in it is finite and in range.
    for value in cfg.to_dict().values():
        if isinstance(value, float):
            assert math.isfinite(value) or value is None


@pytest.mark.timeout(20)
@pytest.mark.parametrize("seed", range(3))
def test_config_files_of_random_settings(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    valid = 0
    for i in range(300):
        settings = _settings(rng)
        if i % 2:
            path = tmp_path / f"c{i}.json"
            path.write_text(json.dumps(settings))  # nan and inf as JSON's NaN/Infinity
        else:
            path = tmp_path / f"c{i}.toml"
            lines = ((json.dumps(k), _toml(v)) for k, v in settings.items())
            path.write_text("".join(f"{k} = {v}\n" for k, v in lines if v is not None))
        try:
            _load_config(path)
            valid += 1
        except ConfigError as err:
            _one_line(err)
    assert valid < 300  # the generator does reach the refusals


@pytest.mark.timeout(20)
def test_config_files_of_random_bytes(tmp_path: Path) -> None:
    rng = random.Random(7)
    seeds = [b'{"steps": 3}', b"steps = 3\n", b'{"betas": [0.9, 0.99]}', b"[[[[", b"\xff"]
    for i in range(400):
        base = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):  # flip, insert or delete bytes
            at = rng.randrange(len(base) + 1)
            what = rng.random()
            if what < 0.4 and at < len(base):
                base[at] = rng.randrange(256)
            elif what < 0.8:
                base[at:at] = bytes([rng.randrange(256)])
            elif at < len(base):
                del base[at]
        path = tmp_path / f"c{i}.{rng.choice(['json', 'toml'])}"
        path.write_bytes(bytes(base))
        try:
            _load_config(path)
        except ConfigError as err:
            _one_line(err)


@pytest.mark.timeout(20)
def test_config_files_of_extreme_shapes(tmp_path: Path) -> None:
    """Deep nesting, numbers of thousands of digits, a huge leftover ``extra``: refused
    in one line, at once."""
    cases = {
        "deep.json": "[" * 50_000 + "]" * 50_000,
        "deep_extra.json": '{"extra": ' + '{"a": ' * 2000 + "1" + "}" * 2001,
        "digits.json": '{"steps": ' + "9" * 4400 + "}",
        "big.json": '{"lr": ' + "9" * 400 + "}",
        "deep.toml": "steps = " + "[" * 5000 + "]" * 5000,
        "digits.toml": "steps = 1" + "0" * 5000,
        "wide_extra.json": json.dumps({"extra": {f"k{i}": "x" * 100 for i in range(50_000)}}),
        "huge_rank.json": json.dumps({"algo": "adamw-powersgd", "powersgd_rank": 10**40}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            _load_config(path)
        _one_line(err.value)


# --- the checkpoint loader ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with one checkpoint (trained once for the whole module)."""
    root = tmp_path_factory.mktemp("fuzz")
    train(tiny_config(root, steps=2, checkpoint_interval=2, eval_sequences=4, device="cpu"))
    return root / "run"


def _mutate(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """``value`` with one random change somewhere inside it."""
    if isinstance(value, dict) and value and depth < 6:
        key = rng.choice(list(value))
        roll = rng.random()
        out = dict(value)
        if roll < 0.2:
            del out[key]
        elif roll < 0.3:
            out[rng.choice(["junk", 0, None])] = _scalar(rng)
        else:
            out[key] = _mutate(rng, value[key], depth + 1)
        return out
    if isinstance(value, list | tuple) and value and depth < 6:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        if rng.random() < 0.2:
            del out_list[i]
        else:
            out_list[i] = _mutate(rng, out_list[i], depth + 1)
        return type(value)(out_list) if isinstance(value, tuple) else out_list
    if torch.is_tensor(value):
        roll = rng.random()
        if roll < 0.25 and value.numel() > 1:
            return value.reshape(-1)[: value.numel() - 1]
        if roll < 0.4 and value.numel() > 0:
            return value.reshape(-1)
        if roll < 0.55:
            return value.to(rng.choice([torch.int64, torch.float16, torch.bool, torch.uint8]))
        if roll < 0.65 and value.is_floating_point() and value.numel() > 0:
            bad = value.clone()
            bad.view(-1)[0] = float("nan")
            return bad
        if roll < 0.75:
            return torch.zeros(0)
    return rng.choice(["x", None, [], [1, 2], {}, -1, 1.5, True, float("nan"), 10**30])


@pytest.mark.timeout(25)
def test_mutated_checkpoints_load_or_fail_in_one_line(tiny_run: Path, tmp_path: Path) -> None:
    step_dir = tiny_run / "checkpoints" / "step-00000002"
    originals = {n: torch.load(step_dir / n, weights_only=True) for n in ("model.pt", "rank0.pt")}
    run_id = ckpt.read_run_id(tiny_run)
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    target = out / "checkpoints" / "step-00000002"
    rng = random.Random(11)
    refused = 0
    for _ in range(120):
        name = rng.choice(["model.pt", "rank0.pt"])
        blob = originals[name]
        for _ in range(rng.randint(1, 3)):
            blob = _mutate(rng, blob)
        torch.save(blob, target / name)
        try:
            if name == "model.pt":
                state = ckpt.load_model_state(out, 2, run_id)
                model = ckpt._model_of_run(out)
                assert model is not None and set(state) == set(model.state_dict())
            else:
                state = ckpt.load_rank_state(out, 2, 0, run_id)
                torch.set_rng_state(state["rng"])  # what the trainer applies works
        except ConfigError as err:
            _one_line(err)
            refused += 1
        torch.save(originals[name], target / name)
    assert refused > 60  # most mutations are damage, and each was named


@pytest.fixture(scope="module")
def runs_of_three_algorithms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Finished 2-step runs whose checkpoints hold each kind of state: torch's AdamW,
    thinwire's own optimizer state (1-bit LAMB, compressing from step 1) and an
    algorithm's state beside the optimizer's (PowerSGD)."""
    root = tmp_path_factory.mktemp("fuzz3")
    kw: dict[str, dict[str, Any]] = {
        "adamw": {},
        "onebit-lamb": {"freeze_step": 1},
        "adamw-powersgd": {"powersgd_start": 1},
    }
    runs = {}
    for algo, more in kw.items():
        cfg = tiny_config(root / algo, algo=algo, steps=2, checkpoint_interval=2, **more)
        cfg.eval_sequences, cfg.device = 4, "cpu"
        train(cfg)
        runs[algo] = Path(cfg.out_dir)
    return runs


@pytest.mark.timeout(25)
def test_mutated_checkpoints_that_load_also_resume(
    runs_of_three_algorithms: dict[str, Path], tmp_path: Path
) -> None:
    """What the trainer does on resume (restore the weights, then the optimizer, the
    algorithm's state and the random state, then train a step) either works or stops
    in one line naming the file: a mutation the checks let through must train."""
    from thinwire.train.algorithms import make_strategy
    from thinwire.train.model import GPT

    rng = random.Random(5)
    x = torch.randint(0, 256, (2, 16))
    rng_before = torch.get_rng_state()
    for algo, run in runs_of_three_algorithms.items():
        out = tmp_path / algo
        shutil.copytree(run, out)
        cfg = TrainConfig.from_dict(json.loads((out / "config.json").read_text()))
        target = out / "checkpoints" / "step-00000002"
        originals = {n: torch.load(target / n, weights_only=True) for n in ("model.pt", "rank0.pt")}
        run_id = ckpt.read_run_id(out)
        model = GPT(cfg.gpt_config())
        ckpt.restore_model(model, out, 2, run_id)  # the intact checkpoint restores
        assert ckpt.restore_rank_state(make_strategy(model, cfg), model, out, 2, 0, run_id) > 0
        for _ in range(30):
            name = rng.choice(["model.pt", "rank0.pt"])
            torch.save(_mutate(rng, originals[name]), target / name)
            model = GPT(cfg.gpt_config())
            strategy = make_strategy(model, cfg)
            try:
                ckpt.restore_model(model, out, 2, run_id)
                ckpt.restore_rank_state(strategy, model, out, 2, 0, run_id)
            except ConfigError as err:
                _one_line(err)
                assert str(target / name) in str(err), err
            else:
                _, loss = strategy.model(x, x)
                loss.backward()
                strategy.optimizer.step()
            torch.save(originals[name], target / name)
    torch.set_rng_state(rng_before)
