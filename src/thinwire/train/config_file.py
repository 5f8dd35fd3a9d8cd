"""A training run's settings as a file: ``thinwire train --config FILE``.

The file holds :class:`~thinwire.train.config.TrainConfig` fields by name, as JSON
(``.json``) or TOML (``.toml``), e.g.::

    # run.toml
    algo = "onebit-lamb"
    model = "small"
    steps = 600
    lr = 0.02
    freeze_step = "auto"
    betas = [0.9, 0.999]

Only the fields a user wants to fix need to be there; the rest keep the defaults
``thinwire train`` would use (for ``lr``, the tuned default of the file's ``algo``; for
``out_dir``, ``runs/ALGO``). Flags given on the command line beside ``--config`` win over
the file, so one file can serve a sweep: ``thinwire train --config run.toml --seed 3``.

Every run writes its resolved settings to ``OUT/config.json`` in this format, which is
how the testbed hands a run to each emulated host, and how a user repeats a run exactly:
``thinwire train --config runs/x/config.json --out runs/y``.

A key that is not a field, or a value of the wrong type, is refused with a one-line
:class:`~thinwire.errors.ConfigError` naming the file and the key: a typo must not
silently train with a default.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError, first_line
from thinwire.io import atomic_write_text, read_input
from thinwire.train.config import TrainConfig, check_types, drop_legacy_nulls, refuse_extra

__all__ = ["CONFIG_NAME", "read_config_file", "write_config_file"]

CONFIG_NAME = "config.json"
"""The name of the resolved settings a run keeps in its output directory."""

_FIELDS = {f.name for f in fields(TrainConfig)}


def _parse_toml(path: Path, text: str) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover - depends on the interpreter
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(
                f"--config {path}: TOML needs Python 3.11+ or 'pip install tomli'; "
                "a .json file works everywhere"
            ) from None
    return _parse(path, text, "TOML", tomllib.loads)


def _parse_json(path: Path, text: str) -> Any:
    return _parse(path, text, "JSON", json.loads)


def _parse(path: Path, text: str, kind: str, loads: Callable[[str], Any]) -> Any:
    """``loads(text)``; whatever the parser refuses is one line. Both parsers' decode
    errors are ``ValueError``s, as is an integer of more than 4,300 digits."""
    try:
        return loads(text)
    except RecursionError:
        raise ConfigError(f"--config {path}: not valid {kind}: nested too deeply") from None
    except ValueError as exc:
        raise ConfigError(f"--config {path}: not valid {kind}: {first_line(exc)}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The fields set in ``path`` (JSON or TOML), checked by name and type.

    Returns a dict of field name to value (lists become tuples where the field is a
    tuple); build the config with :meth:`TrainConfig.from_dict` once any overrides are
    applied. Raises :class:`ConfigError` for a missing or unreadable file, another
    format, an unknown key or a value of the wrong type.
    """
    path = Path(path)
    # Regular files only, with a size cap and a UTF-8 check: /dev/zero or a FIFO given
    # as --config is one line, not a process that grows or waits forever.
    text = read_input(path, "--config")
    if path.suffix == ".toml":
        data = _parse_toml(path, text)
    elif path.suffix == ".json":
        data = _parse_json(path, text)
    else:
        raise ConfigError(f"--config {path}: expected a .json or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a table of settings, got {type(data).__name__}"
        )
    refuse_extra(data, where=f"--config {path}")
    data.pop("extra", None)  # an empty one, as every config.json written before holds
    data = drop_legacy_nulls(data)
    for key in data:
        if key not in _FIELDS:
            raise ConfigError(
                f"--config {path}: unknown setting {key[:40]!r} (the keys are the fields "
                "of TrainConfig, e.g. algo, steps, lr, freeze_step)"
            )
    check_types(data, where=f"--config {path}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def write_config_file(cfg: TrainConfig, path: str | Path) -> Path:
    """Write every field of ``cfg`` to ``path`` as JSON (write then rename); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path
