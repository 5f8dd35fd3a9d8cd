"""Link rates as the testbed's ``tc`` shaping takes them: ``100mbit``, ``1gbit``, ...

Pure parsing and formatting, with no root, namespaces or subprocesses, so the analysis
and the CLI read a ``--rate`` the same way the testbed applies it.
"""

from __future__ import annotations

import re

from thinwire.errors import ConfigError

__all__ = ["MAX_RATE_BITS", "MIN_RATE_BITS", "format_rate", "parse_rate"]

_RATE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MIN_RATE_BITS = 100_000
"""The slowest link ``tc`` shapes well (100 kbit/s)."""
MAX_RATE_BITS = 40 * 10**9
"""The fastest rate accepted (40 Gbit/s); beyond it a veth pair is the limit anyway."""


def parse_rate(rate: str | int) -> int | None:
    """Link rate in bits per second from ``"100mbit"``, ``"1gbit"``, ``"2.5gbit"``, ...

    ``"unlimited"`` (or ``"none"``) means no shaping: veth speed, returned as None. A
    rate of 0 (``"0"``, ``"0mbit"``) is refused: it reads as "no traffic" as much as "no
    limit". Integers are taken as bits per second. Units are tc's bit units, decimal
    (``1mbit`` = 10**6 bit/s); tc's ``bps`` (bytes per second) is refused on purpose
    because it is a classic factor-8 mistake.
    """
    if isinstance(rate, int) and not isinstance(rate, bool):
        bits = rate
    else:
        text = str(rate).strip().lower()
        if text in ("unlimited", "none"):
            return None
        m = _RATE_RE.fullmatch("0bit" if re.fullmatch(r"0+(\.0*)?", text) else text)
        if m is None:
            raise ConfigError(
                f"rate {rate!r} is invalid: use a number with bit, kbit, mbit or gbit "
                "(e.g. 100mbit, 1gbit) or 'unlimited'"
            )
        bits = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits == 0:
        raise ConfigError(f"rate {rate!r} is zero; for a link without a rate limit say 'unlimited'")
    if not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
        raise ConfigError(
            f"rate {rate!r} is out of range: use between {format_rate(MIN_RATE_BITS)} "
            f"and {format_rate(MAX_RATE_BITS)}"
        )
    return bits


def format_rate(bits: int | None) -> str:
    """``100000000`` -> ``"100mbit"``; None -> ``"unlimited"``."""
    if bits is None:
        return "unlimited"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % (scale // 1000 or 1) == 0:
            value = bits / scale
            return f"{value:g}{unit}"
    return f"{bits}bit"
