"""An emulated cluster of N hosts on one machine, as a context manager.

Usage::

    with Cluster(hosts=4, rate="100mbit") as c:
        res = c.run([sys.executable, "train.py"])
        print(res.summary())          # exit codes, bytes on the wire, link utilization

    # a wide-area network: 50 ms one way (100 ms ping), host 3 far away (200 ms ping)
    Cluster(hosts=4, rate="100mbit", delay=["50ms", "50ms", "50ms", "350ms"], loss="0.1%")

Each host is a network namespace with one veth (``tw0``) into a bridge that lives in a
namespace of its own, so the root namespace is never touched. Every host link is rate
limited in both directions (see :mod:`thinwire.testbed.netns` for the tbf parameters);
with delay, jitter or loss a delay line sits in each host's path after the rate limit
(:mod:`thinwire.testbed.delayline`; semantics in :mod:`thinwire.testbed.wan`).
:meth:`Cluster.run` starts the command once per host with the variables
``torch.distributed``'s ``env://`` rendezvous reads (``MASTER_ADDR`` is host 0,
``RANK`` is the host index) plus ``GLOO_SOCKET_IFNAME=tw0``, so a script that calls
:func:`thinwire.comm.launch.init_from_env`, or ``thinwire train``, runs unchanged.
torchrun works too, through placeholders in the command: ``{rank}``, ``{hosts}``,
``{master_addr}``, ``{master_port}``, ``{address}``, ``{ifname}``.

Addresses: host ``i`` is ``10.213.0.(i+1)/24``. The /24 exists only inside the
cluster's namespaces (each cluster has its own, so clusters never see each other);
no namespace gets a default route and the bridge namespace has no address and no
forwarding, so nothing can leave the cluster.

Teardown always happens: on leaving the ``with`` block, on an exception, on Ctrl-C.
A process killed with SIGKILL cannot clean up; its namespaces stay behind and
:func:`~thinwire.testbed.registry.remove_clusters` (``thinwire testbed down``) finds and
removes them, using the owner record kept in ``/run/thinwire-testbed/ID.json`` to leave
live runs alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.testbed import netns as nx
from thinwire.testbed.netns import HOST_IFNAME, NicCounters
from thinwire.testbed.rates import parse_rate
from thinwire.testbed.registry import (
    add_user,
    delay_log_path,
    forget,
    list_clusters,
    record_delay_line,
    remove_namespaces,
    remove_user,
    write_state,
)
from thinwire.testbed.results import HostResult, RunResult
from thinwire.testbed.wan import PerHost, WanConfig
from thinwire.testbed.warm_host import WarmHosts, WarmProcess

__all__ = ["CORE_BRIDGE", "DEFAULT_GRACE_S", "MAX_HOSTS", "SUBNET_PREFIX", "Cluster"]

CORE_BRIDGE = nx.CORE_BRIDGE

SUBNET_PREFIX = "10.213.0"
"""Hosts are ``SUBNET_PREFIX.(i+1)/24``, an address range used only inside namespaces."""

MAX_HOSTS = 64
DEFAULT_MASTER_PORT = 29500

# After the first rank fails, the others get this long to notice (gloo raises on a
# closed peer socket within a second or two) before they are terminated.
DEFAULT_GRACE_S = 5.0
KILL_AFTER_S = 5.0


class Cluster:
    """N emulated hosts joined by rate-limited links; a context manager.

    Args:
        hosts: number of hosts (namespaces), 1 to 64.
        rate: link rate of every host, both directions: ``"100mbit"``, ``"1gbit"``,
            ``"unlimited"`` (veth speed, useful to see where compression stops paying).
            A ring allreduce reaches about 95% of this as bus bandwidth, the rest is
            Ethernet/IP/TCP headers (54 bytes per 1448-byte segment).
        cluster_id: 1-12 lowercase letters/digits; random if omitted. Names every
            namespace (``thinwire-ID-h0``...), so concurrent clusters never collide.
        persistent: keep the cluster when this object is closed (``thinwire testbed
            up``); remove it later with ``registry.remove_clusters``.
        master_port: port of the rendezvous on host 0 (each cluster has its own
            network stack, so the default never clashes with other runs).
        delay: one-way delay between hosts, ``"50ms"`` or seconds (ping shows twice
            it); a list (one per host) or a dict ``{host: delay}`` (others 0) makes
            some sites far: hosts A and B are ``(D_A + D_B) / 2`` apart each way.
        jitter: per frame, one-way delay within ``delay +- jitter``; never reorders.
        loss: ``"0.1%"`` or a fraction: chance a frame between two hosts is lost.
        buffer: bytes the delay line holds per host and direction (``"64MiB"``);
            default four times ``rate x (delay + jitter) / 2``. Too small is a ConfigError.
        wan_seed: seed of the delay line's loss and jitter draws (reproducible runs).
        islands: two tiers: the hosts split into this many islands of consecutive hosts
            (hosts 0-1 and 2-3 for 4 hosts in 2), each host on its island's bridge at
            ``rate``; the islands reach each other only through their uplinks, one per
            island at ``uplink`` both ways (HSDP: shards inside an island, replicas
            across). 1 (the default) is one flat network. With islands, ``delay``,
            ``jitter`` and ``loss`` sit on the uplinks, one entry per island (lists and
            dicts index islands): islands A and B are ``(D_A + D_B) / 2`` apart one way,
            hosts inside an island are not delayed, and ``buffer`` sizes against the
            uplink's rate.
        uplink: each island's link to the others (``"100mbit"``); needed with islands.
    """

    def __init__(
        self,
        hosts: int,
        rate: str | int | None = "1gbit",
        *,
        cluster_id: str | None = None,
        persistent: bool = False,
        master_port: int = DEFAULT_MASTER_PORT,
        delay: PerHost = None,
        jitter: PerHost = None,
        loss: PerHost = None,
        buffer: int | str | None = None,
        wan_seed: int | None = None,
        islands: int = 1,
        uplink: str | int | None = None,
    ) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ConfigError(f"hosts must be an integer from 1 to {MAX_HOSTS}, got {hosts!r}")
        if not 1 <= int(master_port) <= 65535:
            raise ConfigError(f"master_port must be 1-65535, got {master_port}")
        self.hosts = hosts
        self.rate_bits = parse_rate(rate) if rate is not None else None
        self.cluster_id = nx.validate_cluster_id(
            cluster_id if cluster_id is not None else secrets.token_hex(4)
        )
        self.persistent = persistent
        self.master_port = int(master_port)
        self.islands, self.uplink_bits = _tiers(hosts, islands, uplink)
        if self.islands == 1:
            self.wan = WanConfig.resolve(hosts, self.rate_bits, delay, jitter, loss, buffer)
        else:
            self.wan = WanConfig.resolve(
                self.islands, self.uplink_bits, delay, jitter, loss, buffer, unit="island"
            )
        """Delay, jitter and loss per host (per island's uplink with islands); None for a
        plain (LAN) cluster."""
        self.wan_seed = wan_seed
        self.delay_line: subprocess.Popen[bytes] | None = None
        self._warm = WarmHosts(self.namespaces)
        """Servers that start thinwire's own commands on the hosts without importing torch
        again (:mod:`thinwire.testbed.warm_host`); up from the first such run."""
        self._created: list[str] = []
        self._is_up = False
        self._attached = False

    @classmethod
    def attach(cls, cluster_id: str) -> Cluster:
        """A handle on an existing cluster (e.g. one made by ``thinwire testbed up``).

        This process is recorded as a user of the cluster until :meth:`close`, so
        ``thinwire testbed down`` refuses to remove it meanwhile (unless ``--force``).
        Closing it leaves the cluster in place.
        """
        nx.require_available()
        info = {c.cluster_id: c for c in list_clusters()}.get(nx.validate_cluster_id(cluster_id))
        if info is None or info.hosts == 0:
            raise ConfigError(f"no testbed cluster with id {cluster_id!r} on this machine")
        tiers = info.tiers or {}
        c = cls(
            info.hosts,
            info.rate_bits,
            cluster_id=cluster_id,
            persistent=True,
            islands=int(tiers.get("islands", 1)),
            uplink=tiers.get("uplink_bits"),
        )
        c._is_up = True
        # Recorded as a user until close(): 'testbed down' spares the cluster meanwhile.
        add_user(c.cluster_id, os.getpid())
        c._attached = True
        return c

    # -- names -----------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        """Host namespace names, host 0 first."""
        return [nx.host_ns(self.cluster_id, i) for i in range(self.hosts)]

    @property
    def bridge_namespace(self) -> str:
        return nx.bridge_ns(self.cluster_id)

    def island_of(self, host: int) -> int:
        """The island of host ``host`` (0 on a flat network)."""
        return host // (self.hosts // self.islands)

    def uplink_counters(self) -> list[NicCounters]:
        """Each island's uplink, read at its core end ``cK``: ``rx`` is what the island
        sent to the other islands, ``tx`` what it received from them. Empty on a flat
        network."""
        if self.islands == 1:
            return []
        return [nx.read_counters(self.bridge_namespace, f"c{k}") for k in range(self.islands)]

    @property
    def addresses(self) -> list[str]:
        """Host addresses, host 0 (the rendezvous, ``MASTER_ADDR``) first."""
        return [f"{SUBNET_PREFIX}.{i + 1}" for i in range(self.hosts)]

    # -- lifecycle -------------------------------------------------------------------

    def up(self) -> Cluster:
        """Create namespaces, bridge, links and shaping; on any failure undo it all."""
        nx.require_available()
        if self._is_up:
            return self
        if self.cluster_id in nx.list_namespaces():
            raise ConfigError(f"a testbed cluster with id {self.cluster_id!r} already exists")
        nx.check_range_unused(SUBNET_PREFIX)
        try:
            write_state(
                self.cluster_id,
                self.hosts,
                self.rate_bits,
                None if self.persistent else os.getpid(),
                self.wan.to_json() if self.wan else None,
                self._tiers_json(),
            )
            br = self.bridge_namespace
            nx.add_namespace(br)
            self._created.append(br)
            self._add_bridges(br)
            for i, ns in enumerate(self.namespaces):
                nx.add_namespace(ns)
                self._created.append(ns)
                port = f"h{i}"
                bridge = f"br{self.island_of(i)}"
                address = f"{self.addresses[i]}/24"
                delayed = self.wan is not None and self.islands == 1
                nx.add_host_link(ns, br, port, address, bridged=not delayed, bridge=bridge)
                if self.rate_bits is not None:
                    nx.shape(ns, HOST_IFNAME, self.rate_bits)  # host -> bridge
                    if not delayed:
                        nx.shape(br, port, self.rate_bits)  # bridge -> host
            if self.wan:
                self._wire_delay_line(br)
        except BaseException:
            self.down()
            raise
        self._is_up = True
        return self

    def _wire_delay_line(self, br: str) -> None:
        """Start the delay line on every host's link, or on the uplinks with islands."""
        from thinwire.testbed import delayline  # not on import: -m delayline

        assert self.wan is not None
        log = delay_log_path(self.cluster_id)
        if self.islands == 1:
            self.delay_line = delayline.wire(
                br, self.namespaces, self.wan, self.rate_bits, log, self.wan_seed
            )
        else:
            self.delay_line = delayline.wire_uplinks(
                br, self.namespaces, self.wan, self.uplink_bits, log, self.wan_seed
            )
        record_delay_line(self.cluster_id, self.delay_line.pid)

    def _add_bridges(self, br: str) -> None:
        """One bridge ``br0``; with islands one per island and the core ``brc``, each
        island joined to the core by its uplink, shaped both ways (toward the core at
        the island end ``uK``; toward the island at the core end ``cK``, or with a delay
        line at its TAP, which :meth:`_wire_delay_line` shapes)."""
        nx.add_bridge(br)
        if self.islands == 1:
            return
        nx.add_bridge(br, CORE_BRIDGE)
        for k in range(self.islands):
            if k:
                nx.add_bridge(br, f"br{k}")
            up_end, core_end = nx.add_uplink(br, f"br{k}", k, core_bridged=self.wan is None)
            if self.uplink_bits is not None:
                nx.shape(br, up_end, self.uplink_bits)
                if self.wan is None:
                    nx.shape(br, core_end, self.uplink_bits)

    def _tiers_json(self) -> dict[str, int | None] | None:
        if self.islands == 1:
            return None
        return {"islands": self.islands, "uplink_bits": self.uplink_bits}

    def down(self) -> None:
        """Stop every process left in the cluster and delete its namespaces."""
        self._warm.close()
        names = set(self._created) | set(nx.list_namespaces().get(self.cluster_id, []))
        remove_namespaces(sorted(names))
        if self.delay_line is not None:
            from thinwire.testbed.delayline import reap

            reap(self.delay_line)
            self.delay_line = None
        self._created.clear()
        forget(self.cluster_id)
        self._is_up = False

    def close(self) -> None:
        """Tear down unless persistent; an attached handle stops being a user."""
        if self._attached:
            self._attached = False
            remove_user(self.cluster_id, os.getpid())
        self._warm.close()
        if not self.persistent:
            self.down()

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- measuring and running -------------------------------------------------------

    def counters(self) -> list[NicCounters]:
        """Current counters of every host's interface, host 0 first."""
        return [nx.read_counters(ns) for ns in self.namespaces]

    def host_env(self, host: int) -> dict[str, str]:
        """The variables :meth:`run` sets for host ``host`` (on top of the caller's)."""
        return {
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(self.master_port),
            "RANK": str(host),
            "WORLD_SIZE": str(self.hosts),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GLOO_SOCKET_IFNAME": HOST_IFNAME,
            "THINWIRE_TESTBED_ID": self.cluster_id,
        }

    def _argv_for(self, argv: Sequence[str], host: int) -> list[str]:
        # Plain replace of known tokens, not str.format: user commands may hold braces.
        subs = {
            "{rank}": str(host),
            "{hosts}": str(self.hosts),
            "{master_addr}": self.addresses[0],
            "{master_port}": str(self.master_port),
            "{address}": self.addresses[host],
            "{ifname}": HOST_IFNAME,
        }
        out = []
        for tok in argv:
            for key, val in subs.items():
                tok = tok.replace(key, val)
            out.append(tok)
        return out

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        timeout_s: float | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> RunResult:
        """Run ``argv`` once per host as one distributed job; wait; return the outcome.

        Args:
            argv: the command, e.g. ``[sys.executable, "script.py"]``; placeholders
                ``{rank}`` etc. are filled in per host (see the module docstring).
            env: extra variables for every host, on top of this process's environment.
                ``OMP_NUM_THREADS`` defaults to ``cores // hosts`` so hosts sharing a
                machine do not oversubscribe it.
            timeout_s: stop all hosts after this long (``RunResult.timed_out``).
            log_dir: where ``host{i}.log`` and ``summary.json`` go; a new temporary
                directory if omitted.
            grace_s: after the first host fails, how long the others may take to exit
                on their own before they are terminated.

        A failing host never makes this hang: the rest are stopped after ``grace_s``.
        On Ctrl-C every host is stopped before the exception propagates.
        """
        argv = self._checked_command(argv, env)
        out_dir = Path(
            log_dir
            if log_dir is not None
            else tempfile.mkdtemp(prefix=f"thinwire-testbed-{self.cluster_id}-")
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        base_env = dict(os.environ)
        base_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.hosts)))
        base_env.update(env or {})

        before, uplinks_before = self.counters(), self.uplink_counters()
        procs: list[subprocess.Popen[bytes] | WarmProcess] = []
        logs = [out_dir / f"host{i}.log" for i in range(self.hosts)]
        t0 = time.monotonic()
        try:
            self._start_hosts(argv, base_env, logs, procs)
            timed_out, terminated = _wait_for_hosts(procs, t0, timeout_s, grace_s)
        except BaseException:
            # Ctrl-C or an error while starting: no host may outlive this call.
            _stop(procs)
            raise
        seconds = time.monotonic() - t0
        after, uplinks_after = self.counters(), self.uplink_counters()
        result = RunResult(
            command=argv,
            rate_bits=self.rate_bits,
            seconds=seconds,
            hosts=[
                HostResult(
                    host=i,
                    namespace=ns,
                    address=self.addresses[i],
                    returncode=procs[i].returncode,
                    log=str(logs[i]),
                    nic=after[i] - before[i],
                    terminated=terminated[i],
                    warm=isinstance(procs[i], WarmProcess),
                )
                for i, ns in enumerate(self.namespaces)
            ],
            log_dir=str(out_dir),
            timed_out=timed_out,
            uplinks=[a - b for a, b in zip(uplinks_after, uplinks_before, strict=True)],
        )
        atomic_write_text(out_dir / "summary.json", json.dumps(result.to_dict(), indent=2))
        return result

    def _checked_command(self, argv: Sequence[str], env: Mapping[str, str] | None) -> list[str]:
        """``argv`` as strings, once the cluster is up and its command exists."""
        if not self._is_up:
            raise ConfigError("the cluster is not up: use 'with Cluster(...)' or call up()")
        argv = [str(a) for a in argv]
        if not argv or not argv[0]:
            raise ConfigError("no command given to run on the hosts")
        if shutil.which(argv[0], path=(env or {}).get("PATH", os.environ.get("PATH"))) is None:
            raise ConfigError(f"command {argv[0]!r} not found")
        return argv

    def _start_hosts(
        self,
        argv: list[str],
        base_env: dict[str, str],
        logs: list[Path],
        procs: list[subprocess.Popen[bytes] | WarmProcess],
    ) -> None:
        """Start ``argv`` in every host's namespace, appending each process to ``procs``
        as it starts (so a failure part way stops those already running)."""
        for i, ns in enumerate(self.namespaces):
            host_env = {**base_env, **self.host_env(i)}
            if self._warm.can_run(argv, host_env):
                procs.append(self._warm.start(i, self._argv_for(argv, i), host_env, logs[i]))
                continue
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *self._argv_for(argv, i)],
                        env=host_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # Own process group per host: torchrun's children and
                        # shell pipelines are stopped along with the host.
                        start_new_session=True,
                    )
                )


def _wait_for_hosts(
    procs: list[subprocess.Popen[bytes] | WarmProcess],
    t0: float,
    timeout_s: float | None,
    grace_s: float,
) -> tuple[bool, list[bool]]:
    """Wait until every host exits, or stop them all ``grace_s`` after the first failure
    or at the timeout; returns whether it timed out, and which hosts were stopped."""
    terminated = [False] * len(procs)
    timed_out = False
    first_failure: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
            first_failure = now
        stop = first_failure is not None and now - first_failure > grace_s
        if timeout_s is not None and now - t0 > timeout_s:
            timed_out = stop = True
        if stop:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    terminated[i] = True
            _stop(procs)
            break
        time.sleep(0.05)
    return timed_out, terminated


def _stop(procs: Sequence[subprocess.Popen[bytes] | WarmProcess]) -> None:
    """SIGTERM each live process group, SIGKILL whatever is left after a few seconds."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tiers(hosts: int, islands: int, uplink: str | int | None) -> tuple[int, int | None]:
    """``(islands, uplink rate in bit/s)``, checked, each problem in one line."""
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
        raise ConfigError(f"islands must be an integer >= 1, got {islands!r}")
    if islands == 1:
        if uplink is not None:
            raise ConfigError("an uplink joins islands: give islands >= 2 with it")
        return 1, None
    if hosts % islands or hosts == islands:
        raise ConfigError(
            f"islands must split the {hosts} hosts into equal islands of 2 or more, got {islands}"
        )
    if uplink is None:
        raise ConfigError("islands need an uplink rate (e.g. uplink='100mbit')")
    return islands, parse_rate(uplink)
