"""The emulated network itself: namespaces come and go, links run at the set rate, the NIC
counters agree with the collective's own byte accounting. Needs root and iproute2.

Budget: about a minute on 2 cores. The bandwidth tests use 4 hosts and enough bytes per
call (8 MiB at 100 Mbit/s, 32 MiB at 1 Gbit/s) that set-up latency is a few percent.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TINY_FLAGS, interruptible
from thinwire.cli.main import main
from thinwire.errors import ConfigError
from thinwire.testbed import Cluster, list_clusters, remove_clusters, unavailable_reason
from thinwire.testbed import netns as nx
from thinwire.testbed.rates import parse_rate
from thinwire.testbed.registry import STATE_DIR

_REASON = unavailable_reason()
pytestmark = [pytest.mark.root, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    return {link["ifname"] for link in json.loads(out.stdout)}


def _gone(cluster_id: str) -> bool:
    return (
        cluster_id not in nx.list_namespaces() and not (STATE_DIR / f"{cluster_id}.json").exists()
    )


def _probe(host_log: str) -> dict:
    lines = [ln for ln in Path(host_log).read_text().splitlines() if ln.startswith("PROBE ")]
    assert lines, Path(host_log).read_text()[-2000:]
    return json.loads(lines[-1][len("PROBE ") :])


def _new_id() -> str:
    return "t" + secrets.token_hex(4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [2, 4])
def test_cluster_comes_up_isolated_and_leaves_nothing(hosts: int, tmp_path: Path) -> None:
    links_before = _root_links()
    script = textwrap.dedent(
        """
        import errno, os, socket
        s = socket.socket()
        s.settimeout(2)
        try:  # host 0's rendezvous address is reachable from every host ...
            s.connect((os.environ["MASTER_ADDR"], 9))
        except ConnectionRefusedError:
            print("peer reachable")
        s = socket.socket()
        try:  # ... but nothing outside the cluster: there is no route, no packet leaves
            s.connect(("192.0.2.1", 9))
        except OSError as e:
            print("outside unreachable" if e.errno == errno.ENETUNREACH else repr(e))
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])
        """
    )
    with Cluster(hosts, "100mbit") as c:
        cid = c.cluster_id
        assert sorted(nx.list_namespaces()[cid]) == sorted([*c.namespaces, c.bridge_namespace])
        assert _root_links() == links_before  # nothing was added to the root namespace
        assert [info.addresses for info in list_clusters() if info.cluster_id == cid] == [
            c.addresses
        ]
        res = c.run([sys.executable, "-c", script], log_dir=tmp_path, timeout_s=40)
        assert res.ok, res.summary()
        for i, h in enumerate(res.hosts):
            text = Path(h.log).read_text()
            assert "peer reachable" in text and "outside unreachable" in text, text
            assert f"rank {i} of {hosts}" in text
        assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True
    assert _gone(cid)
    assert _root_links() == links_before


@pytest.mark.timeout(90)
def test_crashed_rank_stops_the_others_and_cluster_is_removed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        import torch.distributed as dist
        from thinwire.comm.launch import init_from_env
        if os.environ["RANK"] == "1":
            sys.exit(3)
        init_from_env(timeout_s=120)  # waits for rank 1 forever without the testbed
        dist.barrier()
        """
    )
    t0 = time.monotonic()
    with Cluster(4, "1gbit") as c:
        cid = c.cluster_id
        res = c.run([sys.executable, "-c", script], log_dir=tmp_path, grace_s=1.0)
    assert time.monotonic() - t0 < 60
    assert res.hosts[1].returncode == 3 and not res.hosts[1].terminated
    for i in (0, 2, 3):
        assert res.hosts[i].terminated and res.hosts[i].returncode != 0
    assert not res.ok and res.returncode == 3
    assert _gone(cid)


@pytest.mark.timeout(120)
def test_thinwire_commands_start_on_warm_hosts_and_behave_as_fresh_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tw = [sys.executable, "-m", "thinwire"]
    train = [*tw, "train", *TINY_FLAGS, "--batch-size", "2", "--no-progress"]
    with Cluster(2, "1gbit") as c:
        cid = c.cluster_id
        # A real job: each host's rank from its RANK, gloo on the host's own interface.
        ok = c.run([*train, "--steps", "3", "--out", str(tmp_path / "run")], log_dir=tmp_path / "a")
        bad = c.run([*tw, "train", "--no-such-flag"], log_dir=tmp_path / "b")
        # Stopped at the timeout, as a fresh host would be: its whole process group.
        long = c.run(
            [*train, "--steps", "100000", "--out", str(tmp_path / "long")],
            timeout_s=5,
            grace_s=1.0,
            log_dir=tmp_path / "c",
        )
        monkeypatch.setenv("THINWIRE_TESTBED_WARM", "0")
        fresh = c.run([*tw, "--version"], log_dir=tmp_path / "d")
        other = c.run([sys.executable, "-c", "print('plain')"], log_dir=tmp_path / "e")
    assert ok.ok and all(h.warm for h in ok.hosts), ok.summary()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    assert [h.returncode for h in bad.hosts] == [2, 2] and all(h.warm for h in bad.hosts)
    assert "unrecognized arguments: --no-such-flag" in Path(bad.hosts[1].log).read_text()
    assert long.timed_out and all(h.terminated and h.warm for h in long.hosts)
    assert all(h.returncode is not None and h.returncode < 0 for h in long.hosts)
    assert fresh.ok and not any(h.warm for h in fresh.hosts)  # turned off: started fresh
    assert other.ok and not any(h.warm for h in other.hosts)  # not a thinwire command
    assert _gone(cid)


@pytest.mark.timeout(60)
def test_ctrl_c_stops_hosts_and_tears_down(tmp_path: Path) -> None:
    cid = _new_id()
    code = textwrap.dedent(
        f"""
        import sys
        from thinwire.testbed import Cluster
        with Cluster(2, "100mbit", cluster_id={cid!r}) as c:
            c.run([sys.executable, "-c", "import time; time.sleep(120)"], log_dir={str(tmp_path)!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if cid in nx.list_namespaces() and nx.namespace_pids(f"thinwire-{cid}-h1"):
                break
            time.sleep(0.1)
        else:
            pytest.fail("cluster never started its hosts")
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=30) != 0
    finally:
        if child.poll() is None:
            child.kill()
    assert _gone(cid)


@pytest.mark.timeout(60)
def test_down_removes_leftovers_of_a_killed_run_but_not_a_live_one() -> None:
    cid = _new_id()
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from thinwire.testbed import Cluster
        c = Cluster(2, "100mbit", cluster_id={cid!r}).up()
        # A process left running inside a host, as a crashed run would leave it.
        subprocess.Popen(["ip", "netns", "exec", c.namespaces[0], "sleep", "300"])
        print("ready", flush=True)
        time.sleep(300)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        info = {i.cluster_id: i for i in list_clusters()}[cid]
        assert info.owner_alive and info.hosts == 2 and info.rate_bits == 100_000_000
        with pytest.raises(ConfigError, match="belongs to running process"):
            remove_clusters([cid])
        assert cid not in remove_clusters()  # 'down' with no id spares live runs
        leftover_pids = nx.namespace_pids(f"thinwire-{cid}-h0")
        assert leftover_pids
        child.kill()  # SIGKILL: no chance to clean up
        child.wait(timeout=10)
        assert not {i.cluster_id: i for i in list_clusters()}[cid].owner_alive
        assert cid in remove_clusters()
    finally:
        if child.poll() is None:
            child.kill()
        if cid in nx.list_namespaces():
            remove_clusters([cid], force=True)
    assert _gone(cid)
    for pid in leftover_pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("rate", "mib", "iters"), [("100mbit", 8, 2), ("1gbit", 32, 3)])
def test_allreduce_bus_bandwidth_and_nic_bytes(
    rate: str, mib: int, iters: int, tmp_path: Path
) -> None:
    rate_bits = parse_rate(rate)
    assert rate_bits is not None
    with Cluster(4, rate) as c:
        res = c.run(
            [
                sys.executable,
                "-m",
                "thinwire",
                "testbed",
                "probe",
                "--mib",
                str(mib),
                "--iters",
                str(iters),
            ],
            log_dir=tmp_path,
            timeout_s=70,
        )
    assert res.ok, res.summary()
    for h in res.hosts:
        p = _probe(h.log)
        # A ring allreduce moves 2 (W-1)/W of the buffer over each link; with headers
        # (54 B per 1448 B segment) the payload can reach ~95% of the link rate.
        assert 0.80 <= p["busbw_bits"] / rate_bits <= 1.0, (h.host, p)
        # What the NIC carried vs what the collective says it sent (warm-up included).
        assert abs(h.nic.tx_bytes / p["wire_bytes"] - 1) <= 0.10, (h.host, h.nic, p)
        assert abs(h.nic.rx_bytes / p["wire_bytes"] - 1) <= 0.10, (h.host, h.nic, p)
        util = res.utilization(h.host)
        assert util is not None and 0 < util <= 1.0


@pytest.mark.timeout(90)
def test_two_tiers_islands_reach_each_other_only_through_their_uplinks(tmp_path: Path) -> None:
    # 2 islands of 2 hosts at 1 Gbit/s, joined by 50 Mbit/s uplinks: a ring allreduce
    # over the 4 hosts crosses the uplinks twice (1 -> 2 and 3 -> 0), so it runs at the
    # uplink's rate, and each uplink carries what its island's last host sends.
    with Cluster(4, "1gbit", islands=2, uplink="50mbit") as c:
        assert [c.island_of(h) for h in range(4)] == [0, 0, 1, 1]
        res = c.run(
            [sys.executable, "-m", "thinwire", "testbed", "probe", "--mib", "2", "--iters", "2"],
            log_dir=tmp_path,
            timeout_s=70,
        )
    assert res.ok, res.summary()
    probes = [_probe(h.log) for h in res.hosts]
    for p in probes:
        assert 0.75 <= p["busbw_bits"] / 50e6 <= 1.0, p
    for island, sender in ((0, 1), (1, 3)):
        sent = res.uplinks[island].rx_bytes  # into the core from this island
        assert abs(sent / res.hosts[sender].nic.tx_bytes - 1) <= 0.05, res.summary()
    assert "island 1 uplink: sent" in res.summary()
    with pytest.raises(ConfigError, match="islands need an uplink rate"):
        Cluster(4, "1gbit", islands=2)


@pytest.mark.timeout(60)
def test_cli_up_status_run_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cid = _new_id()
    try:
        assert (
            main(["testbed", "up", "--hosts", "2", "--rate", "100mbit", "--cluster-id", cid]) == 0
        )
        assert main(["testbed", "status"]) == 0
        out = capsys.readouterr().out
        assert f"cluster {cid}: 2 hosts at 100mbit, persistent" in out
        assert main(["testbed", "up", "--hosts", "2", "--cluster-id", cid]) == 2
        assert "already exists" in capsys.readouterr().err
        fail = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['RANK']) * 7)"]
        assert main(["testbed", "run", "--id", cid, "--logs", str(tmp_path), "--", *fail]) == 7
        assert cid in nx.list_namespaces()  # an attached cluster outlives the run
        assert main(["testbed", "down", cid]) == 0
        assert _gone(cid)
        logs = ["--logs", str(tmp_path / "second")]
        assert main(["testbed", "run", "--hosts", "2", "--rate", "1gbit", *logs, "--", "true"]) == 0
    finally:
        if cid in nx.list_namespaces():
            remove_clusters([cid], force=True)


@pytest.mark.timeout(90)
def test_down_spares_a_cluster_a_run_is_attached_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`testbed run --id X` records itself as a user of X; `down` without --force leaves
    X alone until that run ends (it used to remove it, and the run died)."""
    from thinwire.testbed.registry import read_state

    cid = _new_id()
    run = None
    try:
        assert main(["testbed", "up", "--hosts", "2", "--rate", "1gbit", "--cluster-id", cid]) == 0
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "thinwire",
                "testbed",
                "run",
                "--id",
                cid,
                "--logs",
                str(tmp_path),
                "--",
                "sleep",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )
        deadline = time.monotonic() + 30
        while not any(u.get("pid") == run.pid for u in read_state(cid).get("users", [])):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.1)
        capsys.readouterr()
        assert main(["testbed", "down", cid]) == 2
        err = capsys.readouterr().err
        assert f"belongs to running process {run.pid}" in err and "--force" in err
        assert cid in nx.list_namespaces()
        assert main(["testbed", "status"]) == 0
        assert f"in use by pid {run.pid}" in capsys.readouterr().out
        run.send_signal(signal.SIGTERM)  # the run stops its hosts and lets go of the cluster
        run.communicate(timeout=30)
        assert read_state(cid).get("users") == []
        assert cid in nx.list_namespaces()  # an attached run never removes the cluster
        assert main(["testbed", "down", cid]) == 0
        assert _gone(cid)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        if cid in nx.list_namespaces():
            remove_clusters([cid], force=True)
