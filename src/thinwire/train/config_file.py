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
from dataclasses import fields
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.train.config import TrainConfig

__all__ = ["CONFIG_NAME", "read_config_file", "write_config_file"]

CONFIG_NAME = "config.json"
"""The name of the resolved settings a run keeps in its output directory."""

_FIELDS = {f.name: str(f.type) for f in fields(TrainConfig)}


def _accepts(type_text: str, value: Any) -> bool:
    """Whether ``value`` (as JSON/TOML parse it) fits a field annotated ``type_text``."""
    for part in (p.strip() for p in type_text.split("|")):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue  # true/false is never a number
        if part == "int" and isinstance(value, int):
            return True
        if part == "float" and isinstance(value, int | float):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part.startswith("tuple[") and isinstance(value, list | tuple):
            return all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        if part.startswith("dict[") and isinstance(value, dict):
            return True
    return False


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
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The fields set in ``path`` (JSON or TOML), checked by name and type.

    Returns a dict of field name to value (lists become tuples where the field is a
    tuple); build the config with :meth:`TrainConfig.from_dict` once any overrides are
    applied. Raises :class:`ConfigError` for a missing or unreadable file, another
    format, an unknown key or a value of the wrong type.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    if path.suffix == ".toml":
        data = _parse_toml(path, text)
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid JSON: {exc}") from None
    else:
        raise ConfigError(f"--config {path}: expected a .json or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a table of settings, got {type(data).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _FIELDS:
            raise ConfigError(
                f"--config {path}: unknown setting {key!r} (the keys are the fields of "
                "TrainConfig, e.g. algo, steps, lr, freeze_step)"
            )
        if not _accepts(_FIELDS[key], value):
            raise ConfigError(
                f"--config {path}: {key} must be {_FIELDS[key]}, got {json.dumps(value)}"
            )
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def write_config_file(cfg: TrainConfig, path: str | Path) -> Path:
    """Write every field of ``cfg`` to ``path`` as JSON (write then rename); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path
