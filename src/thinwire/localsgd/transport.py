"""How the Local-SGD server and its workers reach each other, on torch.distributed.

What they say is defined in :mod:`thinwire.localsgd.messages` (a header of named fields,
optionally followed by one flat tensor); this module only moves it.

* **Links**: every worker talks to the server over its own two-rank gloo process group
  (server = rank 0 of the pair, worker = rank 1), built from the run's key-value store
  under a prefix that names the worker *and its incarnation*. A worker process that was
  killed and started again gets a new incarnation number, hence a fresh pair group: it
  never needs the launch's world group, whose membership is fixed once its rendezvous
  is over. The server opens its side when it handles the worker's ``HELLO``.
* **Server to worker**: header and payload on the worker's link (tags 1 and 2); the
  worker blocks in a receive, which is what a worker has to do anyway.
* **Worker to server**: the header goes into a queue on the store (``queue_push``), the
  payload on the link (tag 2). The server must listen to every worker at once *without
  blocking* (it also has grace periods to close and silent workers to declare dead).
  gloo's ``recv_anysource`` cannot be polled (its ``is_completed`` stays false until
  ``wait``) and a ``wait`` that times out breaks the connection, so the server polls the
  store queue (``queue_len``) and then receives the announced payload on that one link.
  Each queued header carries the sender's incarnation, so the server can ignore whatever
  a replaced process still had in flight.

The store: the launch's TCP store (rank 0's ``MASTER_ADDR:MASTER_PORT``), below any
prefixes the launcher added, under ``thinwire.localsgd/<run id>/``. The server picks the
run id, hands it to the launched workers through the launch's own store, and also
records it as the store's *current* run, which is how a restarted process that knows
only the address finds the run (:meth:`Transport.rejoin`). A new launch (a torchrun
restart) picks a new id, so nothing left over from an earlier attempt is read.

Every message is reported to :mod:`thinwire.comm.accounting`: headers as
``localsgd.ctrl``, parameter vectors as ``localsgd.pull`` (server to worker) and
pseudo-gradients as ``localsgd.push``. Point-to-point traffic crosses the link once, so
payload and wire bytes are equal. Links are always gloo, whatever the launch's backend:
NCCL has no CPU-side polling, and the traffic (one parameter vector per round of H
steps) is small.

Dead peers: a worker that exits closes its sockets; the store queue and the other links
keep working, and a send to the dead worker raises, which the server takes as a death
notice. Workers also bump a heartbeat counter in the store from a background thread
(:meth:`Transport.beat`), so the server tells a dead worker from a slow one without a
timeout tied to the round length.

Timeouts: ``connect_timeout_s`` bounds opening a link (both sides wait for the other's
address in the store; while the server opens a link it handles nothing else, so keep it
short); ``timeout_s`` bounds every later send and receive, including a worker's wait for
its next round, which can last as long as the slowest worker's round: keep it large.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from thinwire.comm.accounting import record
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

__all__ = ["Transport", "root_store"]

_PAYLOAD_OPS = {Kind.UPDATE: "push", Kind.WORK: "pull", Kind.DELTA: "pull"}  # accounting names
_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_NAMESPACE = "thinwire.localsgd"
_CURRENT = f"{_NAMESPACE}/current"  # in the root store: the run id being served
_RUN_ID = f"{_NAMESPACE}/run_id"  # in the launch's store: the same id, for launched workers
_QUEUE = "to_server"
_STORE_CONNECT_S = 10.0


def root_store(store: dist.Store) -> dist.Store:
    """The store below every :class:`~torch.distributed.PrefixStore` wrapped around ``store``.

    Launchers add prefixes a restarted process cannot know (``default_pg``, torchrun's
    ``/worker/attempt_N``); the root is what ``MASTER_ADDR:MASTER_PORT`` reaches.
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class Transport:
    """Header+payload messages between a server rank and worker ranks.

    Args:
        store: the run's key-value store. None: the launch's store (the default process
            group's, which every launcher, torchrun included, provides), and ``rank`` is
            this process's rank in the default group.
        rank: this process's rank (0 .. W; required with an explicit ``store``).
        server: the server's rank.
        op_prefix: accounting name prefix.
        run_id: the run's namespace in the store. None: the server makes one and the
            launched workers read it from ``store``; a restarted worker passes the id it
            read from the store's *current* entry (see :meth:`rejoin`).
        connect_timeout_s: how long opening a link may take (see the module docstring).
        timeout_s: how long any later send or receive on a link may take.
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        *,
        rank: int | None = None,
        server: int = 0,
        op_prefix: str = "localsgd",
        run_id: str | None = None,
        connect_timeout_s: float = 120.0,
        timeout_s: float = 1800.0,
    ) -> None:
        if store is None:
            store = dist.distributed_c10d._get_default_store()
            rank = dist.get_rank() if rank is None else rank
        elif rank is None:
            raise ValueError("Transport needs this process's rank when a store is given")
        root = root_store(store)
        if run_id is None:
            if rank == server:
                run_id = uuid.uuid4().hex
                store.set(_RUN_ID, run_id)
                root.set(_CURRENT, run_id)
            else:
                run_id = store.get(_RUN_ID).decode()
        self.run_id = run_id
        self.store = dist.PrefixStore(f"{_NAMESPACE}/{run_id}/", root)
        self.rank = rank
        self.server = server
        self.op_prefix = op_prefix
        self.connect_timeout = timedelta(seconds=connect_timeout_s)
        self.timeout = timedelta(seconds=timeout_s)
        self.bytes_received = 0
        self._incarnation: int | None = None
        self._links: dict[int, dist.ProcessGroupGloo] = {}  # peer rank -> its pair group

    @classmethod
    def rejoin(
        cls,
        host: str,
        port: int,
        rank: int,
        *,
        connect_timeout_s: float = 120.0,
        timeout_s: float = 1800.0,
    ) -> Transport:
        """The transport of a restarted worker ``rank``, from the store's address alone.

        Raises:
            ConfigError: nothing listens at ``host:port``, or no asynchronous run is
                being served there.
        """
        try:
            # The store of a running run answers at once: do not retry for long.
            root = dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=timedelta(seconds=min(connect_timeout_s, _STORE_CONNECT_S)),
                wait_for_workers=False,
            )
            root.set_timeout(timedelta(seconds=connect_timeout_s))
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"cannot reach the run's store at {host}:{port} (MASTER_ADDR:MASTER_PORT of "
                f"the run's rank 0): {str(exc).splitlines()[0]}"
            ) from None
        if not root.check([_CURRENT]):
            raise ConfigError(f"no asynchronous Local-SGD run is being served at {host}:{port}")
        run_id = root.get(_CURRENT).decode()
        return cls(
            root,
            rank=rank,
            run_id=run_id,
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
        )

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
        """Worker liveness signal: bump this incarnation's heartbeat counter in the store."""
        self.store.add(f"heartbeat/{self.rank}/{self.incarnation}", 1)

    def heartbeat(self, rank: int, incarnation: int) -> int:
        """The server's view of a worker incarnation's heartbeat (0 before its first beat)."""
        return int(self.store.add(f"heartbeat/{rank}/{incarnation}", 0))

    # --- links ---------------------------------------------------------------------------
    def _open(self, worker: int, incarnation: int, pair_rank: int) -> dist.ProcessGroupGloo:
        prefix = f"pair/{worker}/{incarnation}"
        # The group's own timeout bounds only the rendezvous (a short one, see the module
        # docstring); every wait below passes the long one, which overrides it per call.
        return dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, self.store), pair_rank, 2, self.connect_timeout
        )

    def accept(self, worker: int, incarnation: int) -> None:
        """On the server: open the link to ``worker``'s ``incarnation`` (after its HELLO),
        closing the link of any earlier incarnation. Raises if the worker does not
        connect within the connect timeout."""
        self.close(worker)
        self._links[worker] = self._open(worker, incarnation, 0)

    def refuse(self, worker: int, incarnation: int, why: Refused) -> None:
        """On the server: tell ``worker``'s ``incarnation`` why it is turned away, on a
        link opened for that alone, so that the link of a running incarnation of the same
        rank is left as it is. Never raises."""
        try:
            pg = self._open(worker, incarnation, 0)
        except RuntimeError:
            return  # it is gone already
        try:
            header = torch.tensor(encode(why), dtype=torch.float64)
            pg.send([header], 1, _HEADER_TAG).wait(self.connect_timeout)
        except RuntimeError:
            pass
        finally:
            pg.abort()

    def linked(self, worker: int) -> bool:
        """On the server: whether a link to ``worker`` is open."""
        return worker in self._links

    def close(self, peer: int | None = None) -> None:
        """Close the link to ``peer`` (None: every link). A peer blocked on it fails."""
        for r in list(self._links) if peer is None else [peer]:
            pg = self._links.pop(r, None)
            if pg is None:
                continue
            # abort drops the sockets at once; a peer that is gone cannot take part in a
            # graceful shutdown, and one that is alive should fail rather than wait.
            with contextlib.suppress(RuntimeError):
                pg.abort()

    def _link(self, peer: int) -> dist.ProcessGroupGloo:
        key = self.server if self.rank != self.server else peer
        pg = self._links.get(key)
        if pg is None:
            raise RuntimeError(f"rank {self.rank} has no open link to rank {peer}")
        return pg

    # --- messages --------------------------------------------------------------------------
    def send(self, dst: int, msg: Message, payload: torch.Tensor | None = None) -> None:
        """Send ``msg`` (and ``payload``, flat) to ``dst``; raises if ``dst`` is gone.

        A worker's first :class:`Hello` also opens its link: it waits (up to the connect
        timeout) until the server has read the hello and opened the other side.
        """
        if dst == self.server:
            blob = pack_queued(self.rank, self.incarnation, msg)
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
            header = torch.tensor(encode(msg), dtype=torch.float64)
            self._link(dst).send([header], 1, _HEADER_TAG).wait(self.timeout)
            record(f"{self.op_prefix}.ctrl", header.nbytes, header.nbytes)
        if payload is not None:
            if msg.kind not in _PAYLOAD_OPS:
                raise ValueError(f"a {msg.kind.name} message carries no payload")
            payload = payload.detach().reshape(-1).cpu().contiguous()
            peer = 0 if dst == self.server else 1
            self._link(dst).send([payload], peer, _PAYLOAD_TAG).wait(self.timeout)
            nbytes = payload.numel() * payload.element_size()
            record(f"{self.op_prefix}.{_PAYLOAD_OPS[msg.kind]}", nbytes, nbytes)

    def poll(self) -> Envelope | None:
        """On the server: the next worker message if one has arrived, else None (no wait).

        Raises:
            MessageError: the queued header was malformed (it is consumed all the same).
        """
        if self.store.queue_len(_QUEUE) == 0:
            return None
        blob = self.store.queue_pop(_QUEUE, False)
        self.bytes_received += len(blob)
        return unpack_queued(blob)

    def recv(self, src: int) -> Message:
        """On a worker: the next message from the server (blocking)."""
        buf = torch.zeros(HEADER_LEN, dtype=torch.float64)
        self._link(src).recv([buf], 0, _HEADER_TAG).wait(self.timeout)
        self.bytes_received += buf.nbytes
        return decode(buf.tolist())

    def recv_payload(self, src: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The payload that follows ``src``'s last header: ``numel`` parameters in ``dtype``."""
        buf = torch.empty(payload_numel(numel, dtype), dtype=dtype)
        peer = 0 if src == self.server else 1
        self._link(src).recv([buf], peer, _PAYLOAD_TAG).wait(self.timeout)
        self.bytes_received += buf.numel() * buf.element_size()
        return buf
