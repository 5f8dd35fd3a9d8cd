"""``thinwire testbed up|down|status|run``: an emulated slow network on this machine.

(``compare``, ``sweep`` and ``probe`` measure on it: :mod:`thinwire.cli.testbed_tools`.)

Examples::

    thinwire testbed run --hosts 4 --rate 100mbit -- python -m thinwire testbed probe
    thinwire testbed up --hosts 4 --rate 1gbit          # prints the cluster id
    thinwire testbed run --id ID -- thinwire train ...  # reuse it
    thinwire testbed status
    thinwire testbed down [ID ...]                      # no id: every leftover

Needs root; without it every verb says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from types import FrameType

from thinwire.cli.testbed_tools import add_verbs
from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir
from thinwire.testbed import netns as nx
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.rates import format_rate
from thinwire.testbed.registry import list_clusters, remove_clusters

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "testbed",
        help="emulated cluster of N hosts joined by rate-limited links (needs root)",
        description="Emulate N hosts joined by rate-limited links with network namespaces.",
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    up = verbs.add_parser("up", help="create a cluster that stays until 'down'")
    _cluster_args(up)
    up.set_defaults(func=_up)

    down = verbs.add_parser("down", help="remove clusters (default: every leftover)")
    down.add_argument("ids", nargs="*", metavar="ID", help="cluster ids (default: all)")
    down.add_argument(
        "--force", action="store_true", help="also remove clusters of runs still in progress"
    )
    down.set_defaults(func=_down)

    status = verbs.add_parser("status", help="list clusters, addresses, rates, NIC counters")
    status.set_defaults(func=_status)

    run = verbs.add_parser(
        "run",
        help="run COMMAND once per host as one distributed job, then tear down",
        description=(
            "Runs COMMAND once per host with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, "
            "LOCAL_RANK=0 and GLOO_SOCKET_IFNAME set. Placeholders {rank} {hosts} "
            "{master_addr} {master_port} {address} {ifname} in COMMAND are filled in per "
            "host (for torchrun). Exit status: 0 if every host succeeded."
        ),
    )
    _cluster_args(run)
    run.add_argument("--id", dest="use_id", default=None, help="run on an existing cluster")
    run.add_argument("--timeout", type=float, default=None, help="stop all hosts after S s")
    run.add_argument("--logs", default=None, help="directory for host logs and summary.json")
    run.add_argument(
        "--grace", type=float, default=5.0, help="seconds the others get after a host fails"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(func=_run)
    add_verbs(verbs)


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument(
        "--rate", default="1gbit", help="link rate, both directions: 100mbit, 1gbit, unlimited"
    )
    p.add_argument("--cluster-id", default=None, help="1-12 lowercase letters/digits")


def _up(args: argparse.Namespace) -> int:
    c = Cluster(args.hosts, args.rate, cluster_id=args.cluster_id, persistent=True).up()
    print(f"cluster {c.cluster_id}: {c.hosts} hosts at {format_rate(c.rate_bits)}")
    for ns, addr in zip(c.namespaces, c.addresses, strict=True):
        print(f"  {ns}  {addr}  ({nx.HOST_IFNAME})")
    print(f"run on it:  thinwire testbed run --id {c.cluster_id} -- COMMAND")
    print(f"remove it:  thinwire testbed down {c.cluster_id}")
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = remove_clusters(args.ids or None, force=args.force)
    print(f"removed {len(removed)} cluster(s){': ' + ' '.join(removed) if removed else ''}")
    return 0


def _status(args: argparse.Namespace) -> int:
    nx.require_available()
    infos = list_clusters()
    if not infos:
        print("no testbed clusters")
        return 0
    for info in infos:
        if info.users:
            owner = "in use by pid " + ", ".join(str(p) for p in info.users)
        else:
            owner = "leftover of a dead run" if info.owner_pid else "persistent"
        print(
            f"cluster {info.cluster_id}: {info.hosts} hosts at "
            f"{format_rate(info.rate_bits)}, {owner}"
        )
        for i, addr in enumerate(info.addresses):
            ns = nx.host_ns(info.cluster_id, i)
            try:
                n = nx.read_counters(ns)
                counters = f"tx {n.tx_bytes / 1e6:.2f} MB  rx {n.rx_bytes / 1e6:.2f} MB"
            except nx.TestbedError:
                counters = "counters unavailable"
            print(f"  {ns}  {addr}  {counters}")
    return 0


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM/SIGHUP take the same path as Ctrl-C, so the cluster is always torn down.
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command given: thinwire testbed run [options] -- COMMAND ...")
    if args.logs is not None:
        writable_dir(args.logs, "--logs")
    nx.require_available()
    if shutil.which(command[0]) is None:
        raise ConfigError(f"command {command[0]!r} not found")
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if args.use_id is not None:
            cluster = Cluster.attach(args.use_id)
        else:
            cluster = Cluster(args.hosts, args.rate, cluster_id=args.cluster_id).up()
        try:
            result = cluster.run(
                command, timeout_s=args.timeout, log_dir=args.logs, grace_s=args.grace
            )
        finally:
            cluster.close()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print(result.summary())
    print(f"logs and summary.json in {result.log_dir}")
    if not result.ok:
        failed = [h.host for h in result.hosts if h.returncode != 0]
        print(f"thinwire: hosts {failed} failed; see their logs", file=sys.stderr)
    return result.returncode
