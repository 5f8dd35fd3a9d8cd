"""The run's store: hosted by the server on one address, and how workers find it.

Every asynchronous run keeps its messages, heartbeats and link rendezvous in a TCP store
the server hosts itself (:func:`host_store`), listening only on the address the user named
(``bind_addr``, ``THINWIRE_BIND_ADDR``, else ``MASTER_ADDR``; :mod:`thinwire.comm.bind`),
never on every interface as PyTorch's own store does. Its keys live under
``thinwire.localsgd/<run id>/``; the run id is fresh at every server start, so nothing
left from an earlier attempt (or a resumed run's predecessor) is read.

The server says where its store is, as JSON ``{run_id, host, port}``, in the launch's
store (``MASTER_ADDR:MASTER_PORT``, made by torchrun or :func:`thinwire.comm.launch.spawn`):
under the launch's prefix for the launched workers (:func:`find_launched`), and as the
root's *current* run, which is how a restarted process that knows only that address
finds it (:func:`find_current`). None of this is secret; what a stranger could do with
it is stopped by the seals of :mod:`thinwire.localsgd.auth`.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import torch.distributed as dist

from thinwire.comm.bind import bound_store
from thinwire.errors import ConfigError

__all__ = ["NAMESPACE", "connect", "find_current", "find_launched", "host_store", "root_store"]

NAMESPACE = "thinwire.localsgd"
"""Prefix of every key of the asynchronous runtime."""
_CURRENT = f"{NAMESPACE}/current"  # in the root store: where the run being served is
_RUN_ID = f"{NAMESPACE}/run_id"  # in the launch's store: the same, for launched workers


def _run_id_key(launch: int) -> str:
    # One key per run of the launch: a second run_async in the same process group must
    # not send its workers to the first run's (closed) store.
    return _RUN_ID if launch == 0 else f"{_RUN_ID}/{launch}"


_STORE_CONNECT_S = 10.0


def root_store(store: dist.Store) -> dist.Store:
    """The store below every :class:`~torch.distributed.PrefixStore` wrapped around ``store``.

    Launchers add prefixes a restarted process cannot know (``default_pg``, torchrun's
    ``/worker/attempt_N``); the root is what ``MASTER_ADDR:MASTER_PORT`` reaches.
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``; a one-line ConfigError if unreachable."""
    try:
        store = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=min(timeout_s, _STORE_CONNECT_S)),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:
        raise ConfigError(
            f"cannot reach the run's store at {host}:{port}: {str(exc).splitlines()[0]}"
        ) from None
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _where(blob: bytes, where: str) -> tuple[str, str, int]:
    try:
        d = json.loads(blob)
        return str(d["run_id"]), str(d["host"]), int(d["port"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"the run's address in {where} is unreadable") from None


def host_store(
    launch_store: dist.Store, address: str, timeout_s: float, launch: int = 0
) -> tuple[dist.TCPStore, str]:
    """On the server: host the run's store on ``address`` (a free port), publish where it
    is, and return it with the run's fresh id. ``launch`` counts the runs this process
    group has started (the same count on every rank)."""
    store = bound_store(address, timeout_s=timeout_s)
    run_id = uuid.uuid4().hex
    where = json.dumps({"run_id": run_id, "host": address, "port": store.port})
    launch_store.set(_run_id_key(launch), where)
    root_store(launch_store).set(_CURRENT, where)
    store.set(_CURRENT, where)  # also found by whoever connects to this store directly
    return store, run_id


def find_launched(
    launch_store: dist.Store, timeout_s: float, launch: int = 0
) -> tuple[dist.TCPStore, str, str]:
    """On a launched worker: ``(store client, run id, server host)`` of the group's
    ``launch``-th run (waits for its server)."""
    blob = launch_store.get(_run_id_key(launch))
    run_id, addr, port = _where(blob, "the launch's store")
    return connect(addr, port, timeout_s), run_id, addr


def find_current(addr: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, str, str]:
    """On a restarted worker that knows only ``addr:port`` (the launch's store, or the
    run's own): ``(store client, run id, server host)``.

    Raises:
        ConfigError: nothing listens there, or no asynchronous run is being served.
    """
    root = connect(addr, port, timeout_s)
    if not root.check([_CURRENT]):
        raise ConfigError(f"no asynchronous Local-SGD run is being served at {addr}:{port}")
    run_id, run_host, run_port = _where(root.get(_CURRENT), f"{addr}:{port}")
    if (run_host, run_port) == (addr, port):
        return root, run_id, run_host
    return connect(run_host, run_port, timeout_s), run_id, run_host
