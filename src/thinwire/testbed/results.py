"""What a run on the testbed produced: exit codes, log files, bytes on each host's NIC."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from thinwire.testbed.netns import NicCounters
from thinwire.testbed.rates import format_rate

__all__ = ["HostResult", "RunResult"]


@dataclass
class HostResult:
    """One host's part of a :meth:`Cluster.run`."""

    host: int
    namespace: str
    address: str
    returncode: int | None
    """Exit status; negative = killed by that signal; None = never finished."""
    log: str
    """Path of the host's combined stdout/stderr."""
    nic: NicCounters
    """Bytes and packets on the host's interface during the run (after - before)."""
    terminated: bool = False
    """True if the testbed had to stop this host (another rank failed, or timeout)."""
    warm: bool = False
    """True if the host's process was forked by its warm server, not started fresh
    (:mod:`thinwire.testbed.warm_host`)."""


@dataclass
class RunResult:
    """Outcome of one distributed command on the cluster."""

    command: list[str]
    rate_bits: int | None
    seconds: float
    hosts: list[HostResult]
    log_dir: str
    timed_out: bool = False
    uplinks: list[NicCounters] = field(default_factory=list)
    """With islands: each island's uplink over the run, read at its core end: ``rx`` the
    bytes the island sent to the others, ``tx`` those it received (the slow tier)."""

    @property
    def ok(self) -> bool:
        """Every host exited with status 0."""
        return all(h.returncode == 0 for h in self.hosts)

    @property
    def returncode(self) -> int:
        """0 if all hosts succeeded, else the status of the host that failed by itself.

        Hosts the testbed stopped are only blamed when no host failed on its own (a
        timeout); a status from a signal becomes 1.
        """
        failed = [h for h in self.hosts if h.returncode != 0]
        if not failed:
            return 0
        culprit = next((h for h in failed if not h.terminated), failed[0])
        rc = culprit.returncode
        return rc if rc is not None and rc > 0 else 1

    @property
    def tx_bytes(self) -> int:
        """Bytes all hosts put on their links during the run (Ethernet frames)."""
        return sum(h.nic.tx_bytes for h in self.hosts)

    def utilization(self, host: int) -> float | None:
        """Fraction of host ``host``'s link used on average: ``tx bits / (rate * seconds)``.

        Averaged over the whole run, process start-up included; None when unshaped.
        """
        if self.rate_bits is None or self.seconds <= 0:
            return None
        return self.hosts[host].nic.tx_bytes * 8 / (self.rate_bits * self.seconds)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["rate"] = format_rate(self.rate_bits)
        for i, h in enumerate(d["hosts"]):
            h["utilization"] = self.utilization(i)
        return d

    def summary(self) -> str:
        """A small table: host, exit status, tx/rx MB, utilization, log file."""
        lines = [
            f"{len(self.hosts)} hosts at {format_rate(self.rate_bits)}, "
            f"{self.seconds:.2f} s{' (timed out)' if self.timed_out else ''}",
            f"{'host':>4} {'address':<12} {'exit':>5} {'tx MB':>9} {'rx MB':>9} {'util':>6}  log",
        ]
        for i, h in enumerate(self.hosts):
            util = self.utilization(i)
            rc = "-" if h.returncode is None else str(h.returncode)
            if h.terminated:
                rc += "*"
            lines.append(
                f"{h.host:>4} {h.address:<12} {rc:>5} {h.nic.tx_bytes / 1e6:>9.2f} "
                f"{h.nic.rx_bytes / 1e6:>9.2f} {'-' if util is None else f'{util:6.1%}':>6}  "
                f"{h.log}"
            )
        for k, u in enumerate(self.uplinks):
            lines.append(
                f"island {k} uplink: sent {u.rx_bytes / 1e6:.2f} MB, "
                f"received {u.tx_bytes / 1e6:.2f} MB"
            )
        if any(h.terminated for h in self.hosts):
            lines.append("* stopped by the testbed after another host failed or the timeout")
        return "\n".join(lines)
