"""Low-level building blocks of the testbed: namespaces, veth pairs, a bridge, tc shaping.

Every command is an argument list handed to :func:`subprocess.run` (never a shell
string), and every name that reaches a command is checked against a strict pattern
first, so a cluster id cannot smuggle options or shell syntax into ``ip``/``tc``.

Names. A cluster with id ``ID`` owns exactly these namespaces, and nothing else:

* ``thinwire-ID-br``: holds the bridge ``br0`` and one veth end ``hI`` per host;
* ``thinwire-ID-hI``: host ``I``; its only link is the veth end ``tw0``.

With islands (two tiers), the bridge namespace holds one bridge per island (``br0``,
``br1``, ...) and a core bridge ``brc``; island ``k``'s bridge reaches the core over the
veth pair ``uK`` / ``cK``, its uplink (:func:`add_uplink`).

The veth pairs are created directly inside those namespaces (``ip -n NS link add ...
peer ... netns NS2``), so no interface ever appears in the root namespace, even for a
moment, and two clusters can never pick the same interface name.

Shaping. A token bucket (``tbf``) on the egress of both ends of each host's veth limits
that host's link to the same rate in both directions. Parameters, measured on this
project's machines with bulk TCP between two namespaces (see ``docs/testbed.md``):

* ``burst`` (bucket size) is ``max(rate * 1 ms, 64 KiB)``. Measured goodput of one
  TCP stream between two hosts (2026-11-29): at 1 Gbit/s a 16 KiB bucket gave 554
  Mbit/s, 64 KiB 790, 125 KB (1 ms) 952, 500 KB 957; at 100 Mbit/s 12.5 KB and 64 KiB
  both gave 95.6-95.7 Mbit/s. The ceiling is 95.6% of the rate: each 1448-byte TCP
  segment costs 1514 bytes of Ethernet frame, and tbf counts frames. The 64 KiB floor
  holds one whole GSO super-packet (what veth hands the qdisc at once) at low rates.
* ``latency`` (how long a packet may wait in the queue) is 20 ms, i.e. a queue of
  ``rate * 20 ms``. One stream measured the same with 5 ms; the extra depth is a
  margin for several senders converging on one link (a ring has one per link, an
  all-to-all has W-1), where a short queue drops packets and TCP backs off. Keep it
  well below a step time so queueing delay does not dominate small messages.

No ``netem`` is used (the kernels this runs on lack it): delay, jitter and loss come
from a user-space delay line in the bridge namespace (:mod:`thinwire.testbed.delayline`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from thinwire.errors import ConfigError

__all__ = [
    "BRIDGE_IFNAME",
    "HOST_IFNAME",
    "PREFIX",
    "NicCounters",
    "TestbedError",
    "TestbedUnavailable",
    "add_bridge",
    "add_host_link",
    "add_namespace",
    "add_uplink",
    "bridge_ns",
    "check_range_unused",
    "delete_namespace",
    "host_ns",
    "ip",
    "list_namespaces",
    "namespace_pids",
    "read_counters",
    "read_shaping",
    "require_available",
    "shape",
    "tc",
    "unavailable_reason",
    "validate_cluster_id",
]

PREFIX = "thinwire-"
"""Every namespace the testbed creates starts with this; ``down --all`` looks for it."""

HOST_IFNAME = "tw0"
"""The host's one interface; set ``GLOO_SOCKET_IFNAME`` to it inside the namespace."""

BRIDGE_IFNAME = "br0"

CORE_BRIDGE = "brc"
"""With islands: the bridge every island's uplink joins (in the bridge namespace)."""

# Short lowercase ids keep names readable and far from any option syntax ("-x").
_ID_RE = re.compile(r"^[a-z0-9]{1,12}$")
_NS_RE = re.compile(r"^thinwire-([a-z0-9]{1,12})-(br|h[0-9]{1,3})$")

BURST_SECONDS = 1e-3
MIN_BURST_BYTES = 64 * 1024
QUEUE_LATENCY_MS = 20

COMMAND_TIMEOUT_S = 30.0


class TestbedError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message carries the command and its stderr."""

    __test__ = False  # not a pytest test class, despite the name


class TestbedUnavailable(ConfigError):
    """The testbed cannot run here (not root, or iproute2 missing); one-line reason."""

    __test__ = False


@dataclass(frozen=True)
class NicCounters:
    """Byte and packet counters of one interface (Ethernet frames, headers included)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: NicCounters) -> NicCounters:
        return NicCounters(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


def unavailable_reason() -> str | None:
    """Why the testbed cannot run on this machine, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "thinwire testbed needs root (network namespaces and tc); rerun as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"thinwire testbed needs the '{tool}' command from iproute2, not found"
    return None


def require_available() -> None:
    """Raise :class:`TestbedUnavailable` with a one-line reason if the testbed can't run."""
    reason = unavailable_reason()
    if reason is not None:
        raise TestbedUnavailable(reason)


def validate_cluster_id(cluster_id: str) -> str:
    """Return ``cluster_id`` if it is 1-12 lowercase letters/digits, else ConfigError."""
    if not isinstance(cluster_id, str) or not _ID_RE.fullmatch(cluster_id):
        raise ConfigError(
            f"cluster id {cluster_id!r} is invalid: use 1-12 lowercase letters or digits"
        )
    return cluster_id


def host_ns(cluster_id: str, host: int) -> str:
    """Namespace name of host ``host`` of cluster ``cluster_id``."""
    return f"{PREFIX}{validate_cluster_id(cluster_id)}-h{int(host)}"


def bridge_ns(cluster_id: str) -> str:
    """Namespace name that holds cluster ``cluster_id``'s bridge."""
    return f"{PREFIX}{validate_cluster_id(cluster_id)}-br"


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise TestbedUnavailable(f"'{argv[0]}' not found: install iproute2") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(
            f"'{' '.join(argv)}' did not finish in {COMMAND_TIMEOUT_S:.0f} s"
        ) from exc
    if check and proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise TestbedError(f"'{' '.join(argv)}' failed: {err[0] if err else proc.returncode}")
    return proc


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n NETNS] ARGS...``; return stdout, raise TestbedError on failure."""
    argv = ["ip"] + (["-n", _checked_ns(netns)] if netns is not None else []) + list(args)
    return _run(argv, check=check).stdout


def tc(*args: str, netns: str, check: bool = True) -> str:
    """Run ``tc -n NETNS ARGS...`` (always inside a testbed namespace, never the root one)."""
    return _run(["tc", "-n", _checked_ns(netns), *args], check=check).stdout


def _checked_ns(name: str) -> str:
    if not _NS_RE.fullmatch(name):
        # Refusing anything else is what keeps the root namespace and other tools'
        # namespaces out of reach of every command below.
        raise ConfigError(f"namespace {name!r} is not a thinwire testbed namespace")
    return name


def list_namespaces() -> dict[str, list[str]]:
    """Testbed namespaces that exist now, grouped by cluster id: ``{id: [names]}``."""
    out = _run(["ip", "netns", "list"]).stdout
    clusters: dict[str, list[str]] = {}
    for line in out.splitlines():
        name = line.split(" ", 1)[0].strip()
        m = _NS_RE.fullmatch(name)
        if m:
            clusters.setdefault(m.group(1), []).append(name)
    return {k: sorted(v) for k, v in sorted(clusters.items())}


def namespace_pids(name: str) -> list[int]:
    """Process ids running inside namespace ``name`` (empty if it does not exist)."""
    out = _run(["ip", "netns", "pids", _checked_ns(name)], check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def add_namespace(name: str) -> None:
    """Create namespace ``name`` and bring its loopback up (programs expect ``lo``)."""
    _run(["ip", "netns", "add", _checked_ns(name)])
    ip("link", "set", "lo", "up", netns=name)


def delete_namespace(name: str) -> None:
    """Delete namespace ``name``; its veth ends go with it (a missing one is fine)."""
    _run(["ip", "netns", "delete", _checked_ns(name)], check=False)


def add_bridge(ns: str, name: str = BRIDGE_IFNAME) -> None:
    """Create the bridge ``name`` (``br0``) in namespace ``ns`` and bring it up; it gets
    no address."""
    ip("link", "add", name, "type", "bridge", netns=ns)
    ip("link", "set", name, "up", netns=ns)


def add_uplink(
    ns: str, island_bridge: str, island: int, *, core_bridged: bool = True
) -> tuple[str, str]:
    """Join an island's bridge to the core bridge (both in ``ns``) with a veth pair:
    ``u<island>`` in the island's bridge, ``c<island>`` in the core's. Returns the two
    names; shaping both ends makes the island's one link to the other islands. With
    ``core_bridged=False`` the core end is left out of the core bridge, for the delay
    line to serve (:func:`thinwire.testbed.delayline.wire_uplinks`)."""
    up_end, core_end = f"u{int(island)}", f"c{int(island)}"
    ip("link", "add", up_end, "type", "veth", "peer", "name", core_end, netns=ns)
    ip("link", "set", up_end, "master", island_bridge, netns=ns)
    if core_bridged:
        ip("link", "set", core_end, "master", CORE_BRIDGE, netns=ns)
    for dev in (up_end, core_end):
        ip("link", "set", dev, "up", netns=ns)
    return up_end, core_end


def add_host_link(
    host_ns_name: str,
    br_ns: str,
    port: str,
    address_cidr: str,
    *,
    bridged: bool = True,
    bridge: str = BRIDGE_IFNAME,
) -> None:
    """Join a host namespace to the bridge: veth ``tw0`` (host) <-> ``port`` (bridge).

    The host end gets ``address_cidr``; the kernel adds only the connected route for
    that /24, and no default route is ever added, so the host can reach its cluster
    peers and nothing else. With ``bridged=False`` the bridge end is left out of the
    bridge, for the delay line to serve (:mod:`thinwire.testbed.delayline`).
    """
    _checked_ns(br_ns)
    ip(
        "link",
        "add",
        HOST_IFNAME,
        "type",
        "veth",
        "peer",
        "name",
        port,
        "netns",
        br_ns,
        netns=host_ns_name,
    )
    if bridged:
        ip("link", "set", port, "master", bridge, netns=br_ns)
    ip("link", "set", port, "up", netns=br_ns)
    ip("addr", "add", address_cidr, "dev", HOST_IFNAME, netns=host_ns_name)
    ip("link", "set", HOST_IFNAME, "up", netns=host_ns_name)


def shape(ns: str, dev: str, rate_bits: int) -> None:
    """Limit the egress of ``dev`` in ``ns`` to ``rate_bits`` with a token bucket."""
    burst = max(int(rate_bits / 8 * BURST_SECONDS), MIN_BURST_BYTES)
    tc(
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{int(rate_bits)}bit",
        "burst",
        str(burst),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
        netns=ns,
    )


def read_shaping(ns: str, dev: str) -> int | None:
    """The tbf rate (bit/s) on ``dev`` in ``ns``, or None if it is not shaped."""
    out = tc("-j", "qdisc", "show", "dev", dev, netns=ns, check=False)
    try:
        qdiscs = json.loads(out) if out.strip() else []
    except json.JSONDecodeError:
        return None
    for q in qdiscs:
        if q.get("kind") == "tbf":
            rate = q.get("options", {}).get("rate")
            if isinstance(rate, int):
                return rate * 8  # iproute2's JSON reports tbf rate in bytes per second
    return None


def read_counters(ns: str, dev: str = HOST_IFNAME) -> NicCounters:
    """Current tx/rx byte and packet counters of ``dev`` inside namespace ``ns``."""
    out = ip("-s", "-j", "link", "show", "dev", dev, netns=ns)
    stats = json.loads(out)[0]["stats64"]
    return NicCounters(
        tx_bytes=int(stats["tx"]["bytes"]),
        rx_bytes=int(stats["rx"]["bytes"]),
        tx_packets=int(stats["tx"]["packets"]),
        rx_packets=int(stats["rx"]["packets"]),
    )


def check_range_unused(prefix: str) -> None:
    """Refuse to run on a machine whose root namespace already uses ``prefix.0/24``.

    The range must stay private to the namespaces, so no address of ours can ever
    shadow a real one.
    """
    out = ip("-j", "-4", "addr", "show")
    for link in json.loads(out or "[]"):
        for a in link.get("addr_info", []):
            if str(a.get("local", "")).startswith(prefix + "."):
                raise TestbedUnavailable(
                    f"this machine already uses {prefix}.0/24 on {link.get('ifname')}; "
                    "the testbed needs that range for itself"
                )
