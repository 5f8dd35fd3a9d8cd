"""Meeting the other ranks: a join with its own deadline and an error that says who is missing.

When ranks are started by hand or by a per-host launcher (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` set, no torchrun agent), PyTorch's ``env://`` start
waits for the missing ranks for the whole collective timeout (30 minutes under
``thinwire train``) and then fails with a ``DistStoreError`` traceback. :func:`join_store`
makes the same TCP store itself, with a separate, shorter deadline for the meeting
(``THINWIRE_JOIN_TIMEOUT_S``, default 300 s), and turns a failed meeting into one line:
rank 0 says how many ranks came, a worker says which address it could not reach.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent has already gathered
every rank, so PyTorch's own ``env://`` start is used unchanged.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from thinwire.errors import ConfigError

__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "join_store", "join_timeout_s"]

DEFAULT_JOIN_TIMEOUT_S = 300.0
"""Seconds rank 0 waits for the others to connect (and a worker for rank 0) by default:
long enough to start the ranks on several machines by hand."""


def join_timeout_s() -> float:
    """``THINWIRE_JOIN_TIMEOUT_S`` from the environment, or the default."""
    text = os.environ.get("THINWIRE_JOIN_TIMEOUT_S", "")
    if not text:
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"THINWIRE_JOIN_TIMEOUT_S must be a number of seconds > 0, got {text!r}")
    return value


def _env_int(name: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"environment variable {name} must be a whole number, got {text!r}"
        ) from None


def join_store(timeout_s: float, join_s: float | None = None) -> dist.Store | None:
    """The run's TCP store, once every rank has joined; None under a torchrun agent.

    Args:
        timeout_s: the deadline of every later store operation (the run's timeout).
        join_s: how long rank 0 waits for all ranks to connect, and a worker for rank
            0's store to accept it (default :func:`join_timeout_s`).

    Raises:
        ConfigError: a bad environment, or the ranks did not all meet in time (one line).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    join_s = join_timeout_s() if join_s is None else join_s
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    addr = os.environ.get("MASTER_ADDR", "")
    port = _env_int("MASTER_PORT") if os.environ.get("MASTER_PORT") else -1
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    if not addr or not 0 < port < 2**16:
        raise ConfigError(
            "MASTER_ADDR and MASTER_PORT must name rank 0's address and a TCP port "
            f"(got {addr!r} and {os.environ.get('MASTER_PORT')!r})"
        )
    where = f"{addr}:{port}"
    try:
        store = dist.TCPStore(
            addr,
            port,
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=join_s),
            wait_for_workers=True,
            multi_tenant=True,
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError, DistNetworkError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.rstrip(".")
        if rank == 0 and ("timeout" in reason.lower() or "timed out" in reason.lower()):
            raise ConfigError(
                f"rank 0 waited {join_s:.0f} s at {where} for the other {world - 1} rank(s) of "
                f"WORLD_SIZE={world}, and not all came: start them with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE (THINWIRE_JOIN_TIMEOUT_S sets the wait)"
            ) from None
        if rank == 0:
            raise ConfigError(
                f"rank 0 could not serve the run's store at {where}: {reason}"
            ) from None
        raise ConfigError(
            f"rank {rank} could not reach rank 0's store at {where} within {join_s:.0f} s "
            f"({reason}): is rank 0 running, and MASTER_ADDR/MASTER_PORT its address?"
        ) from None
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
