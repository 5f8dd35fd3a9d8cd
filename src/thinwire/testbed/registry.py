"""Finding and removing testbed clusters, including leftovers of runs that died.

A cluster is its namespaces (``thinwire-ID-*``); the kernel is the only source of truth
for what exists. Beside that, ``/run/thinwire-testbed/ID.json`` records who uses a
cluster: the pid and start time of the process that made it (none for ``thinwire
testbed up``, which makes clusters that outlive it) and of every run attached to it
(``thinwire testbed run --id ID``, for as long as it runs). A cluster none of whose
users is alive is a leftover; ``down`` removes those and leaves clusters in use alone
unless forced.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.testbed import netns as nx
from thinwire.testbed.netns import HOST_IFNAME

__all__ = [
    "STATE_DIR",
    "ClusterInfo",
    "add_user",
    "delay_log_path",
    "forget",
    "list_clusters",
    "read_state",
    "record_delay_line",
    "remove_clusters",
    "remove_namespaces",
    "remove_user",
    "write_state",
]

STATE_DIR = Path("/run/thinwire-testbed")


@dataclass
class ClusterInfo:
    """What :func:`list_clusters` finds about one cluster on this machine."""

    cluster_id: str
    namespaces: list[str]
    hosts: int
    rate_bits: int | None
    owner_pid: int | None
    owner_alive: bool
    addresses: list[str] = field(default_factory=list)
    users: list[int] = field(default_factory=list)
    """Pids of the live processes using the cluster (its owner, attached runs)."""
    wan: dict[str, Any] | None = None
    """Delay, jitter, loss per host and the buffer (``WanConfig.to_json``), if any."""
    tiers: dict[str, Any] | None = None
    """Two tiers: ``{"islands": k, "uplink_bits": rate}`` (None: one flat network)."""


def _proc_start_time(pid: int) -> str | None:
    # Field 22 of /proc/PID/stat (start time in clock ticks) tells a reused pid apart.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _state_path(cluster_id: str) -> Path:
    return STATE_DIR / f"{nx.validate_cluster_id(cluster_id)}.json"


def read_state(cluster_id: str) -> dict[str, Any]:
    """The owner record of a cluster (empty if there is none or it is unreadable)."""
    try:
        return dict(json.loads(_state_path(cluster_id).read_text()))
    except (OSError, ValueError):
        return {}


def _alive(pid: Any, start: Any) -> bool:
    return isinstance(pid, int) and _proc_start_time(pid) == start


def _live_users(state: Mapping[str, Any]) -> list[int]:
    """Pids of the live processes using a cluster: its owner and every attached run."""
    users = [(state.get("owner_pid"), state.get("owner_start"))]
    users += [(u.get("pid"), u.get("start")) for u in state.get("users", []) if isinstance(u, dict)]
    return [pid for pid, start in users if _alive(pid, start)]


def _owner_alive(state: Mapping[str, Any]) -> bool:
    return bool(_live_users(state))


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise read-modify-write of the owner records (runs attach concurrently)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_user(cluster_id: str, pid: int) -> None:
    """Record ``pid`` as a run using ``cluster_id`` (``testbed run --id``), so that
    ``down`` without ``--force`` leaves the cluster alone while it runs."""
    with _locked():
        state = read_state(cluster_id) or {"cluster_id": cluster_id, "owner_pid": None}
        users = [u for u in state.get("users", []) if isinstance(u, dict) and u.get("pid") != pid]
        state["users"] = [*users, {"pid": pid, "start": _proc_start_time(pid)}]
        _write(cluster_id, state)


def remove_user(cluster_id: str, pid: int) -> None:
    """Drop ``pid`` (and any dead user) from the record of ``cluster_id``."""
    with _locked():
        state = read_state(cluster_id)
        if not state:
            return
        state["users"] = [
            u
            for u in state.get("users", [])
            if isinstance(u, dict) and u.get("pid") != pid and _alive(u.get("pid"), u.get("start"))
        ]
        _write(cluster_id, state)


def _write(cluster_id: str, state: Mapping[str, Any]) -> None:
    path = _state_path(cluster_id)
    atomic_write_text(path, json.dumps(state))


def remove_namespaces(names: Sequence[str]) -> None:
    # Processes keep a namespace alive after 'ip netns delete' (only the name goes),
    # so anything still running inside is killed first; hosts before the bridge.
    for name in sorted(names, key=lambda n: n.endswith("-br")):
        for pid in nx.namespace_pids(name):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        nx.delete_namespace(name)


def list_clusters() -> list[ClusterInfo]:
    """Every testbed cluster on this machine (including leftovers of dead runs)."""
    nx.require_available()
    infos = []
    for cid, names in nx.list_namespaces().items():
        state = read_state(cid)
        hosts = sorted(
            (n for n in names if not n.endswith("-br")), key=lambda n: int(n.rsplit("-h", 1)[1])
        )
        rate = nx.read_shaping(hosts[0], HOST_IFNAME) if hosts else None
        addresses = []
        for ns in hosts:
            out = nx.ip("-j", "-4", "addr", "show", "dev", HOST_IFNAME, netns=ns, check=False)
            with contextlib.suppress(ValueError, IndexError, KeyError):
                addresses.append(json.loads(out)[0]["addr_info"][0]["local"])
        pid = state.get("owner_pid")
        infos.append(
            ClusterInfo(
                cluster_id=cid,
                namespaces=names,
                hosts=len(hosts),
                rate_bits=rate,
                owner_pid=pid if isinstance(pid, int) else None,
                owner_alive=_owner_alive(state),
                addresses=addresses,
                users=_live_users(state),
                wan=state.get("wan") if isinstance(state.get("wan"), dict) else None,
                tiers=state.get("tiers") if isinstance(state.get("tiers"), dict) else None,
            )
        )
    return infos


def remove_clusters(cluster_ids: Sequence[str] | None = None, *, force: bool = False) -> list[str]:
    """Remove clusters; return the ids removed.

    With ``cluster_ids`` None, every testbed cluster whose owning process is gone
    (leftovers of a crashed run, and clusters made by ``thinwire testbed up``) is
    removed; clusters of a live run are kept unless ``force``. Named clusters are
    removed even if live only with ``force``.
    """
    nx.require_available()
    present = nx.list_namespaces()
    if cluster_ids is None:
        wanted = list(present)
    else:
        wanted = [nx.validate_cluster_id(c) for c in cluster_ids]
        missing = [c for c in wanted if c not in present]
        if missing:
            raise ConfigError(f"no testbed cluster with id {missing[0]!r} on this machine")
    removed = []
    for cid in wanted:
        live = _live_users(read_state(cid))
        if not force and live:
            if cluster_ids is not None:
                raise ConfigError(
                    f"cluster {cid!r} belongs to running process {live[0]} (a run on it); "
                    "stop it first or use --force"
                )
            continue
        remove_namespaces(present.get(cid, []))
        _kill_delay_line(read_state(cid))
        forget(cid)
        removed.append(cid)
    if cluster_ids is None and STATE_DIR.is_dir():
        # State records whose namespaces are already gone (e.g. removed by hand).
        for path in STATE_DIR.glob("*.json"):
            with contextlib.suppress(ConfigError):
                if path.stem not in present and not _owner_alive(read_state(path.stem)):
                    forget(path.stem)
    return removed


def write_state(
    cluster_id: str,
    hosts: int,
    rate_bits: int | None,
    owner: int | None,
    wan: Mapping[str, Any] | None = None,
    tiers: Mapping[str, Any] | None = None,
) -> None:
    """Record a new cluster and its owning process (None: owned by nobody, persistent)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    state = {
        "cluster_id": cluster_id,
        "hosts": hosts,
        "rate_bits": rate_bits,
        "owner_pid": owner,
        "owner_start": _proc_start_time(owner) if owner else None,
        "users": [],
        "wan": dict(wan) if wan is not None else None,
        "tiers": dict(tiers) if tiers is not None else None,
    }
    with _locked():
        _write(cluster_id, state)


def delay_log_path(cluster_id: str) -> Path:
    """Where the cluster's delay line writes its counters and errors."""
    return STATE_DIR / f"{nx.validate_cluster_id(cluster_id)}.delay.log"


def record_delay_line(cluster_id: str, pid: int) -> None:
    """Record the cluster's delay line process, so that cleanup kills it."""
    with _locked():
        state = read_state(cluster_id) or {"cluster_id": cluster_id, "owner_pid": None}
        state["delay_pid"] = pid
        state["delay_start"] = _proc_start_time(pid)
        _write(cluster_id, state)


def _kill_delay_line(state: Mapping[str, Any]) -> None:
    # It lives in the bridge namespace and dies with it; this covers a bridge namespace
    # whose name was removed by hand while the process still held it.
    pid = state.get("delay_pid")
    if _alive(pid, state.get("delay_start")):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def forget(cluster_id: str) -> None:
    """Drop the owner record (and delay line log) of a cluster that was removed."""
    for path in (_state_path(cluster_id), delay_log_path(cluster_id)):
        with contextlib.suppress(OSError):
            path.unlink()
