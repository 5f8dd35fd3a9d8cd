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
it is stopped by the seals of :mod:`thinwire.localsgd.runtime.auth`.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from thinwire.comm.bind import BIND_ENV, bound_store, listen_address
from thinwire.errors import ConfigError

__all__ = [
    "NAMESPACE",
    "connect",
    "find_current",
    "find_launched",
    "host_store",
    "quiet_store_warnings",
    "root_store",
    "server_address",
]

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


_CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
_CPP_ERROR = 2  # c10's levels: 0 info, 1 warning, 2 error, 3 fatal


def quiet_store_warnings() -> Callable[[], None]:
    """Raise this process's C++ log level to errors while it hosts the run's store, unless
    the user chose one (``TORCH_CPP_LOG_LEVEL``); returns what puts it back.

    PyTorch's store logs every malformed request it receives as a warning with a C++ stack
    trace (about 2 KB): anyone who can reach the port can fill the server's stderr with
    them. Such requests change nothing (the run's own messages are sealed, see
    :mod:`thinwire.localsgd.runtime.auth`), and malformed messages that do reach the run's queue
    are counted and summarised by the server itself. The level is c10's
    ``FLAGS_caffe2_log_level``, which ``TORCH_CPP_LOG_LEVEL`` sets only when torch is
    imported; where this build does not export it, nothing changes (set
    ``TORCH_CPP_LOG_LEVEL=ERROR`` for the server yourself).
    """
    if os.environ.get(_CPP_LOG_ENV):
        return lambda: None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        flag = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return lambda: None
    before = flag.value
    flag.value = max(before, _CPP_ERROR)

    def restore() -> None:
        flag.value = before

    return restore


def server_address(explicit: str | None = None) -> str:
    """The address the server will listen on and hand to its workers
    (:func:`~thinwire.comm.bind.listen_address`: ``explicit``, else ``THINWIRE_BIND_ADDR``,
    else ``MASTER_ADDR``), checked before anything starts.

    Raises:
        ConfigError: one line, when it does not resolve, or when it is not one address of
            this host: the wildcard ``0.0.0.0`` (every interface, and no address a worker
            can be sent to), a multicast or the broadcast address, or another host's.
    """
    named = [
        (value, what)
        for value, what in (
            (explicit, "the bind address"),
            (os.environ.get(BIND_ENV), BIND_ENV),
            (os.environ.get("MASTER_ADDR"), "MASTER_ADDR"),
        )
        if value
    ]
    address = listen_address(explicit)
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified or ip.is_multicast or address == "255.255.255.255":
        given, what = named[0] if named else (address, "the host name")
        kind = "the wildcard address" if ip.is_unspecified else "not the address of one host"
        raise ConfigError(
            f"{what} is {given} ({kind}): an asynchronous run listens on one address and "
            f"sends its workers there; set {BIND_ENV} to the address of the interface the "
            "workers reach this host by (127.0.0.1 on one host)"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))  # an address of another host fails here, not later
        except OSError as exc:
            given, what = named[0] if named else (address, "the host name")
            raise ConfigError(
                f"{what} is {given}, which this host cannot listen on ({exc.strerror or exc}); "
                f"set {BIND_ENV} to one of this host's addresses"
            ) from None
    return address


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
