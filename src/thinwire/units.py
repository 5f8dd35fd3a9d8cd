"""Byte sizes and element counts as the command line takes them: ``64MiB``, ``1.5M``, ``10M``.

This is the one parser of sizes in thinwire. Every flag that takes a number of bytes
(``bench allreduce --min-size/--max-size``, ``analyze fit --min-bytes/--max-bytes``,
the testbed's ``--buffer``) reads it with :func:`parse_size`, so a spelling means the
same thing everywhere.

The rule for a size, in bytes:

* A plain whole number is bytes: ``1048576``. A ``B`` may follow: ``4096B``.
* A number (whole or with a decimal point: ``1.5``) followed by a unit. Case does not
  matter and a space may sit between the number and the unit (``64 mib``, ``512k``):

  ================================  ==================  ============
  unit                              meaning             ``1.5`` of it
  ================================  ==================  ============
  ``K``, ``Ki``, ``KiB``            2**10 (binary)      1,536
  ``M``, ``Mi``, ``MiB``            2**20 (binary)      1,572,864
  ``G``, ``Gi``, ``GiB``            2**30 (binary)      1,610,612,736
  ``kB`` / ``KB``                   10**3 (decimal SI)  1,500
  ``MB``                            10**6 (decimal SI)  1,500,000
  ``GB``                            10**9 (decimal SI)  1,500,000,000
  ================================  ==================  ============

  A bare letter is binary: ``64M`` of a message or a buffer is 64 MiB, as it always was
  here. A unit ending in ``B`` without the ``i`` is decimal, as in SI and as in the
  tables thinwire prints (their "MB" columns are bytes / 10**6). Prefer ``MiB`` or ``MB``
  in anything others will read: they cannot be taken for each other.
* The result must be a whole number of bytes: ``1.5K`` is 1,536 bytes, but ``0.1K``
  (102.4 bytes) is refused, not rounded, because a size quietly changed is worse than a
  one-line error.
* Refused, with a one-line :class:`~thinwire.errors.ConfigError` that names the flag and
  the value: anything else (``4 parsecs``, ``1e6``, ``0x10``), a negative size, ``inf``
  or ``nan``, zero (unless the flag allows it), and more than 2**63 - 1 bytes.

Element counts (``bench packing --numel 10M``) are not sizes: :func:`parse_count` reads
``K``, ``M``, ``G`` there as 10**3, 10**6, 10**9, as counts usually are, and otherwise
follows the same rule. Link rates (``100mbit``) are bits per second, read by
:func:`thinwire.testbed.rates.parse_rate`.
"""

from __future__ import annotations

import re
from fractions import Fraction

from thinwire.errors import ConfigError

__all__ = ["COUNT_UNITS", "MAX_SIZE_BYTES", "SIZE_UNITS", "parse_count", "parse_size"]

SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "ki": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mi": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gi": 2**30,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}
"""Bytes per unit of a size, by the unit's lower-case spelling (see the module docstring)."""

COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
"""Elements per unit of a count, by the unit's lower-case spelling: always decimal."""

MAX_SIZE_BYTES = 2**63 - 1
"""The largest size or count accepted: what a signed 64-bit integer holds. Anything larger
is a typo, and would overflow the C and tensor code it is handed to."""

# A number: digits with an optional fraction, or a fraction alone (".5"); then an optional
# unit of letters. No sign, exponent or underscores: those are refused as garbage.
_NUMBER_AND_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")
_NOT_FINITE = re.compile(r"[+-]?(inf|infinity|nan)")

_EXAMPLES = {
    "size": "use bytes (4096) or a number and a unit: 64KiB, 1.5M, 16MiB (1024-based), 16MB "
    "(1000-based)",
    "element count": "use a whole number (1000000) or a number and K, M or G (10M = 10**7)",
}
"""The hint each kind of error ends with: what a valid value looks like."""


def parse_size(value: int | str, flag: str, *, allow_zero: bool = False) -> int:
    """A number of bytes from ``value`` (``"1048576"``, ``"64MiB"``, ``"1.5M"``, ``"16MB"``).

    An ``int`` is taken as bytes as it is (a default, or a value set from Python).

    Args:
        value: what the user wrote.
        flag: the setting it came from, named in the error (``"--max-size"``).
        allow_zero: accept ``0``; zero bytes is refused otherwise.

    Raises:
        ConfigError: one line naming ``flag`` and ``value``: not a size, negative, not
            finite, zero where not allowed, a fraction of a byte, or over 2**63 - 1.
    """
    return _parse(value, flag, SIZE_UNITS, "size", "bytes", allow_zero)


def parse_count(value: int | str, flag: str, *, allow_zero: bool = False) -> int:
    """A number of elements from ``value`` (``"1000000"``, ``"10M"``, ``"2.5k"``).

    ``K``, ``M`` and ``G`` are decimal here (10**3, 10**6, 10**9); otherwise the rule is
    :func:`parse_size`'s, and so are its errors.
    """
    return _parse(value, flag, COUNT_UNITS, "element count", "elements", allow_zero)


def _parse(
    value: int | str, flag: str, units: dict[str, int], what: str, of: str, allow_zero: bool
) -> int:
    """The rule behind :func:`parse_size` and :func:`parse_count`, with their units."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        # bool is an int to Python but never a size; a float would hide a fraction
        raise ConfigError(f"{flag}: cannot read {what} {value!r}; give a whole number or text")
    if isinstance(value, int):
        amount = Fraction(value)
    else:
        text = value.strip().lower()
        if _NOT_FINITE.fullmatch(text):
            raise ConfigError(f"{flag}: {what} {value!r} is not a finite number")
        if text.startswith("-") and _NUMBER_AND_UNIT.fullmatch(text[1:].lstrip()):
            raise ConfigError(f"{flag}: {what} {value!r} is negative")
        m = _NUMBER_AND_UNIT.fullmatch(text)
        if m is None or m.group(2) not in units:
            raise ConfigError(f"{flag}: cannot read {what} {value!r}; {_EXAMPLES[what]}")
        # Fraction keeps "1.5" exact, so "1.5M" is exactly 1,572,864 with no float rounding
        amount = Fraction(m.group(1)) * units[m.group(2)]
    if amount < 0:
        raise ConfigError(f"{flag}: {what} {value!r} is negative")
    if amount.denominator != 1:
        raise ConfigError(f"{flag}: {what} {value!r} is {float(amount):g} {of}, not a whole number")
    if amount == 0 and not allow_zero:
        raise ConfigError(f"{flag}: {what} {value!r} is zero; it must be at least 1")
    if amount > MAX_SIZE_BYTES:
        raise ConfigError(f"{flag}: {what} {value!r} is too large (more than 2**63 - 1 {of})")
    return int(amount)
