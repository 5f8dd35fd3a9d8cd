"""The Local-SGD transport on a real store and real links, in one process.

The worker's side runs in a thread. What is checked here is the transport's own job:
messages and payloads arrive as sent and are counted, incarnations and heartbeats are
kept per worker, the run's settings travel through the store, and misuse fails with a
clear error. Forged, replayed and swapped messages are in ``test_localsgd_auth.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.accounting import COUNTER
from thinwire.comm.bind import bound_store
from thinwire.errors import ConfigError
from thinwire.localsgd.messages import Hello, RunInfo, Update, Work
from thinwire.localsgd.runtime.auth import RunKey
from thinwire.localsgd.runtime.transport import Transport

_KEY = RunKey.from_token(b"a transport test token, long enough")
_T = {"connect_timeout_s": 10.0, "timeout_s": 10.0}


def _pair(run_id: str = "r") -> tuple[Transport, Transport, dist.TCPStore]:
    """A server transport on its own store and a worker (rank 1) on a client of it."""
    store = bound_store("127.0.0.1")
    server = Transport(store, rank=0, run_id=run_id, key=_KEY, op_prefix="srv", **_T)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    worker = Transport(client, rank=1, run_id=run_id, key=_KEY, op_prefix="wk", **_T)
    return server, worker, store


def _poll(t: Transport) -> Any:
    for _ in range(2000):
        env = t.poll()
        if env is not None:
            return env
        threading.Event().wait(0.005)
    raise TimeoutError("nothing arrived")


@pytest.mark.timeout(60)
def test_a_round_trip_arrives_as_sent_and_is_counted() -> None:
    server, worker, _ = _pair()
    COUNTER.reset()
    got: dict[str, Any] = {}

    def worker_side() -> None:
        try:
            worker.send(0, Hello(4, 0))
            got["work"] = worker.recv(0)
            got["theta"] = worker.recv_payload(0, 4, torch.float32)
            worker.send(0, Update(0, 3, 0.25, 1.5), torch.full((2, 2), -2.0))
        except Exception as exc:  # reported to the main thread
            got["error"] = exc

    thread = threading.Thread(target=worker_side)
    thread.start()
    try:
        env = _poll(server)
        assert env.message == Hello(4, 0) and (env.src, env.incarnation) == (1, 1)
        assert not server.linked(1)
        server.accept(1, 1)
        assert server.linked(1)
        work = Work(0, 7, shard=2, steps=3, lr_clock=5, planned=10)
        server.send(1, work, torch.arange(4.0))
        env = _poll(server)
        assert env.message == Update(0, 3, 0.25, 1.5) and env.src == 1
        pushed = server.recv_payload(1, 4, torch.float32)
        thread.join(timeout=20)
        assert "error" not in got, got.get("error")
        assert got["work"] == work and torch.equal(got["theta"], torch.arange(4.0))
        assert torch.equal(pushed, torch.full((4,), -2.0))  # flattened on the way
        ops = COUNTER.snapshot()
        assert ops["srv.pull"]["wire_bytes"] == 16 and ops["wk.push"]["wire_bytes"] == 16
        assert ops["srv.ctrl"]["calls"] == 1 and ops["wk.ctrl"]["calls"] == 2
        assert server.bytes_received >= 16 and worker.bytes_received >= 16
        assert server.poll() is None  # the queue is drained
    finally:
        server.close()
        worker.close()
    assert not server.linked(1)


@pytest.mark.timeout(60)
def test_misuse_fails_with_a_clear_error() -> None:
    server, worker, _ = _pair()
    try:
        with pytest.raises(ValueError, match="HELLO message carries no payload"):
            worker.send(0, Hello(4, 0), torch.ones(4))
        with pytest.raises(RuntimeError, match="rank 1 has no open link to rank 0"):
            worker.recv(0)
        with pytest.raises(RuntimeError, match="rank 0 has no open link to rank 3"):
            server.recv_payload(3, 4, torch.float32)
    finally:
        server.close()
        worker.close()


@pytest.mark.timeout(60)
def test_incarnations_and_heartbeats_are_kept_per_worker() -> None:
    server, worker, store = _pair()
    try:
        assert server.latest_incarnation(1) == 0
        assert worker.incarnation == 1 and worker.incarnation == 1  # drawn once
        again = Transport(store, rank=1, run_id="r", key=_KEY, **_T)  # a restarted process
        assert again.incarnation == 2 and server.latest_incarnation(1) == 2
        assert server.heartbeat(1, 1) == 0
        for _ in range(3):
            worker.beat()
        again.beat()
        assert (server.heartbeat(1, 1), server.heartbeat(1, 2)) == (3, 1)
    finally:
        server.close()
        worker.close()


@pytest.mark.timeout(60)
def test_run_settings_travel_through_the_store() -> None:
    store = bound_store("127.0.0.1")
    quick = {"connect_timeout_s": 0.5, "timeout_s": 5.0}
    server = Transport(store, rank=0, run_id="s", key=_KEY, **quick)
    worker = Transport(store, rank=1, run_id="s", key=_KEY, **quick)
    with pytest.raises(ConfigError, match="has not published its settings"):
        worker.run_info()
    info = RunInfo(workers=3, numel=10, checksum=7, shards=6)
    server.publish(info)
    assert worker.run_info() == info
    server.mark_finished()
    assert worker.run_info().finished
    other = Transport(store, rank=1, run_id="another", key=_KEY, **quick)
    with pytest.raises(ConfigError):  # runs do not see each other's keys
        other.run_info()


@pytest.mark.timeout(60)
def test_rejoin_needs_the_runs_token() -> None:
    launch = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server = Transport.host(launch, _KEY, "127.0.0.1", **_T)
    port = server._root.port
    try:
        with pytest.raises(ConfigError, match="admits only workers that hold its token"):
            Transport.rejoin("127.0.0.1", port, 1, None, **_T)
        wrong = RunKey.from_token(b"not the token of this run at all")
        with pytest.raises(ConfigError, match="not the token of the run"):
            Transport.rejoin("127.0.0.1", port, 1, wrong, **_T)
        ok = Transport.rejoin("127.0.0.1", port, 1, _KEY, **_T)
        assert ok.run_id == server.run_id and ok.rank == 1
    finally:
        server.close()
