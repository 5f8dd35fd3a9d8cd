"""The Local-SGD settings are one section, defined once: the trainer's config and the
asynchronous runtime's config both are :class:`AsyncSettings`, and the trainer hands the
section over whole, less Streaming DiLoCo's knobs (synchronous: ``--algo diloco``)."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, AsyncSettings, LocalSGDSettings
from thinwire.localsgd.settings import ASYNC_ONLY, LOCAL_SGD, STREAMING
from thinwire.train.async_task import async_config
from thinwire.train.config import USED_BY, TrainConfig
from thinwire.train.config_file import read_config_file

SECTION = [f.name for f in fields(AsyncSettings)]


def _other_value(name: str) -> Any:
    """A valid value of section field ``name`` that is not its default."""
    special: dict[str, Any] = {
        "outer": "nesterov",
        "staleness": "poly",
        "shard_sampling": "paper",
        "compress": "bf16",
        "compress_pull": "fp16",
        "inner_momentum": "keep",
        "slowdown": (1.0, 2.0),
        "speeds": (1.0, 3.0),
        "token_file": "/run/token",
        "bind_addr": "10.0.0.1",
        "c": 0.25,
        "dylu_ema": 0.25,
        "outer_momentum": 0.5,
        "max_push_ratio": 7.0,
        "push_warmup": 2,
        "heartbeat_s": 0.25,
    }
    if name in special:
        return special[name]
    default = next(f.default for f in fields(AsyncSettings) if f.name == name)
    assert default is not MISSING
    if isinstance(default, bool):
        return not default
    if default is None or isinstance(default, int):
        return 3
    return float(default) * 2 + 1


def test_both_configs_are_the_section_and_nothing_is_copied() -> None:
    train = {f.name: f for f in fields(TrainConfig)}
    runtime = {f.name: f for f in fields(AsyncConfig)}
    assert issubclass(TrainConfig, AsyncSettings) and issubclass(AsyncConfig, AsyncSettings)
    for name in SECTION:
        # inherited, so one default and one docstring: the section's
        assert train[name].default == runtime[name].default, name
    assert set(LOCAL_SGD) == {f.name for f in fields(LocalSGDSettings)}
    assert set(LOCAL_SGD) | set(ASYNC_ONLY) == set(SECTION)
    # which algorithms read them follows from the section too
    assert set(STREAMING) < set(LOCAL_SGD)
    assert all(USED_BY[n] == ("diloco", "async-diloco") for n in LOCAL_SGD if n not in STREAMING)
    assert all(USED_BY[n] == ("diloco",) for n in STREAMING)
    assert all(USED_BY[n] == ("async-diloco",) for n in ASYNC_ONLY)


def test_the_trainer_hands_every_setting_of_the_section_to_the_runtime() -> None:
    changed = {name: _other_value(name) for name in SECTION}
    cfg = TrainConfig(algo="async-diloco", **changed)
    acfg = async_config(cfg)
    for name, value in changed.items():
        if name in STREAMING:  # not read by async-diloco (the trainer warns): the defaults
            assert getattr(acfg, name) == getattr(AsyncConfig(), name), name
        else:
            assert getattr(acfg, name) == value, name


def test_a_config_file_written_before_the_section_reads_as_the_defaults(tmp_path: Path) -> None:
    """Files written before the section held null for "the runtime's default"; such a
    null still means the default (``--config OLD/config.json``, ``compare --resume``)."""
    old = TrainConfig(algo="async-diloco").to_dict()
    legacy = ["grace_s", "c", "dylu_ema", "dead_after_s", "connect_timeout_s"]
    legacy += ["link_timeout_s", "staleness", "calibration_steps", "min_local_steps"]
    legacy += ["shard_sampling", "compress_pull"]
    for name in legacy:
        old[name] = None
    for name in ("heartbeat_s", "token_file", "max_push_ratio"):  # not there at all then
        del old[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    values = read_config_file(path)
    assert not set(legacy) & set(values)
    assert TrainConfig.from_dict(values) == TrainConfig(algo="async-diloco")
    assert TrainConfig.from_dict(old) == TrainConfig(algo="async-diloco")
    # A null where a value is needed and None never meant a default is still refused.
    path.write_text(json.dumps({"steps": None}))
    with pytest.raises(ConfigError, match="steps must be int, got None"):
        read_config_file(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"local_steps": 0}, "local-steps must be >= 1"),
        ({"compress": "int3"}, "compress must be one of"),
        ({"inner_momentum": "sometimes"}, "inner"),
    ],
)
def test_every_algorithm_checks_the_settings_every_local_sgd_run_reads(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(algo="adamw", **changes).validate()


def test_asynchronous_combinations_are_checked_where_they_mean_something() -> None:
    # --sync with --dylu is impossible for an asynchronous run, and ignored by adamw
    # (which says so in its unused-options warning, tested with the CLI).
    TrainConfig(algo="adamw", sync=True, dylu=True).validate()
    with pytest.raises(ConfigError, match="sync mode is synchronous DiLoCo"):
        TrainConfig(algo="async-diloco", sync=True, dylu=True).validate()
    with pytest.raises(ConfigError, match="push_warmup"):
        TrainConfig(algo="async-diloco", push_warmup=40).validate()
    assert TrainConfig(algo="lamb", max_push_ratio=5.0).unused_options() == ["max_push_ratio"]
