"""The testbed's wide-area options, shared by every command that brings up a cluster.

``--delay``, ``--jitter``, ``--loss`` for every host, ``--host-delay H=V`` (and jitter,
loss) for one, ``--buffer`` for the delay line; :func:`wan_options` turns them into the
keyword arguments of :class:`thinwire.testbed.cluster.Cluster` (semantics:
:mod:`thinwire.testbed.wan`).
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["add_wan_arguments", "wan_options"]


def add_wan_arguments(p: argparse.ArgumentParser) -> None:
    """Add the delay, jitter, loss and buffer options to ``p``."""
    p.add_argument(
        "--delay",
        default=None,
        help="one-way delay between hosts, e.g. 50ms (ping shows twice it; with --islands "
        "between islands, on their uplinks); default none",
    )
    p.add_argument("--jitter", default=None, help="one-way delay varies by +- this; no reorder")
    p.add_argument("--loss", default=None, help="chance a frame is lost, e.g. 0.1%%")
    for what, example in (("delay", "4=150ms"), ("jitter", "4=10ms"), ("loss", "4=1%%")):
        p.add_argument(
            f"--host-{what}",
            action="append",
            default=[],
            metavar="HOST=VALUE",
            help=f"{what} of one host (with --islands: one island's uplink) instead of "
            f"--{what} (repeatable), e.g. {example}",
        )
    p.add_argument(
        "--buffer",
        default=None,
        help="delay line buffer per host and direction, e.g. 64MiB "
        "(default: 4 x rate x delay / 2, >= 8MiB)",
    )


def _per_host(
    base: str | None, overrides: list[str], hosts: int, what: str, unit: str
) -> list | None:
    """``--delay`` for every host (or island), then ``--host-delay H=V`` for some."""
    if base is None and not overrides:
        return None
    values: list[str | None] = [base] * max(hosts, 0)
    for item in overrides:
        host, sep, value = item.partition("=")
        if not sep or not host.strip().isdigit():
            raise ConfigError(f"--host-{what} {item!r} is invalid: use HOST=VALUE, e.g. 4=150ms")
        if not 0 <= int(host) < hosts:
            raise ConfigError(
                f"--host-{what} {item!r}: {unit} {host} does not exist (0-{hosts - 1})"
            )
        values[int(host)] = value
    return values


def wan_options(args: argparse.Namespace, hosts: int, islands: int = 1) -> dict[str, Any]:
    """The ``Cluster`` keyword arguments the options ask for (empty: a plain LAN). With
    ``islands`` > 1 the settings are the uplinks', one per island."""
    count, unit = (islands, "island") if islands > 1 else (hosts, "host")
    out = {
        what: _per_host(getattr(args, what), getattr(args, f"host_{what}"), count, what, unit)
        for what in ("delay", "jitter", "loss")
    }
    out["buffer"] = args.buffer
    return {k: v for k, v in out.items() if v is not None}
