"""How the Local-SGD server and its workers reach each other, on torch.distributed.

What they say is defined in :mod:`thinwire.localsgd.messages` (a header of named fields,
optionally followed by one flat tensor); this module moves it, sealed.

* **Links**: every worker talks to the server over its own two-rank gloo process group
  (server = rank 0 of the pair, worker = rank 1), built from the run's store
  (:mod:`thinwire.localsgd.runtime.run_store`: the server's own, on the address the user named)
  under a prefix that names the worker *and its incarnation*. A restarted worker process
  gets a new incarnation, hence a fresh pair group: it never needs the launch's world
  group, whose membership is fixed. The server opens its side when it handles the
  worker's ``HELLO``. Link sockets listen on the run's address (a worker's on its own
  address towards the server).
* **Server to worker**: header, seal and payload on the worker's link (tags 1, 3, 2); the
  worker blocks in a receive, which is what a worker has to do anyway.
* **The server never waits on one worker**: on the server every link has a thread of its
  own that runs that link's sends and payload receives in order
  (:class:`~thinwire.localsgd.runtime.link_io.LinkIO`);
  :meth:`Transport.send` and :meth:`Transport.receive_payload` hand it the work and
  return at once (a :class:`~concurrent.futures.Future`). A worker that stops reading,
  sends a payload nobody asked for, or announces one it never sends, jams only its own
  link, until the link timeout fails it (:meth:`Transport.broken_links`); the server's
  loop keeps serving the others meanwhile.
* **Worker to server**: the header and its seal go into a queue on the store, the
  payload on the link (tag 2). The server must listen to every worker at once *without
  blocking*; gloo's ``recv_anysource`` cannot be polled (its ``is_completed`` stays false
  until ``wait``) and a ``wait`` that times out breaks the connection, so the server polls
  the store queue and then receives the announced payload on that one link. Each queued
  header carries the sender's incarnation, so the server can ignore whatever a replaced
  process still had in flight.
* **Seals** (:mod:`thinwire.localsgd.runtime.auth`) cover the header, the payload's SHA-256 and a
  growing sequence number: the server refuses a forged or replayed header before it
  reads any payload, and either side refuses a payload swapped on the link
  (:class:`~thinwire.localsgd.runtime.auth.AuthError`). Heartbeats are sealed counters.

Every message is reported to :mod:`thinwire.comm.accounting`: headers and seals as
``localsgd.ctrl``, parameter vectors as ``localsgd.pull`` (server to worker) and
pseudo-gradients as ``localsgd.push``; point-to-point, so payload and wire bytes are
equal. Links are always gloo (NCCL has no CPU-side polling; the traffic is one vector
per round of H steps).

A worker the server stops (its pushes refused) is told why on its link and, sealed, in
the store (:meth:`Transport.leave_word`): a worker busy sending when its link closes
never reads the first, and reads the second when its send fails.

Dead peers: a worker that exits closes its sockets, and a send to it raises, which the
server takes as a death notice. Workers also beat a heartbeat in the store from a
background thread (:meth:`Transport.beat`), so the server tells a dead worker from a
slow one without a timeout tied to the round length.

Timeouts: ``connect_timeout_s`` bounds opening a link (while the server opens one it
handles nothing else, so keep it short); ``timeout_s`` bounds every later send and
receive, including a worker's wait for its next round: keep it above the slowest round.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record
from thinwire.comm.bind import gloo_device, route_address
from thinwire.errors import ConfigError
from thinwire.localsgd.messages import (
    HEADER_LEN,
    Envelope,
    Hello,
    Kind,
    Message,
    MessageError,
    Refused,
    RunInfo,
    decode,
    encode,
    pack_queued,
    payload_numel,
    unpack_queued,
)
from thinwire.localsgd.runtime.auth import (
    TRAILER_LEN,
    AuthError,
    Channel,
    Keyring,
    RunKey,
    payload_digest,
)
from thinwire.localsgd.runtime.link_io import LinkIO
from thinwire.localsgd.runtime.run_store import (
    NAMESPACE,
    find_current,
    find_launched,
    host_store,
    root_store,
)

__all__ = ["Transport", "root_store"]

_PAYLOAD_OPS = {Kind.UPDATE: "push", Kind.WORK: "pull", Kind.DELTA: "pull"}  # accounting names
_HEADER_TAG, _PAYLOAD_TAG, _SEAL_TAG = 1, 2, 3
_QUEUE = "to_server"


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def _header(msg: Message) -> torch.Tensor:
    return torch.tensor(encode(msg), dtype=torch.float64)


LINK_TIMEOUTS: dict[str, float] = {"connect_timeout_s": 120.0, "timeout_s": 1800.0}
"""The timeouts a :class:`Transport` takes as keywords, with their defaults."""


class Transport:
    """Sealed header+payload messages between a server rank and worker ranks.

    Build it with :meth:`host` (the server), :meth:`launched` (a worker started with the
    run) or :meth:`rejoin` (a restarted worker); the constructor is the common part.

    Args:
        store: the run's store (the root of its keys; the server's own, or a client).
        rank: this process's rank (0 .. W).
        run_id: the run's namespace in the store.
        key: the run key every message is sealed with.
        address: the local address this process's link sockets listen on.
        server: the server's rank.
        op_prefix: accounting name prefix.
        timeouts: ``connect_timeout_s``, how long opening a link may take (see the module
            docstring), and ``timeout_s``, how long any later send or receive on a link
            may take (defaults: :data:`LINK_TIMEOUTS`).
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        run_id: str,
        key: RunKey,
        address: str = "127.0.0.1",
        server: int = 0,
        op_prefix: str = "localsgd",
        **timeouts: float,
    ) -> None:
        unknown = sorted(set(timeouts) - set(LINK_TIMEOUTS))
        if unknown:
            raise TypeError(f"Transport() got unexpected keyword argument(s) {unknown}")
        seconds = LINK_TIMEOUTS | timeouts
        self.run_id = run_id
        self._root = store  # the server's store lives as long as its transport
        self.store = dist.PrefixStore(f"{NAMESPACE}/{run_id}/", store)
        self.rank = rank
        self.key = key
        self.address = address
        self.server = server
        self.op_prefix = op_prefix
        self.connect_timeout = timedelta(seconds=seconds["connect_timeout_s"])
        self.timeout = timedelta(seconds=seconds["timeout_s"])
        self.bytes_received = 0
        self._incarnation: int | None = None
        self._links: dict[int, dist.ProcessGroupGloo] = {}  # peer rank -> its pair group
        self._io: dict[int, LinkIO] = {}  # server: worker -> its link's thread
        self._broken: set[int] = set()  # server: serials of links that failed an operation
        self._draining: list[LinkIO] = []  # server: closed links still sending a last word
        self._lock = threading.Lock()  # counters the link threads update
        self.seals = Keyring(key, run_id)  # every connection's seals
        self._link_incarnation: dict[int, int] = {}  # server: worker -> incarnation linked
        self._expect: dict[int, bytes] = {}  # peer -> digest its announced payload must have
        self._beats = 0
        self._beat_seen: dict[tuple[int, int], int] = {}

    # Three ways to build one; ``timeouts``: ``connect_timeout_s`` and ``timeout_s``.
    @classmethod
    def host(
        cls,
        launch_store: dist.Store,
        key: RunKey,
        address: str,
        launch: int = 0,
        **timeouts: float,
    ) -> Transport:
        """The server's transport: host the run's store on ``address`` (a free port), and
        say where it is in ``launch_store`` for launched and restarted workers (``launch``:
        which run of the process group this is, see :func:`host_store`)."""
        connect_s = timeouts.get("connect_timeout_s", 120)
        store, run_id = host_store(launch_store, address, connect_s, launch)
        t = cls(store, rank=0, run_id=run_id, key=key, address=address, **timeouts)
        t.store.set("verifier", key.verifier(run_id))
        return t

    @classmethod
    def launched(
        cls, launch_store: dist.Store, rank: int, key: RunKey, launch: int = 0, **timeouts: float
    ) -> Transport:
        """A launched worker's transport: find the run's store through ``launch_store``."""
        found = find_launched(launch_store, timeouts.get("connect_timeout_s", 120), launch)
        store, run_id, server = found
        return cls(
            store, rank=rank, run_id=run_id, key=key, address=route_address(server), **timeouts
        )

    @classmethod
    def rejoin(
        cls, host: str, port: int, rank: int, key: RunKey | None, **timeouts: float
    ) -> Transport:
        """The transport of a restarted worker ``rank``, from the store's address alone
        (``MASTER_ADDR:MASTER_PORT`` of the run's rank 0).

        Raises:
            ConfigError: nothing listens at ``host:port``, no asynchronous run is being
                served there, this process has no token (``key`` None), or not the run's.
        """
        store, run_id, server = find_current(host, port, timeouts.get("connect_timeout_s", 120))
        if key is None:
            raise ConfigError(
                f"the run at {host}:{port} admits only workers that hold its token: set "
                "THINWIRE_RUN_TOKEN (or THINWIRE_RUN_TOKEN_FILE) to it, or rejoin with the "
                "run's --out on its host, where it keeps run.token"
            )
        t = cls(store, rank=rank, run_id=run_id, key=key, address=route_address(server), **timeouts)
        published = t.store.get("verifier").decode() if t.store.check(["verifier"]) else ""
        if published != key.verifier(run_id):
            raise ConfigError(
                f"this process's run token is not the token of the run at {host}:{port}; "
                "nothing was sent to it"
            )
        return t

    # --- run information -------------------------------------------------------------------
    def publish(self, info: RunInfo) -> None:
        """On the server: what a joining process checks before saying hello."""
        self.store.set("info", info.to_json())

    def mark_finished(self) -> None:
        """On the server: the run is over; late joiners are turned away."""
        self.store.set("finished", "1")

    def run_info(self) -> RunInfo:
        """The server's published :class:`RunInfo` (waits up to the connect timeout)."""
        try:
            self.store.wait(["info"], self.connect_timeout)
        except RuntimeError:
            raise ConfigError("the run's server has not published its settings") from None
        try:
            return RunInfo.from_json(self.store.get("info"), self.store.check(["finished"]))
        except MessageError as exc:
            raise ConfigError(str(exc)) from None

    # --- incarnations and heartbeats -------------------------------------------------------
    @property
    def incarnation(self) -> int:
        """On a worker: this process's incarnation (1 for the launched process, +1 for
        every restart of the same worker rank); drawn from the store on first use."""
        if self._incarnation is None:
            self._incarnation = int(self.store.add(f"incarnation/{self.rank}", 1))
        return self._incarnation

    def latest_incarnation(self, rank: int) -> int:
        """On the server: the newest incarnation drawn for worker ``rank`` (0: none yet)."""
        return int(self.store.add(f"incarnation/{rank}", 0))

    def beat(self) -> None:
        """Worker liveness signal: a sealed, growing counter for this incarnation."""
        self._beats += 1
        blob = self.key.beat(self.run_id, self.rank, self.incarnation, self._beats)
        self.store.set(f"heartbeat/{self.rank}/{self.incarnation}", blob)

    def heartbeat(self, rank: int, incarnation: int) -> int:
        """The server's view of a worker incarnation's heartbeat: the highest sealed count
        seen (0 before its first beat). A value that does not verify is ignored."""
        key = f"heartbeat/{rank}/{incarnation}"
        seen = self._beat_seen.get((rank, incarnation), 0)
        if self.store.check([key]):
            count = self.key.read_beat(self.run_id, rank, incarnation, self.store.get(key))
            if count is not None and count > seen:
                seen = self._beat_seen[(rank, incarnation)] = count
        return seen

    # --- links ---------------------------------------------------------------------------
    def _open(self, worker: int, incarnation: int, pair_rank: int) -> dist.ProcessGroupGloo:
        prefix = f"pair/{worker}/{incarnation}"
        # The group's own timeout bounds only the rendezvous (a short one, see the module
        # docstring); every wait below passes the long one, which overrides it per call.
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [gloo_device(self.address)]
        opts._timeout = self.connect_timeout
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), pair_rank, 2, opts)

    def accept(self, worker: int, incarnation: int) -> None:
        """On the server: open the link to ``worker``'s ``incarnation`` (after its verified
        HELLO), closing the link of any earlier incarnation. Raises if the worker does
        not connect within the connect timeout."""
        self.close(worker)
        self.seals.server(worker, incarnation)
        pg = self._open(worker, incarnation, 0)
        self._links[worker] = pg
        self._io[worker] = LinkIO(pg, worker)
        self._link_incarnation[worker] = incarnation

    def refuse(self, worker: int, incarnation: int, why: Refused) -> None:
        """On the server: tell ``worker``'s ``incarnation`` why it is turned away, on a
        link opened for that alone, so that the link of a running incarnation of the same
        rank is left as it is. Never raises."""
        try:
            ch = self.seals.server(worker, incarnation)
            pg = self._open(worker, incarnation, 0)
        except (RuntimeError, KeyError):
            return  # it is gone already (or never said a verified hello)
        try:
            self._send_header(pg, ch, why, None)
        except RuntimeError:
            pass
        finally:
            pg.abort()

    def leave_word(self, worker: int, incarnation: int, why: Refused) -> None:
        """On the server: why ``worker``'s ``incarnation`` is stopped, kept (sealed) in the
        store too. The :class:`Refused` sent on its link is lost when the worker is
        sending, not receiving, as the link closes (a round already under way); the
        worker then reads it here (:meth:`word_left`). Never raises."""
        blob = self.key.word(self.run_id, worker, incarnation, _bytes(_header(why)))
        with contextlib.suppress(RuntimeError):
            self.store.set(f"stopped/{worker}/{incarnation}", blob)

    def word_left(self, wait_s: float) -> Refused | None:
        """On a worker whose link failed: why the server stopped this incarnation, waiting
        up to ``wait_s`` seconds for the word (the server may still be deciding); None
        if it left none, or cannot be asked."""
        key = f"stopped/{self.rank}/{self.incarnation}"
        try:
            self.store.wait([key], timedelta(seconds=wait_s))
            blob = self.store.get(key)
            body = self.key.read_word(self.run_id, self.rank, self.incarnation, blob)
            if body is None:  # not the server's: ignored, as a forged heartbeat is
                return None
            msg = decode(torch.frombuffer(bytearray(body), dtype=torch.float64).tolist())
        except (RuntimeError, ValueError):  # MessageError is a ValueError
            return None
        return msg if isinstance(msg, Refused) else None

    def linked(self, worker: int) -> bool:
        """On the server: whether a link to ``worker`` is open."""
        return worker in self._links

    def close(self, peer: int | None = None, *, drain: bool = False) -> None:
        """Close the link to ``peer`` (None: every link). A peer blocked on it fails.

        ``drain`` (server): close it only after the messages already handed to the link
        (e.g. the :class:`Refused` that tells a worker why it is stopped); the server
        treats the link as closed at once either way."""
        for r in list(self._links) if peer is None else [peer]:
            pg = self._links.pop(r, None)
            self._link_incarnation.pop(r, None)
            io = self._io.pop(r, None)
            if io is not None:
                if drain:
                    self._draining.append(io)
                io.close(self.connect_timeout.total_seconds() if drain else None)
            elif pg is not None:
                with contextlib.suppress(RuntimeError):
                    pg.abort()
        if peer is None:
            for io in self._draining:  # the run is over: nothing is waited for any more
                io.close()
            self._draining.clear()

    def settle(self, timeout_s: float) -> None:
        """On the server: wait up to ``timeout_s`` seconds for every message handed to the
        links so far (the stop orders at the end of a run) to be delivered."""
        deadline = time.monotonic() + timeout_s
        for io in list(self._io.values()):
            io.settle(max(0.0, deadline - time.monotonic()))

    def broken_links(self) -> set[int]:
        """On the server: workers whose link failed an operation since the last call (a
        dead peer, or one that did not take part within the link timeout)."""
        with self._lock:
            out, self._broken = self._broken, set()
        # By link, not by rank: a replaced incarnation's link failing must not count
        # against the new one.
        return {w for w, io in self._io.items() if io.serial in out}

    def _on_link(self, worker: int, job: Callable[[], Any]) -> Future[Any]:
        # Run ``job`` on ``worker``'s link thread; a failure marks the link broken.
        io = self._io.get(worker)
        if io is None:
            raise RuntimeError(f"rank {self.rank} has no open link to rank {worker}")
        link = io.serial

        def run() -> Any:
            try:
                return job()
            except Exception:
                with self._lock:
                    self._broken.add(link)
                raise

        return io.submit(run)

    def _link(self, peer: int) -> dist.ProcessGroupGloo:
        key = self.server if self.rank != self.server else peer
        pg = self._links.get(key)
        if pg is None:
            raise RuntimeError(f"rank {self.rank} has no open link to rank {peer}")
        return pg

    # --- messages --------------------------------------------------------------------------
    def _send_header(
        self, pg: dist.ProcessGroupGloo, ch: Channel, msg: Message, digest: bytes | None
    ) -> None:
        header = _header(msg)
        seal = ch.seal(_bytes(header), digest or payload_digest(None))
        pg.send([header], 1, _HEADER_TAG).wait(self.timeout)
        pg.send([torch.frombuffer(bytearray(seal), dtype=torch.uint8)], 1, _SEAL_TAG).wait(
            self.timeout
        )
        record(f"{self.op_prefix}.ctrl", header.nbytes + len(seal), header.nbytes + len(seal))

    def send(
        self, dst: int, msg: Message, payload: torch.Tensor | None = None
    ) -> Future[None] | None:
        """Send ``msg`` (and ``payload``, flat), sealed, to ``dst``; raises if ``dst`` is gone.

        A worker's first :class:`Hello` also opens its link: it waits (up to the connect
        timeout) until the server has read the hello and opened the other side.

        On the server the send runs on ``dst``'s link thread: this returns at once with
        its future (``payload`` is copied first, so theta may change meanwhile); a
        failure shows in the future and in :meth:`broken_links`. Raises at once only if
        there is no link to ``dst``.
        """
        if self.rank == self.server and dst != self.server:
            return self._send_to_worker(dst, msg, payload)
        flat = None if payload is None else payload.detach().reshape(-1).cpu().contiguous()
        if flat is not None and msg.kind not in _PAYLOAD_OPS:
            raise ValueError(f"a {msg.kind.name} message carries no payload")
        digest = payload_digest(flat)
        if dst == self.server:
            blob = pack_queued(self.rank, self.incarnation, msg)
            blob += self.seals.worker(self.rank, self.incarnation).seal(blob, digest)
            self.store.queue_push(_QUEUE, blob)
            record(f"{self.op_prefix}.ctrl", len(blob), len(blob))
            if isinstance(msg, Hello) and self.server not in self._links:
                try:
                    self._links[self.server] = self._open(self.rank, self.incarnation, 1)
                except RuntimeError:
                    raise RuntimeError(
                        f"worker {self.rank} (incarnation {self.incarnation}): the server did "
                        f"not accept it within {self.connect_timeout.total_seconds():.0f} s "
                        "(has the run finished?)"
                    ) from None
        else:
            raise ValueError(f"worker {self.rank} sends only to the server (rank {self.server})")
        if flat is not None:
            self._link(dst).send([flat], 0, _PAYLOAD_TAG).wait(self.timeout)
            nbytes = flat.numel() * flat.element_size()
            record(f"{self.op_prefix}.{_PAYLOAD_OPS[msg.kind]}", nbytes, nbytes)
        return None

    def _send_to_worker(self, dst: int, msg: Message, payload: torch.Tensor | None) -> Future[None]:
        if dst not in self._io:
            raise RuntimeError(f"rank {self.rank} has no open link to rank {dst}")
        # A copy: the link thread sends it later, and the server's theta moves meanwhile.
        flat = None if payload is None else payload.detach().reshape(-1).cpu().clone()
        if flat is not None and msg.kind not in _PAYLOAD_OPS:
            raise ValueError(f"a {msg.kind.name} message carries no payload")
        # Sealed here, in submission order, so the sequence numbers follow the sends.
        header = _header(msg)
        ch = self.seals.server(dst, self._link_incarnation[dst])
        seal = ch.seal(_bytes(header), payload_digest(flat))
        pg = self._links[dst]

        def job() -> None:
            pg.send([header], 1, _HEADER_TAG).wait(self.timeout)
            pg.send([torch.frombuffer(bytearray(seal), dtype=torch.uint8)], 1, _SEAL_TAG).wait(
                self.timeout
            )
            record(f"{self.op_prefix}.ctrl", header.nbytes + len(seal), header.nbytes + len(seal))
            if flat is not None:
                pg.send([flat], 1, _PAYLOAD_TAG).wait(self.timeout)
                nbytes = flat.numel() * flat.element_size()
                record(f"{self.op_prefix}.{_PAYLOAD_OPS[msg.kind]}", nbytes, nbytes)

        return self._on_link(dst, job)

    def poll(self) -> Envelope | None:
        """On the server: the next worker message if one has arrived, else None (no wait).

        Its seal is checked before anything else: a first ``HELLO`` against the run key,
        anything else against its connection's key.

        Raises:
            MessageError: the queued message was malformed; :class:`AuthError`: it was
                forged or replayed. Either way it is consumed and nothing else is read.
        """
        if self.store.queue_len(_QUEUE) == 0:
            return None
        raw = self.store.queue_pop(_QUEUE, False)
        self.bytes_received += len(raw)
        if len(raw) <= TRAILER_LEN:
            raise MessageError(f"a queued message is longer than its seal, got {len(raw)} bytes")
        blob, seal = raw[:-TRAILER_LEN], raw[-TRAILER_LEN:]
        env = unpack_queued(blob)
        hello = isinstance(env.message, Hello)
        digest = self.seals.open_queued(env.src, env.incarnation, hello, blob, seal)
        if env.message.kind in _PAYLOAD_OPS:
            self._expect[env.src] = digest
        return env

    def recv(self, src: int) -> Message:
        """On a worker: the next message from the server (blocking), its seal checked."""
        buf = torch.zeros(HEADER_LEN, dtype=torch.float64)
        seal = torch.zeros(TRAILER_LEN, dtype=torch.uint8)
        link = self._link(src)
        link.recv([buf], 0, _HEADER_TAG).wait(self.timeout)
        link.recv([seal], 0, _SEAL_TAG).wait(self.timeout)
        self.bytes_received += buf.nbytes + seal.nbytes
        digest = self.seals.worker(self.rank, self.incarnation).open(_bytes(buf), _bytes(seal))
        msg = decode(buf.tolist())
        if msg.kind in _PAYLOAD_OPS:
            self._expect[src] = digest
        return msg

    def recv_payload(self, src: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The payload that follows ``src``'s last header: ``numel`` parameters in ``dtype``
        (blocking; the server's loop uses :meth:`receive_payload`).

        Raises:
            AuthError: it is not the payload the header's seal announced.
        """
        if self.rank == self.server:
            return self.receive_payload(src, numel, dtype).result()
        buf = torch.empty(payload_numel(numel, dtype), dtype=dtype)
        self._link(src).recv([buf], 0, _PAYLOAD_TAG).wait(self.timeout)
        return self._checked(src, buf, self._expect.pop(src, None))

    def receive_payload(self, src: int, numel: int, dtype: torch.dtype) -> Future[torch.Tensor]:
        """On the server: the payload that follows worker ``src``'s last header, received on
        its link thread; returns at once. The future fails with :class:`AuthError` if it is
        not the payload the header's seal announced, or a RuntimeError if the link fails
        (nothing arrives within the link timeout, or the worker is gone)."""
        digest = self._expect.pop(src, None)  # this header's, before the next one's lands
        if src not in self._io:
            raise RuntimeError(f"rank {self.rank} has no open link to rank {src}")
        pg = self._links[src]

        def job() -> torch.Tensor:
            buf = torch.empty(payload_numel(numel, dtype), dtype=dtype)
            pg.recv([buf], 1, _PAYLOAD_TAG).wait(self.timeout)
            return self._checked(src, buf, digest)

        return self._on_link(src, job)

    def forget_payload(self, src: int) -> None:
        """On the server: a header's payload will not be read (its link is being closed)."""
        self._expect.pop(src, None)

    def _checked(self, src: int, buf: torch.Tensor, digest: bytes | None) -> torch.Tensor:
        with self._lock:
            self.bytes_received += buf.numel() * buf.element_size()
        if payload_digest(buf) != digest:
            raise AuthError(f"the payload from rank {src} is not the one its header announced")
        return buf
