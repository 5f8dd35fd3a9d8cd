"""A recorded run as the analyzer's input: ``thinwire analyze run OUT/``.

A run recorded by :class:`thinwire.comm.step_record.StepRecorder` (``thinwire train``
records every run to ``OUT/record.jsonl``; a user's own loop with one line) already holds
what a separate profile would measure, and measures it where it matters: with the
workers sharing the cores, and the network, as they really do.

:func:`load_record` reads and checks the file (format ``thinwire.record/1``: a header
line, then one line per recorded step; any problem is one line naming the file and the
line). :func:`profile_from_record` turns the steps into a
:class:`~thinwire.analysis.profile.Profile`, medians over the steps after ``skip``:

* the forward and optimizer times as recorded, and each gradient's ready time counted
  from the end of the forward pass;
* the compute alone: forward, the backward pass up to its last ready gradient, and the
  optimizer; whatever the step waited for beyond that (exposed communication) is what
  the model predicts, not an input;
* DDP's buckets as its comm hook launched them (``observed_buckets``).

:func:`measured` gives the run's own numbers to check a prediction against: its median
step, its exposed wait and the bandwidth its collectives achieved.

Tuning: ``skip`` (default 2) drops DDP's first step, which reduces in its initial bucket
layout, and the allocator's warmup; raise it if the first steps of your loop are slow
for reasons of their own (a compile, a cache).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinwire.analysis.evidence import gather
from thinwire.analysis.formats import finite_number
from thinwire.analysis.profile import ParamTiming, Profile
from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.step_record import RECORD_FORMAT, RECORD_NAME
from thinwire.errors import ConfigError
from thinwire.io import read_input

__all__ = [
    "Record",
    "analyze_record",
    "exchange_split",
    "load_record",
    "measured",
    "profile_from_record",
    "record_path",
    "record_rate_bits",
]

_STEP_NUMBERS = ("step_s", "forward_s", "backward_s", "optimizer_s")
_EXCHANGE_NUMBERS = ("exchange_s", "exchange_wait_s")
"""A 1-bit optimizer's steps only: its exchange's share of ``optimizer_s``, and of that
the time spent waiting."""


@dataclass
class Record:
    """A recorded run: its header and its recorded steps, in order."""

    path: Path
    header: dict[str, Any]
    steps: list[dict[str, Any]]

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.header.get("meta") or {})

    @property
    def threads(self) -> int | None:
        """The torch threads of the rank that recorded (None when the header lacks them)."""
        t = self.header.get("threads")
        return t if isinstance(t, int) and not isinstance(t, bool) and t > 0 else None


def record_path(path: str | Path) -> Path:
    """``path`` itself, or the record inside a run directory (``OUT/record.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        inside = path / RECORD_NAME
        if not inside.is_file():
            raise ConfigError(
                f"{path} holds no {RECORD_NAME}: record a run with thinwire train (on by "
                "default) or thinwire.comm.step_record.record_run in your loop"
            )
        return inside
    return path


def _check_header(head: Any, where: str) -> dict[str, Any]:
    if not isinstance(head, dict) or head.get("format") != RECORD_FORMAT:
        raise ConfigError(f"{where}:1: not a thinwire record (expected format {RECORD_FORMAT!r})")
    world = head.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ConfigError(f"{where}:1: world_size must be an integer >= 1, got {world!r:.40}")
    params = head.get("params")
    if not isinstance(params, list):
        raise ConfigError(f"{where}:1: 'params' must be a list")
    for i, p in enumerate(params):
        ok = isinstance(p, dict) and isinstance(p.get("name"), str)
        nbytes = p.get("nbytes") if isinstance(p, dict) else None
        if not ok or not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ConfigError(f"{where}:1: params[{i}] needs a name and an integer nbytes >= 0")
    if not isinstance(head.get("meta", {}), dict):
        raise ConfigError(f"{where}:1: 'meta' must be an object")
    return head


def _check_step(step: Any, n_params: int, where: str) -> dict[str, Any]:
    if not isinstance(step, dict):
        raise ConfigError(f"{where}: a step must be an object")
    for key in _STEP_NUMBERS:
        if not (finite_number(step.get(key)) and step[key] >= 0):
            raise ConfigError(f"{where}: {key} must be a number >= 0, got {step.get(key)!r:.40}")
    ready = step.get("ready_s")
    if not isinstance(ready, list) or len(ready) != n_params:
        raise ConfigError(f"{where}: ready_s must list one time per parameter ({n_params})")
    if any(r is not None and not (finite_number(r) and r >= 0) for r in ready):
        raise ConfigError(f"{where}: ready_s holds something other than a time >= 0 or null")
    for key in _EXCHANGE_NUMBERS:
        if key in step and not (finite_number(step[key]) and step[key] >= 0):
            raise ConfigError(f"{where}: {key} must be a number >= 0, got {step[key]!r:.40}")
    buckets = step.get("buckets", [])
    if not isinstance(buckets, list):
        raise ConfigError(f"{where}: buckets must be a list")
    for b in buckets:
        if not isinstance(b, dict) or not isinstance(b.get("params"), list):
            raise ConfigError(f"{where}: a bucket needs its list of params")
        if any(not isinstance(i, int) or not 0 <= i < n_params for i in b["params"]):
            raise ConfigError(f"{where}: a bucket names a parameter the header does not list")
        for key in ("bytes", "launch_s"):
            if not (finite_number(b.get(key)) and b[key] >= 0):
                raise ConfigError(f"{where}: bucket {key} must be a number >= 0")
    return step


def load_record(path: str | Path) -> Record:
    """Read and check a record (a file, or a run directory holding ``record.jsonl``)."""
    path = record_path(path)
    lines = read_input(path, "record").splitlines()
    if not lines:
        raise ConfigError(f"{path}: empty, not a thinwire record")
    parsed = []
    for n, line in enumerate(lines, 1):
        try:
            parsed.append(json.loads(line))
        except ValueError as exc:
            if n == len(lines):  # a run stopped mid-write: its last line may be cut
                break
            raise ConfigError(f"{path}:{n}: not JSON: {str(exc).splitlines()[0]}") from None
    head = _check_header(parsed[0], str(path))
    steps = [
        _check_step(s, len(head["params"]), f"{path}:{n}") for n, s in enumerate(parsed[1:], 2)
    ]
    if not steps:
        raise ConfigError(f"{path}: no step recorded yet")
    return Record(path, head, steps)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _steady(rec: Record, skip: int) -> list[dict[str, Any]]:
    steps = [s for s in rec.steps if s.get("step", 0) > skip]
    return steps or rec.steps[-1:]


def profile_from_record(rec: Record, skip: int = 2, model: str | None = None) -> Profile:
    """The record's compute as a profile (see the module docstring); ``model`` names it
    (default: the header's model and world size).

    Raises:
        ConfigError: the record is of a run sharded with FSDP2 (``--shard-within``), whose
            gradients do not travel as a replica-per-rank job's, which is what is predicted.
    """
    within = rec.meta.get("shard_within", 1)
    if within != 1:
        raise ConfigError(
            f"{rec.path}: the run was sharded over islands of {within} ranks (FSDP2, "
            "--shard-within); analyze run predicts jobs with a replica per rank: record "
            "the job with --shard-within 1"
        )
    steps = _steady(rec, skip)
    n = len(rec.header["params"])
    ready: list[float | None] = []
    for i in range(n):
        times = [s["ready_s"][i] for s in steps if s["ready_s"][i] is not None]
        ready.append(_median(times) if times else None)
    last_ready = _median(
        [max((r for r in s["ready_s"] if r is not None), default=0.0) for s in steps]
    )
    # A 1-bit optimizer's exchange is priced by the model (codec, wire, wait), not taken
    # as the optimizer's compute: the update alone is.
    forward, optimizer = (
        _median([s["forward_s"] for s in steps]),
        _median([s["optimizer_s"] - s.get("exchange_s", 0.0) for s in steps]),
    )
    params = [
        ParamTiming(p["name"], i, p["nbytes"], str(p.get("dtype", "float32")), ready[i])
        for i, p in enumerate(rec.header["params"])
    ]
    buckets = steps[-1].get("buckets") or None
    observed = (
        [list(b["params"]) for b in sorted(buckets, key=lambda b: b["launch_s"])]
        if buckets
        else None
    )
    meta = rec.meta
    kept = {k: v for k, v in meta.items() if k == "onebit_codec_s_per_byte"}
    split = exchange_split(steps, sum(p.nbytes for p in params))
    if split is not None:
        kept.setdefault("onebit_codec_s_per_byte", split["codec_s_per_byte"])
        kept["onebit_optimizer_s"] = split["update_s"]
    return Profile(
        model=model or f"{rec.header.get('model', 'model')} (recorded, {rec.world_size} workers)",
        iteration_s=max(forward + last_ready + optimizer, 1e-9),
        backward_s=last_ready,
        params=params,
        forward_s=forward,
        optimizer_s=optimizer,
        source="recorded",
        device=str(rec.header.get("device", "cpu")),
        batch_size=meta.get("batch_size"),
        steps=len(steps),
        observed_buckets=observed,
        meta=kept,
    )


def exchange_split(steps: list[dict[str, Any]], nbytes: int) -> dict[str, float] | None:
    """How a 1-bit optimizer's compressing steps spent their optimizer time, medians:
    ``update_s`` (without the exchange), ``codec_s`` (the exchange's compute: compression,
    server average, decompression), ``codec_s_per_byte`` (over the ``nbytes`` of
    gradient) and ``wait_s`` (blocked on the network and the other ranks). None when no
    step exchanged (another optimizer, or a record of the warmup only)."""
    comp = [s for s in steps if s.get("exchange_s", 0.0) > 0]
    if not comp:
        return None
    codec = _median([s["exchange_s"] - s.get("exchange_wait_s", 0.0) for s in comp])
    return {
        "update_s": _median([s["optimizer_s"] - s["exchange_s"] for s in comp]),
        "codec_s": codec,
        "codec_s_per_byte": codec / max(nbytes, 1),
        "wait_s": _median([s.get("exchange_wait_s", 0.0) for s in comp]),
        "steps": float(len(comp)),
    }


def measured(rec: Record, skip: int = 2) -> dict[str, Any]:
    """The run's own numbers, medians over the steps after ``skip``: ``step_s``,
    ``compute_s`` (forward + backward to the last ready gradient + optimizer),
    ``exposed_s`` (what the step waited for beyond that) and, from the comm hook's
    buckets, ``achieved_gbps``: the ring allreduce's bytes on each rank's link over the
    time from the first launch to the last completion (None without buckets); for a
    1-bit optimizer, ``onebit_exchange`` (:func:`exchange_split`; None otherwise)."""
    steps = _steady(rec, skip)
    w = rec.world_size
    compute, rates = [], []
    for s in steps:
        last = max((r for r in s["ready_s"] if r is not None), default=0.0)
        # a 1-bit optimizer's wait for its exchange is exposed communication, not compute
        compute.append(s["forward_s"] + last + s["optimizer_s"] - s.get("exchange_wait_s", 0.0))
        done = [b for b in s.get("buckets", []) if finite_number(b.get("done_s"))]
        if done and w > 1:
            span = max(b["done_s"] for b in done) - min(b["launch_s"] for b in done)
            wire = sum(ring_allreduce_bytes(int(b["bytes"]), w) for b in done)
            if span > 0:
                rates.append(wire * 8 / span / 1e9)
    step = _median([s["step_s"] for s in steps])
    return {
        "steps": len(steps),
        "step_s": step,
        "compute_s": _median(compute),
        "exposed_s": max(0.0, step - _median(compute)),
        "achieved_gbps": _median(rates) if rates else None,
        "world_size": w,
        "onebit_exchange": exchange_split(steps, sum(p["nbytes"] for p in rec.header["params"])),
    }


def record_rate_bits(rec: Record) -> float | None:
    """The link rate the run trained on: its ``meta``'s ``rate_bits``, or the testbed's
    record beside it (``OUT/testbed_run.json``); None when unknown (local workers)."""
    rate = rec.meta.get("rate_bits")
    if finite_number(rate) and rate > 0:
        return float(rate)
    beside = rec.path.parent / "testbed_run.json"
    try:
        named = json.loads(beside.read_text())["testbed"]["rate"]
        from thinwire.testbed.rates import parse_rate

        return parse_rate(str(named)) or None
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def _self_check(
    profile: Profile, seen: dict[str, Any], link: Any, add: Any
) -> dict[str, float] | None:
    """The step predicted for the run's own setting against the one it measured."""
    from thinwire.analysis.validate_compare import predict_step

    if not profile.observed_buckets:
        return None
    predicted = predict_step(profile, "ddp", link, seen["world_size"], add=add).step_s
    return {
        "predicted_step_s": predicted,
        "measured_step_s": seen["step_s"],
        "error_pct": 100.0 * (predicted - seen["step_s"]) / seen["step_s"],
    }


def _prices(rec: Record, workers: int, price: bool) -> tuple[float | None, Any]:
    """The 1-bit codec's cost per byte and the reduction table to charge (None, None:
    nothing priced)."""
    if not price or rec.header.get("device", "cpu") != "cpu":
        return None, None
    from thinwire.analysis.costs import machine_costs

    costs = machine_costs(rec.threads, workers)
    return costs["codec_s_per_byte"], costs["add"]


def _evidence(rec: Record, paths: list[str | Path] | None, model: str | None) -> dict[str, Any]:
    sources = [Path(p) for p in paths or []]
    sibling = rec.path.parent.parent / "comparison.json"
    if sibling.is_file() and sibling not in sources:
        sources.append(sibling)
    found = gather(sources, model, runs=[rec.path.parent])  # and what the run shows itself
    return {
        "evidence": {family: f.to_json() for family, f in found.items()},
        "evidence_sources": [str(p) for p in sources],
    }


def analyze_record(
    rec: Record,
    *,
    workers: int | None = None,
    bandwidth_gbps: float | None = None,
    rtt_s: float = 0.0,
    target: float = 0.9,
    skip: int = 2,
    price: bool = True,
    evidence: list[str | Path] | None = None,
    zoo_model: str | None = None,
) -> dict[str, Any]:
    """The what-if study of a recorded run (``thinwire analyze run``), and its self-check.

    ``workers`` (default: the run's own) and ``bandwidth_gbps`` (default: the link rate
    the run trained on, from its ``meta`` or its testbed record, else the bandwidth its
    collectives achieved) set the network predicted; ``rtt_s`` prices each message with
    a round trip.

    ``price``: charge the reductions and the 1-bit codec's compute at this machine's
    measured prices (:func:`~thinwire.analysis.costs.machine_costs`, at the recorded
    rank's thread count; measured once and cached).

    ``evidence``: comparison or zoo results on the same model
    (:mod:`thinwire.analysis.evidence`; ``zoo_model`` picks a zoo result's model); the
    comparison the recorded run belongs to (``OUT/../comparison.json``) is read too. A fix
    that diverged or lost quality there is ranked lower in the verdict.

    The result is :func:`~thinwire.analysis.study.run_study`'s, with ``recorded``
    (:func:`measured`), ``self_check`` (the step predicted for the run's own setting
    against the measured one; None without buckets, for another worker count, or for
    a 1-bit optimizer's record) and
    ``evidence``.
    """
    from thinwire.analysis.buckets import make_buckets
    from thinwire.analysis.network_model import BACKEND_CONCURRENCY, NetworkConfig
    from thinwire.analysis.study import run_study
    from thinwire.analysis.validate_compare import Link

    profile = profile_from_record(rec, skip)
    seen = measured(rec, skip)
    if bandwidth_gbps is None:
        rate = record_rate_bits(rec)
        bandwidth_gbps = Link.nominal(rate).bandwidth_gbps if rate else seen["achieved_gbps"]
    bandwidth_gbps = bandwidth_gbps or 10.0
    if not (finite_number(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ConfigError(f"bandwidth must be a number > 0 Gbit/s, got {bandwidth_gbps}")
    w = workers if workers is not None else rec.world_size
    if w < 1:
        raise ConfigError(f"workers must be >= 1, got {w}")
    kind = "observed" if profile.observed_buckets else "ddp"
    backend = str(rec.header.get("backend") or "gloo")
    cfg = NetworkConfig(
        workers=w,
        bandwidth_gbps=bandwidth_gbps,
        alpha_s=rtt_s,
        concurrency=BACKEND_CONCURRENCY.get(backend, BACKEND_CONCURRENCY["gloo"]),
    )
    codec, add = _prices(rec, w, price)
    saved = profile.meta.get("onebit_codec_s_per_byte")
    codec = float(saved) if saved is not None else codec
    study = run_study(
        profile,
        make_buckets(profile, kind),
        cfg,
        add,
        target=target,
        bucket_kind=kind,
        onebit_codec_s_per_byte=codec,
    )
    # A 1-bit optimizer exchanges in its step; DDP's buckets carry nothing to check.
    same = w == rec.world_size and seen["onebit_exchange"] is None
    check = (
        _self_check(profile, seen, Link(bandwidth_gbps, rtt_s, "recorded"), add) if same else None
    )
    return (
        study
        | {"recorded": seen, "self_check": check, "record_path": str(rec.path)}
        | _evidence(rec, evidence, zoo_model)
    )
