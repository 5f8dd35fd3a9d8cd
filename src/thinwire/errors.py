"""Errors a user can act on.

:class:`ConfigError` is raised for bad input (an unknown algorithm, an empty data file,
an impossible size, a checkpoint that belongs to another run). Its message is one line
that names the problem; the command line prints it as ``thinwire: error: ...`` and
exits with status 2, after leaving every file it touched intact. :class:`DivergedError`
ends a run that stopped learning (exit status 3), keeping its last good checkpoint.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DivergedError", "first_line"]


class ConfigError(ValueError):
    """Bad input from the user; the message is a single line naming the problem."""


class DivergedError(RuntimeError):
    """Training diverged (non-finite or exploding loss, most steps skipped) and was
    stopped before saving a checkpoint of the diverged state. One line; the command line
    prints it as ``thinwire: error: ...`` and exits with status 3."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name if it has none): what a
    one-line error quotes of a lower-level failure."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
