"""The files the network analysis reads and writes, checked as they are read.

* ``thinwire.link/1``: a fitted link (``thinwire analyze fit``): ``{"format":
  "thinwire.link/1", "fit": {...}, "rows": [...]}``; :func:`link_document` builds it,
  :func:`load_link` reads its ``fit`` back.
* a simulation (``thinwire analyze what-if``, format
  :data:`~thinwire.analysis.study.SIMULATION_FORMAT`): :func:`load_study`.
* the cost of adding gradients, from a profile or a vec-add table: :func:`reduction_cost`.

A file that cannot be read, is not UTF-8, is not JSON or lacks a field is one
:class:`~thinwire.errors.ConfigError` naming the file (and the line, where JSON says).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import read_input_bytes

__all__ = [
    "JSON_LIMIT",
    "LINK_FORMAT",
    "link_document",
    "load_link",
    "load_study",
    "read_json",
    "read_json_text",
    "reduction_cost",
]

LINK_FORMAT = "thinwire.link/1"
"""The format tag of a link fit file."""


def finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is finite as a float: ``10**400`` is not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def link_document(fit: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``thinwire.link/1`` document: the fit (``LinkFit.to_json()``) and its rows."""
    return {"format": LINK_FORMAT, "fit": fit, "rows": rows}


JSON_LIMIT = 256 << 20
"""The largest analysis file read: 256 MiB, far above the profile of a model with a
million parameter tensors."""


def read_json_text(path: str | Path, what: str) -> tuple[Any, str]:
    """A JSON file's content and its text, for errors that name a line.

    Regular files only, at most :data:`JSON_LIMIT` bytes (``/dev/zero`` or a FIFO is
    refused before anything is read), UTF-8, valid and not absurdly nested JSON;
    anything else is a one-line :class:`ConfigError` naming the file.
    """
    raw = read_input_bytes(path, f"cannot read {what}", JSON_LIMIT)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a thinwire {what} (not UTF-8 text)") from None
    try:
        return json.loads(text), text
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a thinwire {what} (JSON nested too deeply)") from None
    except ValueError:  # an integer of more than 4,300 digits
        raise ConfigError(f"{path}: not a thinwire {what} (a number too long to read)") from None


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's content; see :func:`read_json_text` for what is refused."""
    return read_json_text(path, what)[0]


def load_link(path: str) -> dict[str, Any]:
    """The ``fit`` of a ``thinwire.link/1`` file (``thinwire analyze fit``), checked."""
    data = read_json(path, "link fit")
    if not isinstance(data, dict) or data.get("format") != LINK_FORMAT:
        raise ConfigError(f"{path}:1: not a thinwire link fit (run thinwire analyze fit)")
    fit = data.get("fit")
    if not isinstance(fit, dict):
        raise ConfigError(
            f"{path}: the link fit lacks its 'fit' object; re-run thinwire analyze fit"
        )
    for key in ("bandwidth_gbps", "alpha_per_message_s"):
        value = fit.get(key)
        if not finite_number(value):
            raise ConfigError(f"{path}: fit.{key} must be a number, got {value!r}")
    table = fit.get("onebit_latency", [])  # absent from older and fp32-only fits
    ok = isinstance(table, list) and all(
        isinstance(e, list)
        and len(e) == 2
        and all(finite_number(v) for v in e)
        and e[0] > 0
        and e[1] >= 0
        for e in table
    )
    if not ok:
        raise ConfigError(
            f"{path}: fit.onebit_latency must be a list of [bytes > 0, seconds >= 0] pairs"
        )
    return fit


def reduction_cost(choice: str, profile_path: Path, meta: dict[str, Any]) -> Any:
    """The cost of adding gradients (an :class:`~thinwire.analysis.costs.AddCost`).

    ``choice`` is ``none`` (free), ``cpu`` (measured here), ``auto`` (the paper's
    ``cuda_vec_add.log`` beside a ``.bk.log`` profile, else the cost saved with the
    profile, else measured here) or the path of a vec-add table.
    """
    from thinwire.analysis.bklog import read_vec_add_table
    from thinwire.analysis.costs import AddCost

    if choice == "none":
        return AddCost.zero()
    if choice == "cpu":
        return AddCost.measure()
    if choice == "auto":
        beside = profile_path.parent / "cuda_vec_add.log"
        if profile_path.name.endswith(".bk.log") and beside.exists():
            return read_vec_add_table(beside)
        if "add_cost" in meta:
            add = AddCost.from_json(meta["add_cost"])
            return AddCost(add.sizes, add.seconds, f"{add.source} (at profile time)")
        return AddCost.measure()
    return read_vec_add_table(choice)


def load_study(path: str) -> dict[str, Any]:
    """A ``thinwire analyze what-if`` result, with its top-level fields checked."""
    from thinwire.analysis.study import SIMULATION_FORMAT

    data = read_json(path, "simulation")
    if not isinstance(data, dict) or data.get("format") != SIMULATION_FORMAT:
        raise ConfigError(
            f"{path}:1: not a thinwire simulation (run thinwire analyze what-if first)"
        )
    types = {
        "profile": dict,
        "result": dict,
        "needed": dict,
        "alternatives": list,
        "sweeps": dict,
        "buckets": dict,
        "target": (int, float),
    }
    for key, kind in types.items():
        if key not in data:
            raise ConfigError(f"{path}: simulation lacks {key!r}; re-run thinwire analyze what-if")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise ConfigError(
                f"{path}: simulation field {key!r} has the wrong type; re-run thinwire analyze "
                "simulate"
            )
    return data
