"""A training step's timing profile on one worker: the input of every what-if question.

A :class:`Profile` holds what the network model needs to know about a job, measured
once on one worker (see :mod:`thinwire.analysis.measure`) or read from the paper's
``.bk.log`` files (see :mod:`thinwire.analysis.bklog`):

* the iteration time ``iteration_s`` of one worker alone (forward + backward + optimizer),
  the denominator of the scaling factor;
* the backward time ``backward_s``: communication that finishes later than this is
  exposed;
* per parameter: its size and the time its gradient became ready, counted from the
  start of the backward pass. A parameter whose gradient never became ready (frozen,
  or unused by the loss) has ``ready_s = None``: it is listed, never communicated.

Profiles are saved as JSON (``format: thinwire.profile/1``), one parameter per line so a
malformed file can be pointed at by line, and are the input of ``thinwire analyze
simulate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text

__all__ = ["PROFILE_FORMAT", "ParamTiming", "Profile", "load_profile", "save_profile"]

PROFILE_FORMAT = "thinwire.profile/1"


@dataclass(frozen=True)
class ParamTiming:
    """One parameter tensor as the communication layer sees it."""

    name: str
    """Qualified name (``blocks.0.attn.qkv.weight``), or ``layer<k>`` for ``.bk.log`` rows."""
    index: int
    """Position in ``model.parameters()`` (registration order)."""
    nbytes: int
    """Gradient size in bytes (numel * element size)."""
    dtype: str = "float32"
    """Gradient dtype; DDP never fuses gradients of different dtypes into one bucket."""
    ready_s: float | None = None
    """Median seconds from backward start until the gradient was accumulated; None if never."""


@dataclass
class Profile:
    """Timing of one worker's training step; see the module docstring."""

    model: str
    iteration_s: float
    backward_s: float
    params: list[ParamTiming]
    forward_s: float | None = None
    optimizer_s: float | None = None
    source: str = "measured"
    device: str = "cpu"
    batch_size: int | None = None
    steps: int | None = None
    observed_buckets: list[list[int]] | None = None
    """Parameter indices of each DDP bucket in launch order, as a real DDP comm hook saw."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"profile of {self.model!r}"
        if not (math.isfinite(self.iteration_s) and self.iteration_s > 0):
            raise ConfigError(f"{where}: iteration time must be > 0 s, got {self.iteration_s}")
        if not (math.isfinite(self.backward_s) and self.backward_s >= 0):
            raise ConfigError(f"{where}: backward time must be >= 0 s, got {self.backward_s}")

    @property
    def ready(self) -> list[ParamTiming]:
        """Parameters whose gradient became ready, in the order they became ready."""
        got = [p for p in self.params if p.ready_s is not None]
        # Ties (gradients accumulated by one autograd node) keep reverse registration order,
        # which is the order autograd visits them.
        return sorted(got, key=lambda p: (p.ready_s, -p.index))

    @property
    def frozen(self) -> list[ParamTiming]:
        """Parameters that never received a gradient (frozen or unused by the loss)."""
        return [p for p in self.params if p.ready_s is None]

    @property
    def grad_bytes(self) -> int:
        """Bytes communicated per step by plain data parallelism (ready gradients only)."""
        return sum(p.nbytes for p in self.ready)

    @property
    def backward_end_s(self) -> float:
        """When backward compute ends: the later of the measured end and the last gradient."""
        last = max((p.ready_s for p in self.ready), default=0.0)
        return max(self.backward_s, float(last or 0.0))

    def summary(self) -> dict[str, Any]:
        """Small JSON-ready digest for reports."""
        return {
            "model": self.model,
            "source": self.source,
            "device": self.device,
            "batch_size": self.batch_size,
            "iteration_s": self.iteration_s,
            "forward_s": self.forward_s,
            "backward_s": self.backward_end_s,
            "optimizer_s": self.optimizer_s,
            "params": len(self.params),
            "grad_bytes": self.grad_bytes,
            "frozen_params": len(self.frozen),
            "frozen_bytes": sum(p.nbytes for p in self.frozen),
        }

    def to_json(self) -> dict[str, Any]:
        head = {k: v for k, v in asdict(self).items() if k != "params"}
        return {"format": PROFILE_FORMAT, **head, "params": [asdict(p) for p in self.params]}


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON, one parameter per line; returns the path."""
    path = Path(path)
    data = profile.to_json()
    params = data.pop("params")
    head = json.dumps(data, indent=1)[:-2]  # drop the closing "\n}"
    lines = ",\n".join("  " + json.dumps(p) for p in params)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, f'{head},\n "params": [\n{lines}\n ]\n}}\n')
    return path


def _line_of(text: str, needle: str) -> int | None:
    pos = text.find(needle)
    return None if pos < 0 else text.count("\n", 0, pos) + 1


MAX_PARAM_BYTES = 1 << 50
"""The largest gradient a profile may list for one parameter (1 PiB): anything above is
a corrupt file, not a model."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _param(raw: Any, i: int, where: str) -> ParamTiming:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: params[{i}] must be an object")
    for key in ("name", "nbytes"):
        if key not in raw:
            raise ConfigError(f"{where}: params[{i}] lacks '{key}'")
    nbytes, index, ready = raw["nbytes"], raw.get("index", i), raw.get("ready_s")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise ConfigError(f"{where}: params[{i}].nbytes must be an integer, got {nbytes!r:.40}")
    if not 0 <= nbytes <= MAX_PARAM_BYTES:
        raise ConfigError(
            f"{where}: params[{i}] has size {nbytes}; must be in [0, {MAX_PARAM_BYTES}] bytes"
        )
    if not isinstance(index, int) or isinstance(index, bool):
        raise ConfigError(f"{where}: params[{i}].index must be an integer, got {index!r:.40}")
    if ready is not None and not (_is_number(ready) and math.isfinite(ready) and ready >= 0):
        raise ConfigError(
            f"{where}: params[{i}] has ready time {ready!r:.40}; must be a number >= 0"
        )
    return ParamTiming(
        name=str(raw["name"]),
        index=index,
        nbytes=nbytes,
        dtype=str(raw.get("dtype", "float32")),
        ready_s=None if ready is None else float(ready),
    )


def _check_meta(meta: Any, path: Path, text: str) -> None:
    """``meta`` is optional, but what later steps read from it must have the right type."""
    line = _line_of(text, '"meta"') or 1
    if meta is not None and not isinstance(meta, dict):
        raise ConfigError(f"{path}:{line}: 'meta' must be an object")
    codec = (meta or {}).get("onebit_codec_s_per_byte")
    if codec is not None and not (_is_number(codec) and math.isfinite(codec) and codec >= 0):
        raise ConfigError(f"{path}:{line}: meta.onebit_codec_s_per_byte must be a number >= 0")
    add = (meta or {}).get("add_cost")
    if add is not None and not isinstance(add, dict):
        raise ConfigError(f"{path}:{line}: meta.add_cost must be an object")


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON; any problem raises :class:`ConfigError` naming file and line."""
    from thinwire.analysis.formats import read_json_text

    path = Path(path)
    data, text = read_json_text(path, "profile")
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"{path}:1: not a thinwire profile (expected format {PROFILE_FORMAT!r})")
    raw_params = data.get("params")
    if not isinstance(raw_params, list):
        line = _line_of(text, '"params"') or 1
        raise ConfigError(f"{path}:{line}: 'params' must be a list")
    params = []
    for i, raw in enumerate(raw_params):
        try:
            params.append(_param(raw, i, str(path)))
        except ConfigError as exc:
            name = raw.get("name") if isinstance(raw, dict) else None
            line = _line_of(text, json.dumps(name)) if name is not None else None
            msg = str(exc)
            if line is not None:
                msg = msg.replace(f"{path}:", f"{path}:{line}:", 1)
            raise ConfigError(msg) from None
    _check_meta(data.get("meta"), path, text)
    fields = {
        k: data.get(k)
        for k in (
            "forward_s",
            "optimizer_s",
            "batch_size",
            "steps",
            "observed_buckets",
        )
    }
    try:
        return Profile(
            model=str(data.get("model", path.stem)),
            iteration_s=float(data["iteration_s"]),
            backward_s=float(data["backward_s"]),
            params=params,
            source=str(data.get("source", "measured")),
            device=str(data.get("device", "cpu")),
            meta=dict(data.get("meta") or {}),
            **fields,
        )
    except KeyError as exc:
        raise ConfigError(f"{path}:1: profile lacks {exc}") from None
    except (TypeError, ValueError, OverflowError, ConfigError) as exc:
        key = '"iteration_s"' if "iteration" in str(exc) else '"backward_s"'
        raise ConfigError(f"{path}:{_line_of(text, key) or 1}: {exc}") from None
