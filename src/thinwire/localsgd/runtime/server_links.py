"""The server's side of its workers' links: who is admitted, who is cut off, who waits
to rejoin, and whose heartbeat has stopped.

:class:`WorkerLinks` carries out what the loop's handlers
(:class:`~thinwire.localsgd.runtime.server_loop.ServerLoop`) decide about a worker process:
:meth:`~WorkerLinks.admit` a new incarnation, count a worker :meth:`~WorkerLinks.lost`
when its link breaks, :meth:`~WorkerLinks.stop` one evicted for its pushes, settle the
rejoins that wait for the incarnation they would replace
(:meth:`~WorkerLinks.settle_rejoins`), and declare dead the workers whose heartbeat has
not moved for ``dead_after_s`` (:meth:`~WorkerLinks.watch_heartbeats`). It keeps nothing
of its own: every change lands in the loop's
:class:`~thinwire.localsgd.runtime.server_loop_state.LoopState` or the core.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from thinwire.localsgd.algorithm.compression import PullEncoder
from thinwire.localsgd.algorithm.push_guard import REASONS, describe
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.messages import Refused, Why
from thinwire.localsgd.runtime.server_loop_state import LoopState
from thinwire.localsgd.runtime.transport import Transport

__all__ = ["WorkerLinks"]

_log = logging.getLogger("thinwire.localsgd")


def _detail(reason: str | None) -> int:
    # A refusal reason as the Refused message carries it (0: none named).
    return REASONS.index(reason) + 1 if reason in REASONS else 0


@dataclass
class WorkerLinks:
    """The workers' links of one run of the server's loop (see the module docstring)."""

    core: ServerCore
    transport: Transport
    pull: PullEncoder
    """The pull codec, which forgets a worker's copy of theta when its process changes."""
    state: LoopState
    """The loop's state, shared with the loop."""
    workers: list[int]
    """The run's worker ranks."""
    numel: int
    """Parameters in the server's model (for the Refused messages)."""
    crc: int
    """crc32 of the server's parameter shapes (for the Refused messages)."""

    def accounted(self) -> bool:
        """Every worker is sent home or dead."""
        return all(w in self.core.retired or w in self.core.dead for w in self.workers)

    def replaceable(self, w: int) -> bool:
        """A new incarnation of ``w`` may take its place at once."""
        return w in self.core.dead or w in self.core.retired

    def lost(self, w: int) -> None:
        """``w``'s link broke (the process is gone): drop it, and let only a new
        incarnation back in, since nothing can reach the old one any more."""
        self.state.reading.pop(w, None)
        self.core.drop(w)
        self.transport.close(w)
        self.pull.forget(w)

    def stop(self, w: int, inc: int, why: str | None) -> None:
        """Evicted for its pushes (the last refused for ``why``): tell incarnation ``inc``
        of ``w`` why (after whatever is already on its link, for a bounded time) and cut
        it off; whatever that incarnation still sends is ignored."""
        self.state.banned.add((w, inc))
        self.state.reading.pop(w, None)
        self.pull.forget(w)
        word = Refused(self.numel, self.crc, Why.EVICTED, _detail(why))
        self.transport.leave_word(w, inc, word)  # first: the link may close before it is read
        with contextlib.suppress(RuntimeError):
            self.transport.send(w, word)
        self.transport.close(w, drain=True)
        _log.warning(
            "thinwire: stopped worker %d for its refused pushes, the last: %s", w, describe(why)
        )

    def admit(self, w: int, inc: int, now: float) -> None:
        """A new incarnation ``inc`` of ``w`` (first contact, or a restarted process):
        open its link and offer it work."""
        st, core = self.state, self.core
        st.reading.pop(w, None)  # a push the older incarnation was still sending is lost too
        if w in core.live:
            core.drop(w)  # the older incarnation's round in flight is lost
        try:
            self.transport.accept(w, inc)
        except RuntimeError:  # it died between its hello and connecting
            core.drop(w)
            core.dead.add(w)
            return
        st.admitted[w] = inc
        st.joins.append({"worker": w, "incarnation": inc, "time_s": now - st.clock0})
        self.pull.forget(w)  # a new process holds no copy of theta we can count on
        core.join(w, now)

    def settle_rejoins(self, now: float) -> None:
        """Admit each waiting rejoin whose old incarnation is declared dead (or was sent
        home); refuse each whose old incarnation was seen beating since its hello."""
        st = self.state
        for w, (inc, watched, count) in list(st.pending.items()):
            if self.replaceable(w):
                del st.pending[w]
                self.admit(w, inc, now)
            elif self.transport.heartbeat(w, watched) > count:
                del st.pending[w]
                st.refused_rejoins += 1
                _log.warning(
                    "thinwire: refused a rejoin of worker %d: its incarnation %d is alive",
                    w,
                    watched,
                )
                self.transport.refuse(w, inc, Refused(self.numel, self.crc, Why.ALIVE))

    def watch_heartbeats(self, now: float, dead_after_s: float) -> None:
        """Declare dead every worker whose heartbeat has not moved for ``dead_after_s``."""
        core, beats = self.core, self.state.beats
        for w in self.workers:
            if w in core.retired:
                continue
            # Watch the admitted incarnation; before the first hello, the newest drawn.
            inc = self.state.admitted.get(w) or self.transport.latest_incarnation(w)
            count = self.transport.heartbeat(w, inc)
            watched, last, since = beats[w]
            if inc != watched or count != last:
                beats[w] = (inc, count, now)
                if inc == watched and w in core.dead and self.transport.linked(w):
                    # Only stalled (an overloaded host): it is alive. Offer it work, so that
                    # a worker waiting for a reply is never left behind.
                    core.join(w, now)
            elif w not in core.dead and now - since > dead_after_s:
                core.drop(w)
                core.dead.add(w)  # also covers a worker that died before its hello
