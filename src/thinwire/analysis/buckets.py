"""Group gradients into the buckets a framework all-reduces, from a ready-time profile.

Frameworks do not all-reduce each gradient on its own: per-message latency would
dominate. They fuse gradients into buckets and launch one collective per bucket, as
soon as all of its gradients are ready. When a bucket becomes ready decides how much
communication hides behind the rest of the backward pass, so the bucketing rule is part
of the prediction. Three rules:

* :func:`ddp_buckets` -- PyTorch DDP. Gradients are packed in backward order (DDP
  rebuilds its buckets after the first iteration in the order gradients arrived;
  ``order="reverse"`` packs in reverse registration order instead). A bucket closes
  once it reaches its cap: ``bucket_cap_mb`` (25 MiB), except that with DDP's default
  cap the first bucket closes at 1 MiB so communication starts early (DDP uses the
  explicit cap for every bucket when one is given). Gradients of different dtypes never
  share a bucket. Tuning: a smaller cap starts communication earlier but pays more per-message
  latency; on slow links with large ``alpha`` raise it, on fast links lower it.
* :func:`horovod_buckets` -- Horovod's tensor fusion as the paper models it: a bucket is
  flushed once ``cycle_ms`` (5 ms) of backward compute has passed since the last flush,
  or once it holds ``fusion_mb`` (64 MiB).
* :func:`observed_buckets` -- the buckets a real DDP comm hook reported, in launch
  order (see :func:`thinwire.analysis.measure.observe_ddp_buckets`).

A :class:`Bucket` is ready when its last gradient is ready; it is launched in list order.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.analysis.profile import ParamTiming, Profile
from thinwire.errors import ConfigError

__all__ = [
    "BUCKET_KINDS",
    "Bucket",
    "ddp_buckets",
    "horovod_buckets",
    "make_buckets",
    "observed_buckets",
]

MIB = 1024 * 1024
BUCKET_KINDS = ("ddp", "horovod", "observed")


@dataclass(frozen=True)
class Bucket:
    """Gradients all-reduced together by one collective."""

    params: tuple[int, ...]
    """Parameter indices (:attr:`ParamTiming.index`) in the bucket."""
    nbytes: int
    """Bytes of the fused gradient buffer."""
    ready_s: float
    """Seconds after backward start at which the last of its gradients is ready."""


def _make(members: list[ParamTiming]) -> Bucket:
    return Bucket(
        params=tuple(p.index for p in members),
        nbytes=sum(p.nbytes for p in members),
        ready_s=max(float(p.ready_s or 0.0) for p in members),
    )


def ddp_buckets(
    profile: Profile,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float | None = None,
    order: str = "ready",
) -> list[Bucket]:
    """PyTorch DDP's bucket assignment (see the module docstring).

    Args:
        bucket_cap_mb: cap of every bucket after the first, in MiB; None is DDP's
            default, 25 MiB.
        first_bucket_mb: cap of the first bucket in MiB; None follows DDP: 1 MiB with
            the default cap, the cap itself when ``bucket_cap_mb`` is given.
        order: ``"ready"`` (after DDP's first-iteration rebuild) or ``"reverse"``
            (reverse registration order, DDP's initial layout).
    """
    if first_bucket_mb is None:
        first_bucket_mb = 1.0 if bucket_cap_mb is None else bucket_cap_mb
    if bucket_cap_mb is None:
        bucket_cap_mb = 25.0
    if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
        raise ConfigError(
            f"bucket caps must be > 0 MiB, got first={first_bucket_mb}, cap={bucket_cap_mb}"
        )
    if order == "ready":
        params = profile.ready
    elif order == "reverse":
        params = sorted(profile.ready, key=lambda p: -p.index)
    else:
        raise ConfigError(f"unknown DDP bucket order {order!r}; choose 'ready' or 'reverse'")
    caps = (first_bucket_mb * MIB, bucket_cap_mb * MIB)
    open_buckets: dict[str, tuple[list[ParamTiming], int]] = {}  # dtype -> (members, n closed)
    closed: list[tuple[int, list[ParamTiming]]] = []  # (position of first member, members)
    first_pos: dict[str, int] = {}
    for pos, p in enumerate(params):
        members, n_closed = open_buckets.get(p.dtype, ([], 0))
        if not members:
            first_pos[p.dtype] = pos
        members.append(p)
        limit = caps[min(n_closed, 1)]
        if sum(m.nbytes for m in members) >= limit:
            closed.append((first_pos[p.dtype], members))
            open_buckets[p.dtype] = ([], n_closed + 1)
        else:
            open_buckets[p.dtype] = (members, n_closed)
    for dtype, (members, _) in open_buckets.items():
        if members:
            closed.append((first_pos[dtype], members))
    closed.sort(key=lambda item: item[0])
    return [_make(members) for _, members in closed]


def horovod_buckets(
    profile: Profile, cycle_ms: float = 5.0, fusion_mb: float = 64.0
) -> list[Bucket]:
    """Horovod-style fusion: flush after ``cycle_ms`` of backward compute or ``fusion_mb``.

    Tuning: Horovod's ``HOROVOD_CYCLE_TIME`` and ``HOROVOD_FUSION_THRESHOLD``. This is the
    rule the paper simulated; it reproduces the paper's scaling factors.
    """
    if cycle_ms <= 0 or fusion_mb <= 0:
        raise ConfigError(
            f"fusion cycle and threshold must be > 0, got cycle={cycle_ms} ms, "
            f"threshold={fusion_mb} MiB"
        )
    cycle, cap = cycle_ms * 1e-3, fusion_mb * MIB
    out: list[Bucket] = []
    members: list[ParamTiming] = []
    last_flush = 0.0
    for p in profile.ready:
        members.append(p)
        ready = float(p.ready_s or 0.0)
        if ready - last_flush >= cycle or sum(m.nbytes for m in members) >= cap:
            out.append(_make(members))
            members, last_flush = [], ready
    if members:
        out.append(_make(members))
    return out


def observed_buckets(profile: Profile) -> list[Bucket]:
    """The buckets a real DDP comm hook reported, with ready times from the profile."""
    if not profile.observed_buckets:
        raise ConfigError(
            f"profile of {profile.model!r} has no observed DDP buckets; profile with "
            "--observe-ddp or choose --buckets ddp/horovod"
        )
    by_index = {p.index: p for p in profile.params}
    out = []
    for b, indices in enumerate(profile.observed_buckets):
        members = []
        for i in indices:
            p = by_index.get(i)
            if p is None:
                raise ConfigError(f"observed bucket {b} names unknown parameter index {i}")
            if p.ready_s is not None:
                members.append(p)
        if members:
            out.append(_make(members))
    return out


def make_buckets(
    profile: Profile,
    kind: str = "ddp",
    *,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float | None = None,
    cycle_ms: float = 5.0,
    fusion_mb: float = 64.0,
) -> list[Bucket]:
    """Dispatch on ``kind`` (one of :data:`BUCKET_KINDS`)."""
    if kind == "ddp":
        return ddp_buckets(profile, bucket_cap_mb, first_bucket_mb)
    if kind == "horovod":
        return horovod_buckets(profile, cycle_ms, fusion_mb)
    if kind == "observed":
        return observed_buckets(profile)
    raise ConfigError(f"unknown bucketing {kind!r}; choose one of {', '.join(BUCKET_KINDS)}")
