"""Admission to an asynchronous run: tokens, seals, the handshake, the bound store.

The handshake runs on real transports in one process (the worker's side in a thread):
a sealed hello, the server's challenge, sealed work and pushes; then forged, replayed and
swapped messages, each refused with an AuthError before it touches anything.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.bind import bound_store
from thinwire.comm.launch import spawn
from thinwire.errors import ConfigError
from thinwire.localsgd.messages import Hello, Update, Work, pack_queued
from thinwire.localsgd.runtime.auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    AuthError,
    Channel,
    RunKey,
    new_token,
    open_hello,
    payload_digest,
    read_token,
    remove_token_file,
    write_token_file,
)
from thinwire.localsgd.runtime.keyshare import share_run_key
from thinwire.localsgd.runtime.transport import Transport

_TOKEN = b"correct horse battery staple"
_KEY = RunKey.from_token(_TOKEN)


# --- tokens ------------------------------------------------------------------------------
def test_token_sources_and_their_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    assert read_token() is None
    assert read_token(run_dir=str(tmp_path)) is None
    path = write_token_file(tmp_path, b"generated-token-0123456789")
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_token(run_dir=str(tmp_path)) == b"generated-token-0123456789"
    (tmp_path / "t").write_bytes(b"  a-token-from-a-file-0123\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "t"))
    assert read_token(run_dir=str(tmp_path)) == b"a-token-from-a-file-0123"
    monkeypatch.setenv(TOKEN_ENV, "the-environment-wins-0123")
    assert read_token(run_dir=str(tmp_path)) == b"the-environment-wins-0123"
    assert read_token(str(tmp_path / "t")) == b"a-token-from-a-file-0123"  # explicit file first
    monkeypatch.setenv(TOKEN_ENV, "short-secret")
    with pytest.raises(ConfigError, match="has 12 characters; use at least 16") as err:
        read_token()
    assert "short-secret" not in str(err.value)  # a token never appears in a message
    with pytest.raises(ConfigError, match=r"cannot read the run token file .*missing"):
        read_token(str(tmp_path / "missing"))
    remove_token_file(tmp_path)
    assert not (tmp_path / "run.token").exists()
    assert len(new_token()) == 64 and new_token() != new_token()


def test_run_key_is_derived_and_never_shown() -> None:
    assert RunKey.from_token(_TOKEN) == _KEY
    assert RunKey.from_token(_TOKEN + b"!") != _KEY
    assert repr(_KEY) == "RunKey(<hidden>)" and _TOKEN.decode() not in repr(_KEY)
    assert _KEY.verifier("run-a") != _KEY.verifier("run-b")
    beat = _KEY.beat("r", 1, 2, 7)
    assert _KEY.read_beat("r", 1, 2, beat) == 7
    assert _KEY.read_beat("r", 1, 3, beat) is None  # another incarnation's
    assert RunKey.from_token(b"another token of the run").read_beat("r", 1, 2, beat) is None
    # the server's word to a stopped worker, left in the store: only that incarnation's
    word = _KEY.word("r", 1, 2, b"evicted")
    assert _KEY.read_word("r", 1, 2, word) == b"evicted"
    assert _KEY.read_word("r", 1, 3, word) is None
    assert _KEY.read_word("r", 1, 2, b"evicted" + word[-32:][::-1]) is None  # forged tag
    assert _KEY.read_word("r", 1, 2, word[-32:]) is None  # a tag alone says nothing


# --- seals, without a network ------------------------------------------------------------
def test_channel_handshake_and_refusals() -> None:
    worker = Channel(_KEY, "run", 2, 1)
    hello = pack_queued(2, 1, Hello(4, 0))
    seal = worker.seal(hello)
    nonce = open_hello(_KEY, "run", 2, 1, hello, seal)
    server = Channel(_KEY, "run", 2, 1, worker_nonce=nonce)
    # The hello does not verify for another run, worker, incarnation or key.
    for args in (("other", 2, 1), ("run", 3, 1), ("run", 2, 2)):
        with pytest.raises(AuthError, match="not sealed with this run's token"):
            open_hello(_KEY, *args, hello, seal)
    with pytest.raises(AuthError):
        open_hello(RunKey.from_token(b"another token of the run"), "run", 2, 1, hello, seal)
    # The server's answer carries its nonce; the worker derives the connection key.
    theta = torch.arange(4.0)
    header = b"work-header-bytes"
    answer = server.seal(header, payload_digest(theta))
    assert worker.open(header, answer) == payload_digest(theta)
    with pytest.raises(AuthError, match="replay"):
        worker.open(header, answer)
    # The worker's push, sealed with the connection key; a replay and a tampered header fail.
    push = pack_queued(2, 1, Update(0, 4, 0.1, 1.0))
    pseal = worker.seal(push, payload_digest(torch.ones(4)))
    with pytest.raises(AuthError, match="not sealed with its key"):
        server.open(push[:-1] + bytes([push[-1] ^ 1]), pseal)
    assert server.open(push, pseal) == payload_digest(torch.ones(4))
    with pytest.raises(AuthError, match="replay"):
        server.open(push, pseal)
    # Another connection of the same worker and incarnation (other nonces) does not verify.
    other = Channel(_KEY, "run", 2, 1)
    other_hello = other.seal(hello)
    other_server = Channel(
        _KEY, "run", 2, 1, worker_nonce=open_hello(_KEY, "run", 2, 1, hello, other_hello)
    )
    with pytest.raises(AuthError, match="another connection's nonce"):
        server.open(push, other_server.seal(push))
    # An impostor's answer to a fresh worker is refused, and does not stick.
    fresh = Channel(_KEY, "run", 5, 1)
    fresh.seal(hello)
    impostor = Channel(
        RunKey.from_token(b"a guess at the token!"), "run", 5, 1, worker_nonce=b"0" * 16
    )
    with pytest.raises(AuthError):
        fresh.open(header, impostor.seal(header))


# --- the transport on a real store and links ------------------------------------------------
def _copy_next(t: Transport) -> bytes:
    """Wait for the next queued message and keep a copy of it (to replay it later)."""
    for _ in range(2000):
        if t.store.queue_len("to_server") > 0:
            raw = t.store.queue_pop("to_server", False)
            t.store.queue_push("to_server", raw)
            return raw
        threading.Event().wait(0.005)
    raise TimeoutError("nothing arrived")


def _poll(t: Transport) -> Any:
    for _ in range(2000):
        env = t.poll()
        if env is not None:
            return env
        threading.Event().wait(0.005)
    raise TimeoutError("nothing arrived")


def _listening(port: int) -> set[str]:
    """Local addresses listening on TCP ``port`` (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


@pytest.mark.timeout(60)
def test_sealed_messages_on_real_links_and_what_is_refused() -> None:
    launch = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server = Transport.host(launch, _KEY, "127.0.0.1", connect_timeout_s=10, timeout_s=10)
    port = server._root.port
    assert _listening(port) == {"127.0.0.1"}  # not every interface
    worker = Transport.launched(launch, 1, _KEY, connect_timeout_s=10, timeout_s=10)
    got: dict[str, Any] = {}

    def worker_side() -> None:
        try:
            worker.send(0, Hello(4, 0))  # opens the link once the server accepts
            got["work"] = worker.recv(0)
            got["theta"] = worker.recv_payload(0, 4, torch.float32)
            worker.send(0, Update(0, 2, 0.1, 1.0), torch.ones(4))
            got["bad"] = worker.recv(0)  # the forged answer below
        except Exception as exc:  # reported to the main thread
            got["error"] = exc

    thread = threading.Thread(target=worker_side)
    thread.start()
    try:
        hello_blob = _copy_next(server)
        env = _poll(server)
        assert env.message == Hello(4, 0) and (env.src, env.incarnation) == (1, 1)
        server.accept(1, 1)
        server.send(1, Work(0, 0, 0, 2, 0, 10), torch.arange(4.0))
        update_blob = _copy_next(server)
        env = _poll(server)
        assert isinstance(env.message, Update)
        assert torch.equal(server.recv_payload(1, 4, torch.float32), torch.ones(4))
        # Replays of both, byte for byte: refused.
        for blob in (hello_blob, update_blob):
            server.store.queue_push("to_server", blob)
            with pytest.raises(AuthError):
                server.poll()
        # A forged push header for the admitted worker (no key): refused before any payload.
        forged = pack_queued(1, 1, Update(0, 2, 0.1, 1.0))
        server.store.queue_push("to_server", forged + os.urandom(88))
        with pytest.raises(AuthError, match=r"not sealed with its key|another connection"):
            server.poll()
        # A hello for a new incarnation from someone without the token.
        stranger = Channel(RunKey.from_token(b"a guess at the token!"), server.run_id, 1, 9)
        hello = pack_queued(1, 9, Hello(4, 0, late=True))
        server.store.queue_push("to_server", hello + stranger.seal(hello))
        with pytest.raises(AuthError, match="not sealed with this run's token"):
            server.poll()
        # A server-side message with a broken seal: the worker refuses it.
        link = server._link(1)
        header = torch.zeros(8, dtype=torch.float64)
        header[0] = 4.0  # a STOP
        link.send([header], 1, 1).wait()
        link.send([torch.zeros(88, dtype=torch.uint8)], 1, 3).wait()
        thread.join(timeout=20)
    finally:
        server.close()
        worker.close()
    assert got["work"] == Work(0, 0, 0, 2, 0, 10) and torch.equal(got["theta"], torch.arange(4.0))
    assert isinstance(got.get("error"), AuthError)
    assert server.poll() is None


@pytest.mark.timeout(60)
def test_a_payload_swapped_on_the_link_and_forged_heartbeats_are_refused() -> None:
    store = bound_store("127.0.0.1")
    server = Transport(store, rank=0, run_id="r", key=_KEY, connect_timeout_s=10, timeout_s=10)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    worker = Transport(client, rank=1, run_id="r", key=_KEY, connect_timeout_s=10, timeout_s=10)
    done: dict[str, Any] = {}

    def worker_side() -> None:
        worker.send(0, Hello(4, 0))
        worker.recv(0)
        # A header sealed for zeros, then ones on the link.
        blob = pack_queued(1, worker.incarnation, Update(0, 2, 0.1, 1.0))
        blob += worker.seals.worker(1, worker.incarnation).seal(
            blob, payload_digest(torch.zeros(4))
        )
        worker.store.queue_push("to_server", blob)
        worker._link(0).send([torch.ones(4)], 0, 2).wait()
        done["sent"] = True

    thread = threading.Thread(target=worker_side)
    thread.start()
    try:
        _poll(server)
        server.accept(1, 1)
        server.send(1, Work(0, 0, stop=True))
        _poll(server)
        with pytest.raises(AuthError, match="not the one its header announced"):
            server.recv_payload(1, 4, torch.float32)
        thread.join(timeout=20)
        assert done.get("sent")
        # Heartbeats: sealed counts count; forged or replayed values are ignored.
        worker.beat()
        worker.beat()
        assert server.heartbeat(1, 1) == 2
        old = _KEY.beat("r", 1, 1, 1)
        for blob in (
            b"garbage",
            old,
            RunKey.from_token(b"another token, longer").beat("r", 1, 1, 99),
        ):
            server.store.set("heartbeat/1/1", blob)
            assert server.heartbeat(1, 1) == 2
    finally:
        server.close()
        worker.close()


# --- the run key reaches the launched workers -------------------------------------------------
def _share(rank: int, world: int) -> dict[str, Any]:
    key = RunKey.from_token(b"rank 0's generated token") if rank == 0 else None
    out: dict[str, Any] = {"key": share_run_key(key).secret.hex()}
    try:
        share_run_key(None)  # rank 0 failed to make a key: every rank raises, none waits
    except ConfigError as exc:
        out["error"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_the_run_key_reaches_every_rank_and_a_failure_reaches_all() -> None:
    out = spawn(_share, 3, timeout_s=100)
    want = RunKey.from_token(b"rank 0's generated token").secret.hex()
    assert [o["key"] for o in out] == [want] * 3
    assert all("error" in o for o in out[1:])
    assert "could not set up the run's key" in out[1]["error"]


def _open(rank: int, world: int, worker_token: str | None) -> dict[str, Any]:
    from unittest import mock

    from thinwire.localsgd.config import AsyncConfig
    from thinwire.localsgd.runtime.launch import open_transport

    os.environ.pop("THINWIRE_RUN_TOKEN", None)
    if rank > 0 and worker_token:
        os.environ["THINWIRE_RUN_TOKEN"] = worker_token
    # As under NCCL: the exchange then runs on a gloo group of its own.
    with mock.patch("thinwire.localsgd.runtime.launch.dist.get_backend", return_value="nccl"):
        try:
            transport, generated = open_transport(AsyncConfig())
        except ConfigError as exc:
            return {"error": str(exc)}
    out = {"key": transport.key.secret.hex(), "generated": generated is not None}
    if rank == 0:
        out["verifier_ok"] = transport.store.get("verifier").decode() == transport.key.verifier(
            transport.run_id
        )
    if worker_token is None:
        dist.barrier()  # the server's store stays up until every worker has connected
    transport.close()
    return out


@pytest.mark.timeout(150)
def test_open_transport_hands_out_rank_0s_key_and_checks_a_workers_own() -> None:
    out = spawn(_open, 3, (None,), timeout_s=100)
    assert out[0]["generated"] and not out[1]["generated"]
    assert out[0]["key"] == out[1]["key"] == out[2]["key"] and out[0]["verifier_ok"]
    bad = spawn(_open, 2, ("a token only the worker has",), timeout_s=100, may_fail=(1,))
    assert "key" in bad[0]
    assert bad[1] is None or "rank 1's run token is not rank 0's" in bad[1]["error"]
