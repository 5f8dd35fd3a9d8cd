"""Listening on the address the user named, not on every interface.

PyTorch's TCP store listens on every interface of the host whatever ``MASTER_ADDR``
says (``ss -ltn`` shows ``*:PORT``), and gloo's default device listens on the address
the host name resolves to. A run meant for loopback (``MASTER_ADDR=127.0.0.1``) is then
reachable from the whole network. These helpers bind explicitly:

* :func:`bound_store` hosts a :class:`~torch.distributed.TCPStore` on a socket this
  module binds to one address (the store's ``master_listen_fd``), so it is reachable
  only there.
* :func:`gloo_device` is a gloo device listening on one address, for
  :class:`~torch.distributed.ProcessGroupGloo` groups built by hand.
* :func:`listen_address` picks the address: an explicit one, else ``THINWIRE_BIND_ADDR``,
  else ``MASTER_ADDR`` (the address every rank already uses to reach rank 0), else the
  host name's address. :func:`route_address` is the local address that reaches a peer
  (a worker's side of a link), so the worker's sockets stay on that network too.

The launch's own store (made by torchrun or :func:`thinwire.comm.launch.spawn`) is not
made here; :func:`bound_store` is the piece a launcher can use for it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from thinwire.errors import ConfigError

__all__ = ["BIND_ENV", "bound_store", "gloo_device", "listen_address", "route_address"]

BIND_ENV = "THINWIRE_BIND_ADDR"
"""Environment variable naming the address a server listens on (overrides MASTER_ADDR)."""


def _ipv4(host: str, what: str) -> str:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"{what} {host!r} does not resolve to an IPv4 address ({exc})") from None
    return str(infos[0][4][0])


def listen_address(explicit: str | None = None) -> str:
    """The IPv4 address to listen on: ``explicit``, else ``THINWIRE_BIND_ADDR``, else
    ``MASTER_ADDR``, else this host name's address."""
    for value, what in (
        (explicit, "bind address"),
        (os.environ.get(BIND_ENV), BIND_ENV),
        (os.environ.get("MASTER_ADDR"), "MASTER_ADDR"),
    ):
        if value:
            return _ipv4(value, what)
    return _ipv4(socket.gethostname(), "the host name")


def route_address(peer: str) -> str:
    """The local IPv4 address this host uses to reach ``peer`` (no packet is sent)."""
    addr = _ipv4(peer, "address")
    if addr.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))  # a UDP "connect" only picks the route
            return str(s.getsockname()[0])
        except OSError:
            return _ipv4(socket.gethostname(), "the host name")


def bound_store(address: str, port: int = 0, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCP store hosted here, listening on ``address`` only (``port`` 0: any free one;
    the store's ``port`` attribute says which)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {address}:{port} ({exc.strerror or exc}); name an address of "
            f"this host with {BIND_ENV} (or the server's bind_addr)"
        ) from None
    try:
        store = dist.TCPStore(
            address,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now; closing ours would stop it
    return store


def gloo_device(address: str) -> dist.ProcessGroupGloo.Device:
    """A gloo device whose sockets listen on ``address`` only."""
    return dist.ProcessGroupGloo.create_device(hostname=address)
