"""Errors a user can act on.

:class:`ConfigError` is raised for bad input (an unknown algorithm, an empty data file,
an impossible size, a checkpoint that belongs to another run). Its message is one line
that names the problem; the command line prints it as ``thinwire: error: ...`` and
exits with status 2, after leaving every file it touched intact.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Bad input from the user; the message is a single line naming the problem."""
