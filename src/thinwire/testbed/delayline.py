"""The testbed's delay line: a small C program that holds each host's frames a while.

This kernel has no ``netem``, so delay, jitter and loss are added in user space. One
process per cluster runs in the bridge namespace and sits in every host's path::

    host tw0 ==veth== hI  <-AF_PACKET->  [delay line]  <-TAP->  tI (bridge port) -- br0

``hI`` (the host's veth peer) is not a bridge port: the delay line reads the host's
frames from it with a packet socket and, once due, writes them to the TAP ``tI``, which
is; the other way round it reads ``tI`` and writes ``hI``. Each direction is a FIFO
ring of frames with their due time, served from one ``epoll`` loop with one
``timerfd`` on ``CLOCK_MONOTONIC`` (timer slack 1 ns), so an idle cluster costs nothing
and a frame leaves within a few microseconds of its time. Semantics of the settings:
:mod:`thinwire.testbed.wan`.

Offloads. veth hands a packet socket whole GSO super-packets (up to 64 KiB) with
checksums not yet computed. Rather than switching offloads off (there is no ethtool
here, and every 1500-byte frame would then cost two system calls per hop), both ends carry a
``virtio_net_hdr`` (``PACKET_VNET_HDR`` on the socket, ``IFF_VNET_HDR`` and
``TUNSETOFFLOAD`` on the TAP), so super-packets pass through whole and are segmented
only where the kernel would anyway. That keeps the CPU cost per byte low (numbers in
``docs/results/testbed.md``). With loss set, a host's link is made to carry single frames
instead (``gso_max_segs 1`` on ``tw0``, a TAP without TSO), so a loss is one frame.

Shaping. The rate limit comes before the delay in both directions: ``tbf`` on ``tw0``
(host to bridge) and on ``tI`` (bridge to host), so the delay line's ring holds at most
``rate x (D + J) / 2`` and a full tbf queue drops before the delay, as a sender's NIC
queue would.

Lifetime. The process exits by itself when one of its interfaces disappears (a host
namespace deleted); it runs inside the bridge namespace, so removing a cluster
(:func:`thinwire.testbed.registry.remove_namespaces`) kills it with everything else
there, after a crash too. Its pid is recorded in the cluster's owner record and its
counters (JSON lines on exit and on SIGUSR1) go to ``/run/thinwire-testbed/ID.delay.log``.

Building is a set-up step (``make install`` runs it), never a side effect of a run::

    thinwire bench native build delayline     # about a second with cc
    thinwire bench native status
"""

from __future__ import annotations

import hashlib
import os
import platform
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from thinwire.errors import ConfigError
from thinwire.testbed import netns as nx
from thinwire.testbed.wan import WanConfig

__all__ = [
    "SOURCE",
    "BuildError",
    "binary_path",
    "build",
    "link_args",
    "reap",
    "start",
    "tap_name",
    "uplink_tap",
    "wire",
    "wire_uplinks",
]

SOURCE = Path(__file__).with_name("delayline.c")
NAME = "thinwire-delayline"
_FLAGS = ("-O2", "-Wall")
READY_TIMEOUT_S = 10.0


class BuildError(RuntimeError):
    """The delay line could not be compiled; the message ends with the compiler's output."""


def cache_dir() -> Path:
    """``$THINWIRE_NATIVE_DIR`` or ``_native/`` beside this file (ignored by git)."""
    env = os.environ.get("THINWIRE_NATIVE_DIR", "").strip()
    return Path(env) if env else Path(__file__).resolve().parent / "_native"


def binary_path() -> Path:
    """Where a build for this source and machine lives (a changed source is not found)."""
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(_FLAGS).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    return cache_dir() / f"{NAME}-{key}"


def require_built() -> Path:
    """The built program, or a one-line ConfigError saying how to build it."""
    path = binary_path()
    if not os.access(path, os.X_OK):
        raise ConfigError(
            "the testbed's delay line is not built (needed for delay, jitter and loss): run "
            "'thinwire bench native build delayline' or 'make install'"
        )
    return path


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the delay line with ``$CC`` (else ``cc``); return its path.

    Does nothing if it is built (unless ``force``). Compiles to a temporary name and
    renames, so concurrent builds are safe.

    Raises:
        BuildError: no compiler, or it failed (its output is in the message).
    """
    target = binary_path()
    if target.is_file() and not force:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {target.parent}: {exc}; set THINWIRE_NATIVE_DIR") from None
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    cc = shlex.split(os.environ.get("CC", "").strip() or "cc")
    cmd = [*cc, *_FLAGS, "-o", str(partial), str(SOURCE)]
    if verbose:
        print(shlex.join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BuildError(f"no C compiler ({cmd[0]}): {exc}") from None
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
        raise BuildError(f"the C compiler failed with exit status {proc.returncode}\n{tail}")
    os.replace(partial, target)
    return target


def tap_name(host: int) -> str:
    """The bridge-side TAP of host ``host`` (``hI`` is its veth end)."""
    return f"t{int(host)}"


def uplink_tap(island: int) -> str:
    """The core-side TAP of island ``island``'s uplink (``cK`` is the uplink's core end)."""
    return f"d{int(island)}"


def link_args(wan: WanConfig, ends: Sequence[tuple[str, str]] | None = None) -> list[str]:
    """One ``DEV,TAP,DELAY_NS,JITTER_NS,LOSS,BUFFER,TSO`` argument per link: half the
    link's delay and jitter per direction, and the per-half loss that makes ``P`` end to
    end (see :mod:`thinwire.testbed.wan`).

    ``ends`` names each link's two interfaces; the default is every host's
    (``hI``, ``tI``). A two-tier cluster passes its uplinks' (``cK``, ``dK``).
    """
    if ends is None:
        ends = [(f"h{i}", tap_name(i)) for i in range(len(wan.hosts))]
    out = []
    for (dev, tap), h in zip(ends, wan.hosts, strict=True):
        half_loss = 1.0 - (1.0 - h.loss) ** 0.5
        out.append(
            ",".join(
                [
                    dev,
                    tap,
                    str(round(h.delay_s / 2 * 1e9)),
                    str(round(h.jitter_s / 2 * 1e9)),
                    repr(half_loss),
                    str(wan.buffer_bytes),
                    "0" if h.loss > 0 else "1",
                ]
            )
        )
    return out


def start(
    bridge_ns: str,
    wan: WanConfig,
    log_path: Path,
    seed: int | None = None,
    ends: Sequence[tuple[str, str]] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the delay line in ``bridge_ns`` for every link; return it once ready.

    The links' veth ends (``hI``, or ``ends``' first names) must exist there, up and not
    enslaved; on return the TAPs (``tI``, or ``ends``' second names) exist (not yet
    bridge ports: the caller enslaves and shapes them). The process outlives the caller
    (its own session), for clusters made by ``testbed up``.

    Raises:
        ConfigError: not built.
        TestbedError: it failed to start (its first error line in the message).
    """
    binary = require_built()
    argv = ["ip", "netns", "exec", bridge_ns, str(binary)]
    if seed is not None:
        argv += ["--seed", str(int(seed))]
    argv += link_args(wan, ends)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,  # Ctrl-C of a 'testbed up' must not reach it
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = b""
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            line = proc.stdout.readline()
            break
    proc.stdout.close()
    if line.strip() != b"ready":
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        err = log_path.read_text(errors="replace").strip().splitlines()
        raise nx.TestbedError(
            f"the delay line did not start: {err[-1] if err else 'no output'} (log {log_path})"
        )
    return proc


def wire(
    bridge_ns: str,
    host_namespaces: Sequence[str],
    wan: WanConfig,
    rate_bits: int | None,
    log_path: Path,
    seed: int | None = None,
) -> subprocess.Popen[bytes]:
    """Put the delay line into a cluster whose veth ends ``hI`` are not bridge ports yet.

    Starts it, makes each TAP a port of ``br0``, shapes the bridge-to-host direction on
    the TAP (rate before delay), and makes lossy hosts send single frames. Returns the
    process; the caller records it and kills it (removing the bridge namespace does).
    """
    proc = start(bridge_ns, wan, log_path, seed)
    for i, (ns, h) in enumerate(zip(host_namespaces, wan.hosts, strict=True)):
        tap = tap_name(i)
        nx.ip("link", "set", tap, "master", nx.BRIDGE_IFNAME, netns=bridge_ns)
        nx.ip("link", "set", tap, "up", netns=bridge_ns)
        if rate_bits is not None:
            nx.shape(bridge_ns, tap, rate_bits)
        if h.loss > 0:
            # One MSS per TCP packet: a loss then drops one wire frame, not a 64 KiB burst.
            nx.ip("link", "set", "dev", nx.HOST_IFNAME, "gso_max_segs", "1", netns=ns)
    return proc


def wire_uplinks(
    bridge_ns: str,
    host_namespaces: Sequence[str],
    wan: WanConfig,
    uplink_bits: int | None,
    log_path: Path,
    seed: int | None = None,
) -> subprocess.Popen[bytes]:
    """Put the delay line into a two-tier cluster's uplinks (``wan`` has one entry per
    island): each uplink's core end ``cK`` (not a bridge port) is served through the TAP
    ``dK``, which joins the core bridge and is shaped toward the island, so the rate
    again comes before the delay both ways (the island end ``uK`` is shaped by the
    caller). With loss on any uplink every host sends single frames: a host's segments
    cross the uplink unsplit, so that is where a loss must be one frame.
    """
    islands = len(wan.hosts)
    ends = [(f"c{k}", uplink_tap(k)) for k in range(islands)]
    proc = start(bridge_ns, wan, log_path, seed, ends)
    for _, tap in ends:
        nx.ip("link", "set", tap, "master", nx.CORE_BRIDGE, netns=bridge_ns)
        nx.ip("link", "set", tap, "up", netns=bridge_ns)
        if uplink_bits is not None:
            nx.shape(bridge_ns, tap, uplink_bits)
    if any(h.loss > 0 for h in wan.hosts):
        for ns in host_namespaces:
            nx.ip("link", "set", "dev", nx.HOST_IFNAME, "gso_max_segs", "1", netns=ns)
    return proc


def reap(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Wait for the delay line to exit (it does when its interfaces go), else kill it."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
