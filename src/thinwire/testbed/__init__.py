"""An emulated cluster of hosts on one machine: network namespaces and tc rate limits.

``Cluster`` (a context manager) makes N hosts joined by rate-limited links and runs a
distributed command on them, reporting exit codes and the bytes each host's NIC really
carried. ``thinwire testbed up|down|status|run`` drives the same from the shell. Needs
root and iproute2; :func:`unavailable_reason` says why not when it cannot run.
"""

from thinwire.testbed.cluster import Cluster
from thinwire.testbed.netns import (
    NicCounters,
    TestbedError,
    TestbedUnavailable,
    unavailable_reason,
)
from thinwire.testbed.rates import format_rate, parse_rate
from thinwire.testbed.registry import ClusterInfo, list_clusters, remove_clusters
from thinwire.testbed.results import HostResult, RunResult

__all__ = [
    "Cluster",
    "ClusterInfo",
    "HostResult",
    "NicCounters",
    "RunResult",
    "TestbedError",
    "TestbedUnavailable",
    "format_rate",
    "list_clusters",
    "parse_rate",
    "remove_clusters",
    "unavailable_reason",
]
