"""Latency probes run on the hosts of a testbed cluster: ping, TCP round trip, UDP, bulk.

Run under :meth:`thinwire.testbed.cluster.Cluster.run` (or ``thinwire testbed run``)
as one job: host 1 (or ``--server-rank``) serves, host 0 measures, the others exit. The
measuring host prints one line ``LATENCY {json}``, the serving host ``LATENCY-SERVER
{json}`` (:func:`read_result` parses either from a log)::

    thinwire testbed latency-probe rtt --count 20     # ICMP echo and TCP ping-pong
    thinwire testbed latency-probe udp --count 2000   # one-way delays, order, loss
    thinwire testbed latency-probe bulk --seconds 8   # TCP goodput and its window

No ``ping`` or ``iperf`` is needed: ICMP echo uses a raw socket (root, as the testbed
is), the rest plain sockets. Receive times are the kernel's time stamps
(``SO_TIMESTAMPNS``, the real-time clock every namespace of one machine shares), so a
measuring process that slept through a long delay and woke late does not count its own
wake-up; ``udp`` gets exact one-way delays, not halved round trips.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["PORT", "icmp_rtts", "read_result", "run_probe", "tcp_rtts", "tcp_window"]

PORT = 29600
"""TCP/UDP port of the serving host (a cluster has its own network stack)."""
CONNECT_TIMEOUT_S = 20.0
SO_TIMESTAMPNS = 35  # linux/asm-generic/socket.h; not exported by the socket module


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _kernel_stamp_ns(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The kernel's receive time (``SO_TIMESTAMPNS``), else now: a process that slept
    through a long delay wakes up tens of microseconds late, which is not the network's."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", data[:16])
            return sec * 10**9 + nsec
    return time.time_ns()


def _stamped(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def icmp_rtts(address: str, count: int, interval_s: float = 0.05, timeout_s: float = 5.0) -> list:
    """ICMP echo round trips to ``address`` in seconds (None for a lost one)."""
    sock = _stamped(socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
    ident = os.getpid() & 0xFFFF
    out: list[float | None] = []
    for seq in range(count):
        body = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + bytes(56)
        packet = body[:2] + struct.pack("!H", _checksum(body)) + body[4:]
        t0 = time.monotonic()
        sent_ns = time.time_ns()
        sock.sendto(packet, (address, 0))
        rtt = None
        while (left := timeout_s - (time.monotonic() - t0)) > 0:
            sock.settimeout(left)
            try:
                data, anc, _, _ = sock.recvmsg(4096, 64)
            except TimeoutError:
                break
            ihl = (data[0] & 0x0F) * 4
            kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
            if kind == 0 and rid == ident and rseq == seq:
                rtt = (_kernel_stamp_ns(anc) - sent_ns) * 1e-9
                break
        out.append(rtt)
        time.sleep(interval_s)
    sock.close()
    return out


def _connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _recv_exact(sock: socket.socket, n: int) -> int:
    """Read ``n`` bytes; return the kernel's receive time of the last of them (ns)."""
    got, stamp = 0, 0
    while got < n:
        chunk, anc, _, _ = sock.recvmsg(n - got, 64)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        got += len(chunk)
        stamp = _kernel_stamp_ns(anc)
    return stamp


def tcp_rtts(address: str, count: int, size: int = 64, interval_s: float = 0.05) -> list:
    """Round trips of ``size``-byte messages echoed over one TCP connection (no Nagle)."""
    sock = _stamped(_connect(address, PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = bytes(size)
    out = []
    for _ in range(count):
        sent_ns = time.time_ns()
        sock.sendall(msg)
        out.append((_recv_exact(sock, size) - sent_ns) * 1e-9)
        time.sleep(interval_s)
    sock.close()
    return out


def tcp_window() -> dict[str, Any]:
    """This namespace's TCP buffer limits, which bound a connection's window."""
    out: dict[str, Any] = {}
    for name in ("tcp_rmem", "tcp_wmem", "tcp_congestion_control", "tcp_adv_win_scale"):
        try:
            text = Path(f"/proc/sys/net/ipv4/{name}").read_text().split()
        except OSError:
            continue
        out[name] = [int(v) for v in text] if text[0].isdigit() else text[0]
    return out


def _serve_echo() -> None:
    with socket.create_server(("", PORT)) as srv:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(65536):
            conn.sendall(data)


def _udp_send(address: str, count: int, rate_pps: float) -> dict[str, Any]:
    ctl = _connect(address, PORT)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    t_start = time.monotonic()
    for seq in range(count):
        target = t_start + seq / rate_pps
        while (now := time.monotonic()) < target:
            time.sleep(min(target - now, 0.001))
        sock.sendto(struct.pack("!QQ", seq, time.time_ns()) + bytes(100), (address, PORT))
    ctl.sendall(b"done")
    ctl.recv(16)  # the receiver closes when it has finished counting
    return {"sent": count}


def _udp_receive(drain_s: float) -> dict[str, Any]:
    sock = _stamped(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    sock.bind(("", PORT))
    seqs: list[int] = []
    delays: list[float] = []
    with socket.create_server(("", PORT)) as srv:
        ctl, _ = srv.accept()
        ctl.setblocking(False)
        done_at = None
        while done_at is None or time.monotonic() < done_at + drain_s:
            sock.settimeout(0.05)
            try:
                data, anc, _, _ = sock.recvmsg(2048, 64)
            except TimeoutError:
                data = b""
            if data:
                seq, sent_ns = struct.unpack("!QQ", data[:16])
                delays.append((_kernel_stamp_ns(anc) - sent_ns) * 1e-9)
                seqs.append(seq)
            if done_at is None:
                try:
                    if ctl.recv(16):
                        done_at = time.monotonic()
                except BlockingIOError:
                    pass
        ctl.close()
    return {"seqs": seqs, "delays_s": delays}


def _bulk_send(address: str, seconds: float) -> dict[str, Any]:
    sock = _connect(address, PORT)
    block = bytes(1 << 20)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sock.sendall(block)
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    sock.close()
    # struct tcp_info: tcpi_rtt (us) at byte 68, tcpi_snd_cwnd at 80 (linux/tcp.h).
    rtt_us, cwnd = struct.unpack_from("I", info, 68)[0], struct.unpack_from("I", info, 80)[0]
    return {"srtt_s": rtt_us * 1e-6, "cwnd_segments": cwnd}


def _bulk_receive(skip_s: float) -> dict[str, Any]:
    with socket.create_server(("", PORT)) as srv:
        conn, _ = srv.accept()
        buf = bytearray(1 << 20)
        t_first = None
        marks: list[tuple[float, int]] = []
        total = 0
        while n := conn.recv_into(buf):
            now = time.monotonic()
            t_first = now if t_first is None else t_first
            total += n
            marks.append((now, total))
    assert t_first is not None
    # Goodput after the first skip_s seconds: slow start is not what a window limits.
    steady = [(t, b) for t, b in marks if t - t_first >= skip_s] or marks
    (ta, ba), (tb, bb) = steady[0], steady[-1]
    return {
        "bytes": total,
        "seconds": marks[-1][0] - t_first,
        "goodput_bits": 8 * (bb - ba) / (tb - ta) if tb > ta else 0.0,
        "window": tcp_window(),
    }


def read_result(log: str | os.PathLike[str], server: bool = False) -> dict[str, Any]:
    """The ``LATENCY`` (or ``LATENCY-SERVER``) record from a host's log."""
    tag = "LATENCY-SERVER " if server else "LATENCY "
    lines = [ln for ln in Path(log).read_text().splitlines() if ln.startswith(tag)]
    if not lines:
        raise RuntimeError(f"no {tag.strip()} line in {log}")
    return dict(json.loads(lines[-1][len(tag) :]))


def run_probe(
    mode: str,
    *,
    count: int = 20,
    interval_s: float = 0.05,
    rate_pps: float = 2000.0,
    drain_s: float = 1.0,
    seconds: float = 8.0,
    skip_s: float = 3.0,
    server_rank: int = 1,
) -> dict[str, Any] | None:
    """Run probe ``mode`` (``rtt``, ``udp`` or ``bulk``) as this host's part of the job
    (``RANK`` picks it: host 0 measures, ``server_rank`` serves, the others do nothing);
    the result this host prints, or None."""
    if mode not in ("rtt", "udp", "bulk"):
        raise ValueError(f"probe mode must be rtt, udp or bulk, got {mode!r}")
    rank = int(os.environ.get("RANK", "0"))
    if rank not in (0, server_rank):
        return None
    if rank == server_rank:
        if mode == "rtt":
            _serve_echo()
            return None
        res = _udp_receive(drain_s) if mode == "udp" else _bulk_receive(skip_s)
        print("LATENCY-SERVER " + json.dumps(res), flush=True)
        return res
    net, last = os.environ["MASTER_ADDR"].rsplit(".", 1)
    peer = f"{net}.{int(last) + server_rank}"  # host i is host 0's address + i
    if mode == "rtt":
        res = {
            "icmp_s": icmp_rtts(peer, count, interval_s),
            "tcp_s": tcp_rtts(peer, count, interval_s=interval_s),
        }
    elif mode == "udp":
        res = _udp_send(peer, count, rate_pps)
    else:
        res = _bulk_send(peer, seconds)
    print("LATENCY " + json.dumps(res), flush=True)
    return res
