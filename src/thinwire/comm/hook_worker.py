"""A background thread that runs a comm hook's bucket reductions, in order, off backward.

PyTorch's own hooks return the future of one asynchronous collective. A reduction made
of several collectives and compute in between (thinwire's 1-bit allreduce) cannot be
expressed that way, and chaining its steps in ``.then()`` callbacks lets callbacks of
different buckets interleave differently on different ranks, so ranks would issue their
collectives in different orders (gloo matches collectives by order: a hang or garbage).

:class:`HookWorker` keeps the order instead: one thread takes the buckets in the order
the hook received them, which is DDP's bucket index order on every rank, and runs each
reduction to the end before the next. The hook returns the bucket's future at once, so
backward computes the next buckets while this one is on the wire; DDP waits for every
future at the end of backward.

CUDA: a bucket's gradients are written on backward's current stream. The hook records
an event there; the thread runs the reduction on a side stream of the bucket's device
that first waits for the event, and completes the future on that stream, so DDP's
``wait()`` orders backward's stream after the reduction. Bucket buffers belong to DDP
and live as long as the model, so no allocator bookkeeping across streams is needed.
(This path is correct by construction but has not run on a GPU in our tests.)
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["HookWorker", "completed"]


def _value(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.value()


def completed(buf: torch.Tensor, work: Callable[[], None]) -> torch.futures.Future[torch.Tensor]:
    """Run ``work`` now and return its future the way :meth:`HookWorker.submit` does
    (an error travels in the future instead of out of the hook, which would leave DDP
    unusable for the following iterations)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buf.device] if buf.is_cuda else None
    )
    try:
        work()
        fut.set_result(buf)
    except Exception as exc:
        fut.set_exception(exc)
    # A Python future holds an exception as its value; the callback's raise turns it into
    # an error of the returned future, which DDP's wait() raises from backward().
    return fut.then(_value)


class HookWorker:
    """One thread running queued bucket reductions one at a time, first in, first out.

    It holds no reference to the hook state that owns it, so the state can be garbage
    collected; the owner calls :meth:`stop` then (or when it is closed).
    """

    def __init__(self, name: str = "thinwire-hook") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0
        self._streams: dict[torch.device, Any] = {}
        # A new thread starts with default intra-op settings; use the creator's.
        threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, args=(threads,), name=name, daemon=True)
        self.thread.start()

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()  # completes its future itself, with the result or the error
            finally:
                # Not held while waiting for the next one: its closure holds the hook's
                # process group, which must go when the hook's state goes.
                job = None
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()

    @contextlib.contextmanager
    def _stream(self, buf: torch.Tensor, ready: Any) -> Iterator[None]:
        """CUDA: the device's side stream, after ``ready``; CPU: nothing to do."""
        if ready is None:
            yield
            return
        stream = self._streams.get(buf.device)
        if stream is None:
            stream = self._streams[buf.device] = torch.cuda.Stream(buf.device)
        with torch.cuda.device(buf.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            yield

    def submit(
        self, buf: torch.Tensor, work: Callable[[], None]
    ) -> torch.futures.Future[torch.Tensor]:
        """Queue ``work`` (which reduces ``buf`` in place); the returned future completes
        with ``buf`` when it is done, or with its error."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buf.device] if buf.is_cuda else None
        )
        ready = None
        if buf.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))

        def job() -> None:
            try:
                with torch.no_grad(), self._stream(buf, ready):
                    work()
                    fut.set_result(buf)  # CUDA: records the side stream for the waiter
            except Exception as exc:
                fut.set_exception(exc)
            except BaseException as exc:  # SystemExit and the like: still complete it
                fut.set_exception(RuntimeError(f"comm hook worker: {exc!r}"))

        with self._idle:
            self._queued += 1
        self._jobs.put(job)
        return fut.then(_value)

    def wait_idle(self) -> None:
        """Block until every queued reduction is done."""
        with self._idle:
            self._idle.wait_for(lambda: self._queued == 0)

    def stop(self) -> None:
        """Let the thread finish the queued reductions, then exit."""
        self._jobs.put(None)
