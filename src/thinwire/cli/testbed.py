"""``thinwire testbed up|down|status|run``: an emulated slow network on this machine.

(``sweep`` and ``probe`` measure on it: :mod:`thinwire.cli.testbed_tools`; ``thinwire
compare --testbed`` compares training algorithms on it.)

Examples::

    thinwire testbed run --hosts 4 --rate 100mbit -- python -m thinwire testbed probe
    thinwire testbed up --hosts 4 --rate 1gbit          # prints the cluster id
    thinwire testbed run --id ID -- thinwire train ...  # reuse it
    thinwire testbed status
    thinwire testbed down [ID ...]                      # no id: every leftover
    thinwire testbed up --hosts 5 --rate 100mbit --delay 10ms --host-delay 4=150ms
    thinwire testbed check-latency                      # measured RTT vs the setting

Needs root; without it every verb says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
from types import FrameType

from thinwire.cli.testbed_tools import add_verbs
from thinwire.cli.wan_args import add_wan_arguments, wan_options
from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir
from thinwire.testbed import netns as nx
from thinwire.testbed.cluster import Cluster
from thinwire.testbed.rates import format_rate
from thinwire.testbed.registry import list_clusters, remove_clusters
from thinwire.testbed.wan import HostLink, WanConfig, format_duration, parse_duration

__all__ = ["register"]

BULK_CHECKS = (("100mbit", None), ("100mbit", "50ms"), ("1gbit", None), ("1gbit", "5ms"))
BULK_CHECKS += (("1gbit", "50ms"),)
"""(rate, delay) of ``check-latency --bulk``: goodput against rate and window, CPU."""


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

    check = verbs.add_parser(
        "check-latency",
        help="measure ping and TCP round trips against --delay settings (and bulk goodput)",
    )
    check.add_argument("--rate", default="1gbit", help="link rate (default 1gbit)")
    check.add_argument(
        "--delays",
        default="0.5ms,1ms,2ms,5ms,10ms,20ms,50ms,100ms,200ms",
        help="comma-separated --delay settings to measure",
    )
    check.add_argument("--count", type=int, default=20, help="round trips per setting")
    check.add_argument(
        "--bulk",
        action="store_true",
        help="also bulk TCP at 100mbit and 1gbit: goodput vs rate and window, delay line CPU",
    )
    check.set_defaults(func=_check_latency)

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
    p.add_argument(
        "--islands",
        type=int,
        default=1,
        help="two tiers: split the hosts into this many islands at --rate inside, "
        "joined by --uplink (default 1: one flat network)",
    )
    p.add_argument(
        "--uplink", default=None, help="with --islands: each island's link, e.g. 100mbit"
    )
    add_wan_arguments(p)


def _cluster(args: argparse.Namespace, persistent: bool = False) -> Cluster:
    hosts = args.hosts
    if isinstance(hosts, int) and not 1 <= hosts <= 64:
        raise ConfigError(f"--hosts must be from 1 to 64, got {hosts}")
    return Cluster(
        hosts,
        args.rate,
        cluster_id=args.cluster_id,
        persistent=persistent,
        islands=args.islands,
        uplink=args.uplink,
        **wan_options(args, hosts, args.islands),
    )


def _up(args: argparse.Namespace) -> int:
    c = _cluster(args, persistent=True).up()
    wan = _describe_network(c.wan, c.islands, c.uplink_bits)
    print(f"cluster {c.cluster_id}: {c.hosts} hosts at {format_rate(c.rate_bits)}{wan}")
    for ns, addr in zip(c.namespaces, c.addresses, strict=True):
        print(f"  {ns}  {addr}  ({nx.HOST_IFNAME})")
    print(f"run on it:  thinwire testbed run --id {c.cluster_id} -- COMMAND")
    print(f"remove it:  thinwire testbed down {c.cluster_id}")
    return 0


def _describe_network(wan: WanConfig | None, islands: int, uplink_bits: int | None) -> str:
    """``, delay 50ms`` or ``, 2 islands joined by 50mbit uplinks (delay 20ms)``."""
    if islands <= 1:
        return f", {wan.describe()}" if wan else ""
    out = f", {islands} islands joined by {format_rate(uplink_bits)} uplinks"
    return out + (f" ({wan.describe()})" if wan else "")


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
        config = None
        if info.wan:
            with contextlib.suppress(ConfigError, KeyError, TypeError, ValueError):
                hosts = [HostLink(**h) for h in info.wan["hosts"]]
                config = WanConfig(tuple(hosts), int(info.wan["buffer_bytes"]))
        tiers = info.tiers or {}
        wan = _describe_network(config, int(tiers.get("islands", 1)), tiers.get("uplink_bits"))
        print(
            f"cluster {info.cluster_id}: {info.hosts} hosts at "
            f"{format_rate(info.rate_bits)}{wan}, {owner}"
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
    wan_flags = (args.delay, args.jitter, args.loss, args.buffer)
    wan_flags += (*args.host_delay, *args.host_jitter, *args.host_loss)
    if args.use_id is not None and any(v is not None for v in wan_flags):
        raise ConfigError("--delay/--jitter/--loss/--buffer set up a new cluster; not with --id")
    if args.use_id is not None and (args.islands != 1 or args.uplink is not None):
        raise ConfigError("--islands/--uplink set up a new cluster; not with --id")
    new = _cluster(args) if args.use_id is None else None  # bad options fail before root
    nx.require_available()
    if shutil.which(command[0]) is None:
        raise ConfigError(f"command {command[0]!r} not found")
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        cluster = Cluster.attach(args.use_id) if new is None else new.up()
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


def _check_latency(args: argparse.Namespace) -> int:
    from thinwire.testbed.latency_check import measure_bulk, sweep_rtt

    delays = [parse_duration(d.strip()) for d in args.delays.split(",") if d.strip()]
    if not delays or any(d <= 0 for d in delays):
        raise ConfigError("--delays needs one or more delays > 0, e.g. 1ms,10ms,50ms")
    if args.count < 3:
        raise ConfigError(f"--count must be >= 3, got {args.count}")
    nx.require_available()
    base, rows = sweep_rtt(delays, args.rate, args.count)
    print(
        f"2 hosts at {args.rate}; medians of {args.count} round trips; LAN round trip "
        f"(no delay line) {base.icmp_s * 1e3:.3f} ms ping, {base.tcp_s * 1e3:.3f} ms TCP"
    )
    print(f"{'delay':>8s} {'set RTT':>9s} {'ping':>10s} {'err':>7s} {'TCP':>10s} {'err':>7s}")
    for r in rows:
        print(
            f"{format_duration(r.delay_s):>8s} {2 * r.delay_s * 1e3:8.3f}m "
            f"{r.icmp_s * 1e3:9.3f}m {r.error(base.icmp_s):+7.1%} "
            f"{r.tcp_s * 1e3:9.3f}m {r.error(base.tcp_s, tcp=True):+7.1%}"
        )
    print("err: (measured - LAN round trip - 2 x delay) / (2 x delay)")
    if args.bulk:
        print(
            f"{'rate':>8s} {'delay':>6s} {'goodput':>10s} {'expected':>10s} {'srtt':>8s} {'CPU':>6s}"
        )
        for rate, delay in BULK_CHECKS:
            b = measure_bulk(rate, delay, base_rtt_s=base.icmp_s)
            print(
                f"{rate:>8s} {delay or '0':>6s} {b.goodput_bits / 1e6:8.1f}Mb "
                f"{b.expected_bits / 1e6:8.1f}Mb {b.srtt_s * 1e3:6.1f}ms {b.cpu_share:6.1%}"
            )
        print(
            f"expected: min(rate x 1448/1514, window / RTT), window = tcp_wmem max "
            f"{b.window_bytes / 2**20:.0f} MiB; CPU: the delay line's share of one core"
        )
    return 0
