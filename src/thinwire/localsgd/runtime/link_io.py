"""The server's side of one worker link: a thread that runs the link's operations in order.

A gloo send waits until the peer receives, and a receive until the peer sends; on the
server's own thread one worker that stops reading (or announces a payload it never
sends) would stop every other. :class:`LinkIO` gives each link its own thread, so such a
worker jams only its own link, until the link timeout fails it, while the server's loop
keeps serving the others (:class:`~thinwire.localsgd.runtime.transport.Transport` hands it the
work and returns a :class:`~concurrent.futures.Future` at once).

Two details keep the process whole at exit: a pair group is aborted exactly once
(:class:`_Abort`; a second abort is fatal later), and the link thread holds no reference
to the link, so the group is destroyed on the thread that drops it, never by the garbage
collector at interpreter exit.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

__all__ = ["LinkIO"]


_Job = tuple[Callable[[], Any], "Future[Any]"]


def _run_jobs(jobs: queue.SimpleQueue[_Job | None]) -> None:
    # A link thread's body. It holds only the queue (no reference to the link), so that
    # the pair group is destroyed on the thread that drops the link, never by the
    # garbage collector at interpreter exit (which aborts the process).
    while True:
        item = jobs.get()
        if item is None:
            return
        job, fut = item
        del item
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(job())
            except BaseException as exc:  # handed to whoever reads the future
                fut.set_exception(exc)
        del job, fut


class _Abort:
    """Aborting one pair group exactly once, from whichever thread comes first (the link
    thread after a last message, a timer bounding that wait, or the server at the end)."""

    def __init__(self, pg: dist.ProcessGroupGloo) -> None:
        self._pg: dist.ProcessGroupGloo | None = pg
        self._lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def __call__(self) -> None:
        with self._lock:
            pg, self._pg = self._pg, None
            timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()  # a timer left pending at exit aborts the process
        if pg is None:
            return  # aborted already: a second abort of a pair group is fatal later
        # abort drops the sockets at once; a peer that is gone cannot take part in a
        # graceful shutdown, and one that is alive should fail rather than wait.
        with contextlib.suppress(RuntimeError):
            pg.abort()


class LinkIO:
    """The server's side of one worker link: its pair group, and a thread that runs the
    link's operations one after another (a gloo send waits until the peer receives, so
    on the server's own thread one silent worker would stop every other)."""

    _serials = itertools.count()

    def __init__(self, pg: dist.ProcessGroupGloo, worker: int) -> None:
        self.pg = pg
        self.serial = next(self._serials)  # names this link among every link ever opened
        self._abort = _Abort(pg)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=_run_jobs, args=(self._jobs,), daemon=True, name=f"thinwire-link-{worker}"
        )
        thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        """Run ``job`` after every operation submitted before it; its future."""
        fut: Future[Any] = Future()
        self._jobs.put((job, fut))
        return fut

    def close(self, drain_s: float | None = None) -> None:
        """Stop the thread and drop the link's sockets: at once (an operation blocked on
        it fails), or after the operations already submitted (a last message to a worker
        that is sent home), waiting ``drain_s`` seconds at most for them."""
        if drain_s is None:
            self._abort()
        else:
            self.submit(self._abort)
            timer = threading.Timer(drain_s, self._abort)  # should the last word never leave
            timer.daemon = True
            with self._abort._lock:
                if self._abort._pg is not None and self._abort.timer is None:
                    self._abort.timer = timer
                    timer.start()
        self._jobs.put(None)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the operations submitted so far; True if done."""
        try:
            self.submit(lambda: None).result(timeout=timeout_s)
        except Exception:  # timed out, or the thread is gone: nothing more to wait for
            return False
        return True
