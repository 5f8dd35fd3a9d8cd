"""Checks of the emulated wide-area network against its settings: RTT, goodput, CPU.

:func:`measure_rtt` brings up two hosts with a delay and measures the ICMP and TCP
round trips (:mod:`thinwire.testbed.latency`); :func:`sweep_rtt` does it over a range
of delays, next to a cluster with no delay line at all (the LAN round trip, about 0.1
ms, that every setting adds to). :func:`measure_bulk` sends bulk TCP for a while and
sets the goodput beside what the link and the TCP window allow, with the delay line's
CPU time. ``thinwire testbed check-latency`` prints them; ``docs/results/testbed.md`` has
the numbers of this machine.

Tuning: use ``count`` >= 20 (medians); run on a quiet machine, since a busy one delays
the delay line's wake-ups (a few tens of microseconds, which it learns and sends that
much early, but not the spikes).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.latency import read_result
from thinwire.testbed.wan import parse_duration

__all__ = [
    "BulkResult",
    "RttRow",
    "measure_bulk",
    "measure_rtt",
    "rtt_row",
    "run_probe",
    "sweep_rtt",
]

TCP_PAYLOAD_SHARE = 1448 / 1514
"""TCP payload per Ethernet frame (tbf counts frames): the most goodput a rate allows."""


@dataclass(frozen=True)
class RttRow:
    """Measured round trips at one delay setting (seconds; medians of ``count``)."""

    delay_s: float
    """The ``--delay`` setting; the round trip it should add is ``2 * delay_s``."""
    icmp_s: float
    tcp_s: float
    icmp_min_s: float
    icmp_max_s: float
    lost: int
    """Pings without an answer within 5 s."""

    def error(self, base_s: float = 0.0, tcp: bool = False) -> float:
        """(measured - base - 2 delay) / (2 delay): the relative error of the added RTT."""
        measured = self.tcp_s if tcp else self.icmp_s
        return (measured - base_s - 2 * self.delay_s) / (2 * self.delay_s)


@dataclass(frozen=True)
class BulkResult:
    """One bulk TCP transfer from host 0 to host 1 and what bounds it."""

    rate_bits: int | None
    delay_s: float
    goodput_bits: float
    """Receiver's goodput after the ramp-up (``skip_s``)."""
    srtt_s: float
    """The sender's smoothed RTT at the end (includes queueing in tbf)."""
    window_bytes: int
    """The sender's buffer limit (``tcp_wmem[2]``), which bounds the bytes in flight."""
    rate_limit_bits: float | None
    """``rate x 1448/1514``: what the link allows."""
    window_limit_bits: float
    """``window / (2 delay + base RTT)``: what the window allows at the set RTT."""
    delay_line_cpu_s: float
    """CPU seconds the delay line used during the run (user + system)."""
    seconds: float
    window: dict[str, Any]

    @property
    def expected_bits(self) -> float:
        """The tighter of the two limits."""
        limits = [self.window_limit_bits]
        if self.rate_limit_bits is not None:
            limits.append(self.rate_limit_bits)
        return min(limits)

    @property
    def cpu_share(self) -> float:
        """Delay line CPU time over the run's wall time (1.0 = one core)."""
        return self.delay_line_cpu_s / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "expected_bits": self.expected_bits, "cpu_share": self.cpu_share}


def _probe_cmd(mode: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "thinwire", "testbed", "latency-probe", mode, *args]


def run_probe(
    cluster: Cluster, mode: str, args: Sequence[str], timeout_s: float, server_rank: int = 1
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run one :mod:`~thinwire.testbed.latency` probe on ``cluster``: host 0 measures,
    ``server_rank`` serves; return their records (the server's is None for ``rtt``)."""
    with tempfile.TemporaryDirectory(prefix="thinwire-latency-") as tmp:
        argv = _probe_cmd(mode, *args, "--server-rank", str(server_rank))
        res = cluster.run(argv, log_dir=tmp, timeout_s=timeout_s)
        if not res.ok:
            tail = Path(res.hosts[0].log).read_text()[-500:]
            raise RuntimeError(f"latency probe '{mode}' failed: {tail}")
        client = read_result(res.hosts[0].log)
        server = read_result(res.hosts[server_rank].log, server=True) if mode != "rtt" else None
    return client, server


def measure_rtt(
    delay: float | str | None,
    rate: str = "1gbit",
    count: int = 20,
    interval_s: float = 0.05,
    jitter: float | str | None = None,
) -> RttRow:
    """ICMP and TCP round trips between two hosts whose delay is ``delay`` (None: a
    plain cluster without a delay line)."""
    if count < 3:
        raise ConfigError(f"count must be >= 3, got {count}")
    d = parse_duration(delay) if delay is not None else 0.0
    with Cluster(2, rate, delay=delay, jitter=jitter) as c:
        args = ["--count", str(count), "--interval", str(interval_s)]
        out, _ = run_probe(c, "rtt", args, timeout_s=60 + 4 * count * (2 * d + interval_s))
    return rtt_row(d, out)


def rtt_row(delay_s: float, out: dict[str, Any]) -> RttRow:
    """Medians of an ``rtt`` probe's record, its first exchange left out (it also
    resolves the peer's MAC address: one more round trip)."""
    icmp = [x for x in out["icmp_s"] if x is not None]
    if not icmp:
        raise RuntimeError("no ping was answered")
    icmp_rest = icmp[1:] or icmp
    return RttRow(
        delay_s=delay_s,
        icmp_s=statistics.median(icmp_rest),
        tcp_s=statistics.median(out["tcp_s"][1:] or out["tcp_s"]),
        icmp_min_s=min(icmp_rest),
        icmp_max_s=max(icmp_rest),
        lost=len(out["icmp_s"]) - len(icmp),
    )


def sweep_rtt(
    delays: Sequence[float | str], rate: str = "1gbit", count: int = 20
) -> tuple[RttRow, list[RttRow]]:
    """The LAN round trip (no delay line) and one row per delay setting."""
    base = measure_rtt(None, rate, count)
    return base, [measure_rtt(d, rate, count) for d in delays]


def _cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_bulk(
    rate: str | None,
    delay: float | str | None,
    seconds: float = 8.0,
    skip_s: float = 3.0,
    base_rtt_s: float = 1e-4,
) -> BulkResult:
    """Bulk TCP for ``seconds`` from host 0 to host 1; goodput after ``skip_s``.

    ``base_rtt_s`` is the LAN round trip added to ``2 delay`` for the window limit.
    """
    d = parse_duration(delay) if delay is not None else 0.0
    with Cluster(2, rate, delay=delay) as c:
        pid = c.delay_line.pid if c.delay_line is not None else None
        cpu0 = _cpu_seconds(pid) if pid else 0.0
        args = ["--seconds", str(seconds), "--skip", str(skip_s)]
        client, server = run_probe(c, "bulk", args, timeout_s=seconds + 60)
        cpu = (_cpu_seconds(pid) - cpu0) if pid else 0.0
        rate_bits = c.rate_bits
    assert server is not None
    window = server["window"]
    wmem = int(window.get("tcp_wmem", [0, 0, 4 * 2**20])[2])
    return BulkResult(
        rate_bits=rate_bits,
        delay_s=d,
        goodput_bits=float(server["goodput_bits"]),
        srtt_s=float(client["srtt_s"]),
        window_bytes=wmem,
        rate_limit_bits=rate_bits * TCP_PAYLOAD_SHARE if rate_bits else None,
        window_limit_bits=8 * wmem / (2 * d + base_rtt_s),
        delay_line_cpu_s=cpu,
        seconds=float(server["seconds"]),
        window=window,
    )
