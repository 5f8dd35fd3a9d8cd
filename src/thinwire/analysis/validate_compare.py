"""Score a step-time prediction against the trainer's log: the schemes, the link, the errors.

:func:`predict_step` turns a profile and a :class:`Link` into the what-if model's step
(:func:`thinwire.analysis.network_model.simulate`) for one of three schemes, each the way
thinwire's trainer communicates:

* ``ddp``: fp32 DDP (``adamw``), the observed DDP buckets overlapped with backward,
  two in flight at once (:data:`GLOO_CONCURRENCY`);
* ``fp32-fused``: the fp32 warmup of a 1-bit optimizer, one fused allreduce after
  backward;
* ``onebit``: its compression stage, one 1-bit allreduce after backward plus the
  measured compute of :class:`~thinwire.comm.onebit_allreduce.OneBitAllreduce`, with
  the 1-bit optimizer's own update in place of AdamW's where the profile timed it;
* ``diloco``: DiLoCo, H steps alone and one fp32 allreduce of the model's
  pseudo-gradient per round (the model's ``localsgd`` scheme), per step amortized.

:func:`measured_step_s` reads the trainer's per-step seconds over a range of steps,
:func:`error_pct` scores one prediction, :func:`compare_rows` puts every scheme's
prediction next to its measurement and :func:`summarize` scores a whole table of them.
:mod:`thinwire.analysis.validate` runs the testbed experiments these compare.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from thinwire.analysis.buckets import Bucket, make_buckets
from thinwire.analysis.costs import AddCost
from thinwire.analysis.network_model import (
    BACKEND_CONCURRENCY,
    NetworkConfig,
    SimResult,
    simulate,
)
from thinwire.analysis.profile import Profile
from thinwire.errors import ConfigError

__all__ = [
    "GLOO_CONCURRENCY",
    "SCHEMES",
    "TCP_PAYLOAD_SHARE",
    "Link",
    "compare_rows",
    "error_pct",
    "measured_step_s",
    "predict_step",
    "step_prediction",
    "summarize",
]

SCHEMES = ("ddp", "fp32-fused", "onebit", "diloco")
"""``ddp``: fp32 DDP (``adamw``); ``fp32-fused``: a 1-bit optimizer's warmup stage;
``onebit``: its compression stage; ``diloco``: DiLoCo with H local steps."""

GLOO_CONCURRENCY = BACKEND_CONCURRENCY["gloo"]
"""Collectives a gloo process group runs at once (``ProcessGroupGloo``'s two threads):
DDP's bucket allreduces overlap each other's round trips."""

TCP_PAYLOAD_SHARE = 1448 / 1514
"""TCP payload per Ethernet frame: the most of a tbf link's rate a TCP stream can use."""


@dataclass(frozen=True)
class Link:
    """The link the prediction assumes."""

    bandwidth_gbps: float
    alpha_per_message_s: float = 0.0
    source: str = "nominal"
    """``nominal`` (the set rate times :data:`TCP_PAYLOAD_SHARE`, the set round trip as
    latency) or ``fitted``."""
    onebit_latency: tuple[tuple[float, float], ...] = ()
    """A 1-bit call's measured wait beyond its wire time per size (fitted links;
    empty: 2 alpha)."""

    @classmethod
    def nominal(cls, rate_bits: float, rtt_s: float = 0.0) -> Link:
        """The set rate's TCP payload, and with hosts ``rtt_s`` apart that round trip per
        message: with gloo each message of a ring costs a whole round trip (measured on
        the delayed testbed, docs/testbed.md)."""
        return cls(rate_bits * TCP_PAYLOAD_SHARE / 1e9, rtt_s, "nominal")


def _one_bucket(profile: Profile) -> list[Bucket]:
    # The 1-bit optimizers pack every gradient (warmup) or momentum (compression) into
    # ONE flat buffer after backward: one collective, whatever DDP would have done.
    ready = profile.ready
    if not ready:
        return []
    return [Bucket(tuple(p.index for p in ready), profile.grad_bytes, profile.backward_end_s)]


def _onebit_update(profile: Profile) -> Profile:
    # The profile timed AdamW's update; the 1-bit stage runs the 1-bit optimizer's,
    # timed beside it when the profile has it (meta["onebit_optimizer_s"]).
    profile = _onebit_passes(profile)
    opt = profile.meta.get("onebit_optimizer_s")
    if opt is None or profile.optimizer_s is None:
        return profile
    return replace(
        profile, iteration_s=profile.iteration_s - profile.optimizer_s + opt, optimizer_s=opt
    )


def _onebit_passes(profile: Profile) -> Profile:
    """The profile with its forward and backward passes as the 1-bit stage runs them,
    when they were timed that way (``meta["onebit_passes_s"]``); the gradients' ready
    times scaled alike.

    Why: a DDP run's passes come out slower than the same passes between 1-bit steps.
    Measured on the demo (2 emulated hosts at 100 Mbit/s, the tiny GPT, 3 runs): LAMB's
    recorded passes took 60-66 ms, the 1-bit run's own 52-53 ms, and the job's passes
    timed between 1-bit steps before that run 49-52 ms."""
    passes = profile.meta.get("onebit_passes_s")
    if passes is None or profile.forward_s is None:
        return profile
    before = profile.forward_s + profile.backward_s
    if not before > 0:
        return profile
    f = passes / before
    params = [p if p.ready_s is None else replace(p, ready_s=p.ready_s * f) for p in profile.params]
    return replace(
        profile,
        iteration_s=profile.iteration_s - before + passes,
        forward_s=profile.forward_s * f,
        backward_s=profile.backward_s * f,
        params=params,
    )


def predict_step(
    profile: Profile,
    scheme: str,
    link: Link,
    hosts: int,
    codec_s_per_byte: float = 0.0,
    add: AddCost | None = None,
    local_steps: int = 1,
) -> SimResult:
    """Predicted step of ``scheme`` (one of :data:`SCHEMES`) on ``hosts`` workers.

    ``add`` prices reductions; leave it None with a fitted link, whose effective
    bandwidth already contains them. ``codec_s_per_byte`` is charged only by ``onebit``,
    ``local_steps`` (H) only by ``diloco``.
    """
    h, concurrency = 1, 1
    if scheme == "ddp":
        concurrency = GLOO_CONCURRENCY
        kind = "observed" if profile.observed_buckets else "ddp"
        buckets, overlap, sim_scheme, codec = make_buckets(profile, kind), True, "ring", 0.0
    elif scheme == "fp32-fused":
        buckets, overlap, sim_scheme, codec = _one_bucket(profile), False, "ring", 0.0
    elif scheme == "onebit":
        profile = _onebit_update(profile)
        buckets, overlap, sim_scheme = _one_bucket(profile), False, "onebit"
        codec = codec_s_per_byte
    elif scheme == "diloco":
        # the whole model averaged once per round, after the round's last step
        buckets, overlap, sim_scheme, codec = _one_bucket(profile), False, "localsgd", 0.0
        h = local_steps
    else:
        raise ConfigError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    cfg = NetworkConfig(
        workers=hosts,
        bandwidth_gbps=link.bandwidth_gbps,
        alpha_s=link.alpha_per_message_s,
        codec_s_per_byte=codec,
        overlap=overlap,
        scheme=sim_scheme,
        local_steps=h,
        concurrency=concurrency,
        onebit_latency=tuple(tuple(e) for e in link.onebit_latency),
    )
    return simulate(profile, buckets, cfg, add)


def measured_step_s(records: Sequence[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """Mean and median of the trainer's per-step seconds (``step_s``) of steps first..last.

    Raises:
        ConfigError: fewer than 2 logged steps in the range.
    """
    secs = [float(r["step_s"]) for r in records if "step_s" in r and first <= r["step"] <= last]
    if len(secs) < 2:
        raise ConfigError(f"need >= 2 logged steps in {first}..{last}, found {len(secs)}")
    return {
        "first_step": first,
        "last_step": last,
        "steps": len(secs),
        "mean_s": statistics.fmean(secs),
        "median_s": statistics.median(secs),
        "stdev_s": statistics.stdev(secs),
    }


def error_pct(predicted: float, measured: float) -> float:
    """Signed error of a prediction in % of the measurement (negative: predicted too fast)."""
    return 100.0 * (predicted - measured) / measured


def summarize(rows: Sequence[dict[str, Any]], key: str, goal_pct: float = 15.0) -> dict[str, Any]:
    """How many rows' ``key`` error is within ``goal_pct``, and the worst one."""
    errs = [abs(r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return {
        "key": key,
        "rows": len(errs),
        "within_goal": sum(e <= goal_pct for e in errs),
        "goal_pct": goal_pct,
        "worst_abs_pct": max(errs) if errs else None,
        "mean_abs_pct": statistics.fmean(errs) if errs else None,
    }


def step_prediction(sim: SimResult) -> dict[str, float]:
    """The predicted step and its two parts (compute, exposed communication), in seconds."""
    return {"step_s": sim.step_s, "compute_s": sim.iteration_s, "exposed_s": sim.exposed_s}


def compare_rows(
    profiles: Mapping[str, Mapping[str, Profile]],
    records: Mapping[str, Sequence[dict[str, Any]]],
    spans: Mapping[str, tuple[str, int, int]],
    link: Link,
    hosts: int,
    rate_bits: float,
    local_steps: int = 1,
    rtt_s: float = 0.0,
) -> list[dict[str, Any]]:
    """One row per scheme: the measured step next to three predictions of it.

    Args:
        profiles: per training run (``algo``), its ``"colocated"`` and ``"alone"`` profile.
        records: per run, the trainer's step records (``step``, ``step_s``).
        spans: per scheme, ``(run, first step, last step)`` whose steps it is compared
            with; a span of fewer than 2 steps is left out. ``scheme@label`` compares
            another span with the same scheme.
        link: the link of the main prediction (fitted, or nominal).
        hosts: workers of the job.
        rate_bits: the link's set rate, for the nominal-link prediction and the label.
        local_steps: DiLoCo's H, for the ``diloco`` scheme.
        rtt_s: the hosts' set round trip, the nominal link's latency per message.

    Each row has ``predicted`` (co-located profile, ``link``), ``predicted_alone``
    (the alone profile: the paper's method) and ``predicted_nominal`` (co-located
    profile, nominal link), and the signed error of each in % of the measured mean.
    """
    from thinwire.testbed.rates import format_rate

    nominal = Link.nominal(rate_bits, rtt_s)
    rows = []
    for scheme, (algo, first, last) in spans.items():
        if last - first < 1:
            continue
        meas = measured_step_s(records[algo], first, last)

        def pred(p: Profile, lk: Link, s: str = scheme.split("@")[0]) -> SimResult:
            codec = float(p.meta.get("onebit_codec_s_per_byte", 0.0))
            return predict_step(p, s, lk, hosts, codec, local_steps=local_steps)

        coloc, alone = profiles[algo]["colocated"], profiles[algo]["alone"]
        row = {
            "rate": format_rate(int(rate_bits)),
            "scheme": scheme,
            "algo": algo,
            "measured": meas,
            "predicted": step_prediction(pred(coloc, link)),
            "predicted_alone": step_prediction(pred(alone, link)),
            "predicted_nominal": step_prediction(pred(coloc, nominal)),
            "link": asdict(link),
            "codec_s_per_byte": float(coloc.meta.get("onebit_codec_s_per_byte", 0.0)),
        }
        m = meas["mean_s"]
        row["err_pct"] = error_pct(row["predicted"]["step_s"], m)
        row["err_alone_pct"] = error_pct(row["predicted_alone"]["step_s"], m)
        row["err_nominal_pct"] = error_pct(row["predicted_nominal"]["step_s"], m)
        rows.append(row)
    return rows
