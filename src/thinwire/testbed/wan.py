"""Wide-area link settings of a testbed cluster: delay, jitter, loss, buffer; pure parsing.

No root, no processes: the CLI and the analysis read ``--delay 50ms`` the same way the
testbed applies it, and a bad value is a one-line :class:`~thinwire.errors.ConfigError`
before anything is created.

Semantics (each host ``h`` has a delay ``D_h``, a jitter ``J_h`` and a loss ``P_h``):

* **Delay.** A frame from host A to host B is held ``(D_A + D_B) / 2``: each host's
  delay line holds frames half its delay on the way out and half on the way in. With
  one setting for every host that is ``D`` one way and a ping round trip of ``2 D``
  (what netem on every host's egress gives); a host set to ``100ms`` among hosts at 0
  is 50 ms away in *both* directions and 100 ms round trip, as a far site is.
* **Jitter.** Each half adds a uniform ``+-J_h / 2``, so a one-way delay stays within
  ``D +- J`` (the sum of two uniforms, triangular). Frames are never reordered: a frame
  that would leave before the one ahead of it (same host, same direction) waits for it,
  so under load the delays bunch toward the top of the range, as on a real FIFO path.
  Jitter must not exceed the delay.
* **Loss.** Each half drops a frame with probability ``1 - sqrt(1 - P_h)``, so a frame
  between two hosts of the same setting is lost with probability ``P``. With loss set,
  the testbed turns segmentation offload off on that host's link (``gso_max_segs 1``
  and a TAP without TSO), so a loss drops one wire frame, never a 64 KiB burst.
* **Buffer.** Each direction of each host's delay line holds at most ``buffer_bytes``;
  a frame arriving at a full buffer is dropped (a router's tail drop). The rate times
  the time a frame is held there (``(D + J) / 2``) must fit, else ConfigError; the
  default leaves a margin of four. A buffer is a size as
  :func:`thinwire.units.parse_size` reads it: ``64MiB`` (or ``64M``) is 64 * 2**20
  bytes, ``64MB`` is 64 * 10**6.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from thinwire.errors import ConfigError
from thinwire.units import parse_size

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "MAX_DELAY_S",
    "HostLink",
    "WanConfig",
    "format_duration",
    "parse_duration",
    "parse_loss",
]

MAX_DELAY_S = 10.0
"""Longest delay or jitter accepted (10 s); longer ones are typos, not networks."""

DEFAULT_BUFFER_BYTES = 16 * 2**20
"""Per direction and host when the rate is unlimited (a 16 MiB ring holds 5 Gbit/s for
25 ms); with a rate the default is four times what ``rate x (D + J) / 2`` needs, >= 8
MiB and <= :data:`MAX_DEFAULT_BUFFER_BYTES`. The margin is for a delay line running
behind its schedule on a busy machine: frames past their time wait in the ring too
(measured: 1 MiB overflowed at 1 Gbit/s, 5 ms, per-frame mode; 16 MiB did not)."""

MIN_DEFAULT_BUFFER_BYTES = 8 * 2**20

MAX_DEFAULT_BUFFER_BYTES = 256 * 2**20
"""The largest buffer chosen without ``buffer=`` (1 Gbit/s holds 2 s); a setting that
needs more must name its buffer, since each host and direction may fill it."""

MIN_BUFFER_BYTES = 2**20
MAX_BUFFER_BYTES = 2**31

_DURATION_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(us|ms|s)$")
_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

Setting = float | str | None
PerHost = Setting | Sequence[Setting] | Mapping[int, Setting]


def parse_duration(value: float | str, what: str = "delay") -> float:
    """Seconds from ``"50ms"``, ``"1.5s"``, ``"200us"``, ``"0"`` or a float of seconds.

    A bare number other than 0 in a string is refused (is ``"50"`` ms or s?).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} {value!r} is invalid: use e.g. 50ms, 1.5s, 200us")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if text.startswith("-"):
            raise ConfigError(f"{what} {value!r} is negative: it must be >= 0")
        m = _DURATION_RE.fullmatch(text)
        if re.fullmatch(r"0+(\.0*)?", text):
            seconds = 0.0
        elif m is None:
            raise ConfigError(f"{what} {value!r} is invalid: use e.g. 50ms, 1.5s, 200us")
        else:
            seconds = float(m.group(1)) * _UNITS_S[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{what} {value!r} is invalid: it must be >= 0")
    if seconds > MAX_DELAY_S:
        raise ConfigError(f"{what} {value!r} is too long: at most {MAX_DELAY_S:g} s")
    return seconds


def parse_loss(value: float | str) -> float:
    """Loss probability from ``"0.1%"`` (a string needs the ``%``) or a float fraction."""
    if isinstance(value, bool):
        raise ConfigError(f"loss {value!r} is invalid: use a percentage such as 0.1%")
    if isinstance(value, (int, float)):
        p = float(value)
    else:
        text = str(value).strip()
        if re.fullmatch(r"0+(\.0*)?", text):
            p = 0.0
        elif not text.endswith("%"):
            raise ConfigError(f"loss {value!r} is invalid: use a percentage such as 0.1%")
        else:
            try:
                p = float(text[:-1]) / 100
            except ValueError:
                raise ConfigError(
                    f"loss {value!r} is invalid: use a percentage such as 0.1%"
                ) from None
    if not (0.0 <= p <= 1.0):
        raise ConfigError(f"loss {value!r} is out of range: use 0% to 100%")
    return p


def format_duration(seconds: float) -> str:
    """``0.05`` -> ``"50ms"``, ``0.0005`` -> ``"500us"``."""
    if seconds >= 1:
        return f"{seconds:g}s"
    if seconds >= 1e-3 or seconds == 0:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds * 1e6:g}us"


@dataclass(frozen=True)
class HostLink:
    """One host's wide-area settings (see the module docstring for their meaning)."""

    delay_s: float = 0.0
    """Delay D: one way between two hosts of this setting is D, a ping round trip 2 D."""
    jitter_s: float = 0.0
    """Jitter J: one-way delay within D +- J, never reordering; J <= D."""
    loss: float = 0.0
    """Loss P, a fraction: a frame between two hosts of this setting is lost with P."""

    @property
    def active(self) -> bool:
        return self.delay_s > 0 or self.jitter_s > 0 or self.loss > 0


@dataclass(frozen=True)
class WanConfig:
    """Per-host wide-area settings of a cluster, checked against its rate.

    Build it with :meth:`resolve`; a cluster with no delay, jitter or loss anywhere
    gets ``None`` and no delay line at all (the plain bridge, no CPU cost).
    """

    hosts: tuple[HostLink, ...]
    """One entry per host, host 0 first."""
    buffer_bytes: int
    """Per host and direction: frames beyond it are dropped (tail drop)."""

    @classmethod
    def resolve(
        cls,
        hosts: int,
        rate_bits: int | None,
        delay: PerHost = None,
        jitter: PerHost = None,
        loss: PerHost = None,
        buffer: int | str | None = None,
        *,
        unit: str = "host",
    ) -> WanConfig | None:
        """Settings per host from scalars (every host), lists (host i) or dicts (hosts
        named; the rest get the scalar default ``0``); None when nothing is set.

        ``unit`` names what the entries are in error messages: ``"island"`` when the
        settings belong to the uplinks of a two-tier cluster (``hosts`` is then the
        number of islands and ``rate_bits`` the uplink's rate).

        Raises:
            ConfigError: a malformed or negative value, loss over 100%, jitter above
                the delay, a host index out of range, or a buffer too small for the rate
                times the time a frame is held.
        """
        delays = _per_host(delay, hosts, "delay", lambda v: parse_duration(v, "delay"), unit)
        jitters = _per_host(jitter, hosts, "jitter", lambda v: parse_duration(v, "jitter"), unit)
        losses = _per_host(loss, hosts, "loss", parse_loss, unit)
        links = tuple(HostLink(d, j, p) for d, j, p in zip(delays, jitters, losses, strict=True))
        for i, h in enumerate(links):
            if h.jitter_s > h.delay_s:
                raise ConfigError(
                    f"{unit} {i}: jitter {format_duration(h.jitter_s)} exceeds its delay "
                    f"{format_duration(h.delay_s)} (a delay cannot go below zero)"
                )
        if not any(h.active for h in links):
            if buffer is not None:
                parse_size(buffer, "buffer")  # still reject a malformed value
            return None
        held = max((h.delay_s + h.jitter_s) / 2 for h in links)
        need = math.ceil(rate_bits / 8 * held) if rate_bits is not None else 0
        if buffer is None:
            size = max(4 * need, MIN_DEFAULT_BUFFER_BYTES) if rate_bits else DEFAULT_BUFFER_BYTES
            size = min(size, MAX_DEFAULT_BUFFER_BYTES)
        else:
            size = parse_size(buffer, "buffer")
            if not MIN_BUFFER_BYTES <= size <= MAX_BUFFER_BYTES:
                raise ConfigError(f"buffer {buffer!r} is out of range: use 1MiB to 2GiB")
        if size < need:
            raise ConfigError(
                f"delay x rate needs {need / 2**20:.1f} MiB per direction but the buffer is "
                f"{size / 2**20:.1f} MiB; raise --buffer or lower --delay/--jitter/--rate"
            )
        return cls(hosts=links, buffer_bytes=min(size, MAX_BUFFER_BYTES))

    def to_json(self) -> dict[str, object]:
        return {
            "buffer_bytes": self.buffer_bytes,
            "hosts": [
                {"delay_s": h.delay_s, "jitter_s": h.jitter_s, "loss": h.loss} for h in self.hosts
            ],
        }

    def describe(self) -> str:
        """One line: ``delay 50ms jitter 5ms loss 0.1%`` or per-host differences."""
        parts = []
        for name, values, fmt in (
            ("delay", [h.delay_s for h in self.hosts], format_duration),
            ("jitter", [h.jitter_s for h in self.hosts], format_duration),
            ("loss", [h.loss for h in self.hosts], lambda p: f"{p * 100:g}%"),
        ):
            if not any(values):
                continue
            if len(set(values)) == 1:
                parts.append(f"{name} {fmt(values[0])}")
            else:
                parts.append(f"{name} " + "/".join(fmt(v) for v in values))
        return " ".join(parts)


def _per_host(
    value: PerHost, hosts: int, what: str, parse: object, unit: str = "host"
) -> list[float]:
    assert callable(parse)
    if value is None:
        return [0.0] * hosts
    if isinstance(value, Mapping):
        out = [0.0] * hosts
        for key, v in value.items():
            if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < hosts:
                raise ConfigError(f"{what}: {unit} {key!r} does not exist ({unit}s 0-{hosts - 1})")
            out[key] = parse(v) if v is not None else 0.0
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != hosts:
            raise ConfigError(f"{what}: {len(value)} values given for {hosts} {unit}s")
        return [parse(v) if v is not None else 0.0 for v in value]
    return [parse(value)] * hosts
