"""The server's loop: read the workers' messages, apply pushes, hand out rounds, watch
heartbeats. :class:`~thinwire.localsgd.algorithm.server_core.ServerCore` decides *what*
happens; this loop feeds it the wall clock and the transport's messages
(:mod:`thinwire.localsgd.messages`), and carries out its answers.

:func:`serve` runs a :class:`ServerLoop` until every worker is stopped or dead. Each
turn (:meth:`ServerLoop.turn`) polls one message and hands it to the handler its type
names in :attr:`ServerLoop.handlers`:

========== ======================= ===================================================
message    handler                 what it does
========== ======================= ===================================================
``Hello``  ``_on_hello``           admit a worker (or a restarted process of it), or
                                   hold its rejoin until the old one is declared dead;
                                   refuse another model (a late joiner's ends the turn)
``Update`` ``_on_update``          screen a push, then receive its payload on the
                                   worker's link thread (applied by ``_take_payloads``)
any other  ``_on_stray``           count it stale: a server-to-worker kind
========== ======================= ===================================================

Before the table, every message from an unknown rank, an incarnation replaced or
evicted, or (anything but a hello) an incarnation not admitted is counted stale and
dropped. After it, the turn applies the payloads that are in, drops broken links,
evaluates and checkpoints when due, hands out rounds, drops hung workers, settles
waiting rejoins and checks heartbeats. Everything the loop keeps between turns is one
:class:`~thinwire.localsgd.runtime.server_loop_state.LoopState`; everything it is told is one
frozen :class:`~thinwire.localsgd.runtime.server_loop_state.ServeSettings`.

A worker is dead when its heartbeat has not moved for ``dead_after_s`` (a killed
process), or when a send to it fails; it is *hung* (and dropped too) when a round takes
``max(hung_after_min_s, hung_after_factor * expected round time)``.

A worker process that says hello with a newer incarnation than the one admitted (a
restarted process, see :func:`thinwire.localsgd.rejoin_async`) replaces it: the older
incarnation's link is closed, its round in flight is lost (rewound and handed out
again), and whatever it still had queued is ignored. The newcomer starts as a worker
that joined late: no DyLU speed yet, back in Delayed Nesterov's N, the free shard with
least progress.

Admission (see :mod:`thinwire.localsgd.runtime.auth`): every message's seal is checked before
anything else; one that fails (forged, replayed, sent without the run's token) is
consumed, logged and counted (``unauthenticated_messages``), and changes nothing. A
rejoin replaces only a worker the server considers dead: its hello waits until the old
incarnation is declared dead (heartbeat silent for ``dead_after_s``) and is refused as
soon as the old one is seen beating, unless the rejoin is forced (``Hello.force``).
Pushes the :class:`~thinwire.localsgd.algorithm.push_guard.PushGuard` refuses are logged; a
worker the core evicts for them is told why and cut off.

Nothing a worker sends makes this loop wait: a push's payload is received on the
worker's link thread (:meth:`~thinwire.localsgd.runtime.transport.Transport.receive_payload`)
and applied once it is in, and rounds go out the same way. A push the core screens out
before its payload is read (another epoch, a version that is not its round's, a push
while the worker has no round in flight or another push still arriving) is refused,
counted, and its sender stopped at once (its payload is received and dropped on its
link's thread, then the link is closed). Garbage in the queue is counted
(``malformed_messages``), and summarised on stderr once a second at most.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import PullEncoder, decode
from thinwire.localsgd.algorithm.push_guard import describe
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.messages import (
    Envelope,
    Hello,
    MessageError,
    Refused,
    RunInfo,
    Update,
    Why,
)
from thinwire.localsgd.runtime.auth import AuthError
from thinwire.localsgd.runtime.server_links import WorkerLinks
from thinwire.localsgd.runtime.server_loop_state import RECORD, LoopState, ServeSettings, report
from thinwire.localsgd.runtime.transport import Transport

__all__ = ["ServeSettings", "ServerLoop", "serve"]

_log = logging.getLogger("thinwire.localsgd")
_LOGGED_FORGERIES = 10  # then only counted: a flood must not flood the log too
_SUMMARY_EVERY_S = 1.0  # malformed messages: one summary line a second at most

Handler = Callable[[Envelope, float], bool]
"""A message handler: ``(envelope, now) -> whether the rest of the turn runs``."""


def serve(
    core: ServerCore,
    transport: Transport,
    workers: list[int],
    signature: tuple[int, int],
    settings: ServeSettings | None = None,
) -> dict[str, Any]:
    """Serve until every worker is stopped or dead; returns the run's counters.

    ``signature``: the model's ``(numel, shape checksum)``, which every worker's hello
    must match. ``settings``: evaluation, checkpoints, deadlines and the pull codec
    (:class:`ServeSettings`; None: its defaults). The counters carry the final
    evaluation record's ``val_loss``, and all its metrics as ``metrics``, when
    ``settings.evaluate`` is set.
    """
    return ServerLoop(core, transport, workers, signature, settings or ServeSettings()).run()


class ServerLoop:
    """One run of the server's loop: the core, the transport, and the
    :class:`LoopState` its handlers change (see the module docstring)."""

    def __init__(
        self,
        core: ServerCore,
        transport: Transport,
        workers: list[int],
        signature: tuple[int, int],
        settings: ServeSettings,
    ) -> None:
        self.core, self.transport, self.workers = core, transport, workers
        self.numel, self.crc = signature
        self.settings = settings
        self.pull = settings.pull or PullEncoder("none")
        self.state = LoopState.begin(workers, core.steps_applied, settings, time.monotonic())
        self.links = WorkerLinks(core, transport, self.pull, self.state, workers, *signature)
        self.handlers: dict[type, Handler] = {Hello: self._on_hello, Update: self._on_update}
        """Message type -> its handler; any other type goes to :meth:`_on_stray`."""

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Serve until every worker is stopped or dead; the run's counters."""
        core, st, s = self.core, self.state, self.settings
        self.transport.publish(RunInfo(len(self.workers), self.numel, self.crc, len(core.shards)))
        if core.steps_applied >= core.total_steps:
            core.steps_assigned = core.total_steps  # resumed a finished run: just stop everyone
        if s.evaluate is not None and core.steps_applied == 0:
            st.last = report(core, s.evaluate, s.on_eval, st.clock0)
        while not (core.finished and self.links.accounted()):
            self.turn()
        return self._close()

    def turn(self) -> None:
        """One message (if any) and one round of the loop's chores."""
        core, st, s = self.core, self.state, self.settings
        now = time.monotonic()
        if s.max_wall_s is not None and now - st.start > s.max_wall_s:
            raise TimeoutError(f"the server ran past max_wall_s={s.max_wall_s}")
        env = self._poll(now)
        if env is not None and not self._dispatch(env, now):
            return  # the handler ended the turn here (a late joiner with another model)
        received = self._take_payloads()
        active = env is not None or received  # something happened: evaluate and checkpoint
        for w in self.transport.broken_links():
            self.links.lost(w)  # a round or a stop order that could not be delivered
        if active:
            self._evaluate_and_checkpoint()
        now = time.monotonic()
        self._hand_out(now)
        for w in core.overdue(now, s.hung_after_factor, s.hung_after_min_s):
            core.drop(w)
        if st.pending and now >= st.next_pending_check:
            st.next_pending_check = now + 0.1
            self.links.settle_rejoins(now)
        if now >= st.next_beat_check:
            st.next_beat_check = now + min(1.0, s.dead_after_s / 4)
            self.links.watch_heartbeats(now, s.dead_after_s)
        if not active:
            time.sleep(0.001)

    def _poll(self, now: float) -> Envelope | None:
        """The next message in the queue, if any; a forged or malformed one is counted,
        consumed and read as None."""
        st = self.state
        env = None
        try:
            env = self.transport.poll()
        except AuthError as exc:
            # Forged, replayed, or sealed without the run's token: consumed, nothing else.
            st.forged += 1
            if st.forged <= _LOGGED_FORGERIES:
                _log.warning("thinwire: refused a message: %s", exc)
        except MessageError:
            # A malformed header in the queue: no worker of this run sent it (or it is
            # from another version of thinwire). It is consumed; nothing else is read.
            st.bad += 1
        if st.bad > st.bad_told and now - st.bad_told_at >= _SUMMARY_EVERY_S:
            # One line a second at most, however many arrive: a flood of garbage must not
            # become a flood in the log.
            _log.warning(
                "thinwire: ignored %d malformed messages in the run's queue (%d in all)",
                st.bad - st.bad_told,
                st.bad,
            )
            st.bad_told, st.bad_told_at = st.bad, now
        return env

    def _dispatch(self, env: Envelope, now: float) -> bool:
        """Hand ``env`` to its handler, unless its sender is not one to listen to;
        whether the rest of the turn runs."""
        st = self.state
        if (
            env.src not in self.workers
            or env.incarnation < st.admitted.get(env.src, 0)
            or (env.src, env.incarnation) in st.banned
            or (not isinstance(env.message, Hello) and env.incarnation != st.admitted.get(env.src))
        ):
            # An unknown rank, or a replaced process's leftovers (its link is closed, so
            # there is no payload to drain).
            st.stale += 1
            return True
        return self.handlers.get(type(env.message), self._on_stray)(env, now)

    # --- the handlers --------------------------------------------------------------------
    def _on_hello(self, env: Envelope, now: float) -> bool:
        """A worker asks for work: on first contact, as a restarted process, or again
        after a round that failed."""
        msg, core = cast(Hello, env.message), self.core
        w, inc = env.src, env.incarnation
        if (msg.numel, msg.checksum) != (self.numel, self.crc):
            self.transport.refuse(w, inc, Refused(self.numel, self.crc, Why.MODEL))
            if msg.late:
                return False  # a late joiner with another model: it got the error, go on
            raise ConfigError(
                f"worker rank {w} has a model of {msg.numel} parameters "
                f"(shape checksum {msg.checksum}), the server's has {self.numel} "
                f"(checksum {self.crc}); start every rank with the same model settings"
            )
        if self.state.admitted.get(w) != inc:
            watched = self.state.admitted.get(w, inc - 1)
            if msg.late and not msg.force and not self.links.replaceable(w) and watched > 0:
                # Decided by WorkerLinks.settle_rejoins: admitted once the old incarnation
                # is declared dead, refused as soon as it is seen beating.
                self.state.pending[w] = (inc, watched, self.transport.heartbeat(w, watched))
            else:
                self.links.admit(w, inc, now)
        else:
            if w in core.live:
                core.drop(w)  # the same process after a failed round: that round is lost
            self.pull.forget(w)  # it says hello with no copy of theta we can count on
            core.join(w, now)
        return True

    def _on_update(self, env: Envelope, now: float) -> bool:
        """A worker's finished round: its payload follows on its link."""
        msg, w, core = cast(Update, env.message), env.src, self.core
        # Screened before its payload is read: a push while another is still arriving
        # is one sent twice; so is one while no round is in flight.
        why = "duplicate" if w in self.state.reading else core.screen(w, msg.epoch, msg.version)
        if why is not None:
            # Its payload is read and dropped on the link thread (bounded by the link
            # timeout), so that the Refused behind it can reach the worker.
            with contextlib.suppress(RuntimeError):
                self.transport.receive_payload(w, self.numel, msg.dtype)
            core.refuse_unread(w, why, now)
            _log.warning(
                "thinwire: refused a push from worker %d (incarnation %d): %s",
                w,
                env.incarnation,
                describe(why),
            )
            self.links.stop(w, env.incarnation, why)
        else:
            try:
                fut = self.transport.receive_payload(w, self.numel, msg.dtype)
                self.state.reading[w] = (env, fut)
            except RuntimeError:  # its link is gone already
                self.links.lost(w)
        return True

    def _on_stray(self, env: Envelope, now: float) -> bool:
        """A server-to-worker kind in the workers' queue: counted, nothing else."""
        self.state.stale += 1
        return True

    # --- pushes ------------------------------------------------------------------------
    def _take_payloads(self) -> bool:
        """Apply (or drop) every push whose payload is in; whether any was."""
        st, taken = self.state, False
        for w, (penv, fut) in list(st.reading.items()):
            if not fut.done():
                continue
            del st.reading[w]
            try:
                payload = fut.result()
            except AuthError as exc:  # a payload swapped on the link: trust nothing on it
                st.forged += 1
                _log.warning("thinwire: refused a push: %s; worker %d is cut off", exc, w)
                self.links.lost(w)
            except RuntimeError:  # killed between its header and its payload, or silent
                self.links.lost(w)
            else:
                self._apply(w, penv, payload)
            taken = True
        return taken

    def _apply(self, w: int, env: Envelope, payload: torch.Tensor) -> None:
        """A push's payload is in: check it and apply it (or refuse it)."""
        core, msg = self.core, cast(Update, env.message)
        self.state.pushed += payload.numel() * payload.element_size()
        grad = decode(payload, self.numel)
        refused0 = core.pushes_refused
        if core.submit(
            w, msg.epoch, grad, msg.steps, msg.seconds_per_step, time.monotonic(), msg.version
        ):
            tally = self.state.updates.setdefault((w, env.incarnation), [0, 0])
            tally[0] += 1
            tally[1] += msg.steps
        elif core.pushes_refused > refused0:
            why = core.guard.last_refusal
            _log.warning(
                "thinwire: refused a push from worker %d (incarnation %d): %s%s",
                w,
                env.incarnation,
                describe(why),
                f", {core.guard.last_ratio:.1f}x the recent median norm per step"
                if why == "norm"
                else "",
            )
            if w in core.evicted:
                self.links.stop(w, env.incarnation, why)

    # --- rounds, evaluations, checkpoints ------------------------------------------------
    def _hand_out(self, now: float) -> None:
        """Send every worker that is due its next round (or its stop order)."""
        core = self.core
        for w in core.due(now):
            work = core.work_for(w, now)
            if work is None:
                continue
            try:
                payload = None
                if not work.stop:
                    delta, payload = self.pull.encode(w, core.theta.detach())
                    work = replace(work, dtype=payload.dtype, delta=delta)
                self.transport.send(w, work, payload)  # on its link's thread: returns at once
            except RuntimeError:  # no link to it any more
                self.links.lost(w)

    def _evaluate_and_checkpoint(self) -> None:
        """Evaluate and checkpoint if the inner steps applied reached their next mark."""
        core, st, s = self.core, self.state, self.settings
        if core.steps_applied >= st.next_eval and s.evaluate is not None:
            while st.next_eval <= core.steps_applied:
                st.next_eval += s.eval_every_steps
            st.last = report(core, s.evaluate, s.on_eval, st.clock0)
        if s.checkpoint is not None and core.steps_applied >= st.next_ckpt:
            while st.next_ckpt <= core.steps_applied:
                st.next_ckpt += s.checkpoint_every_steps
            s.checkpoint(core)

    def _close(self) -> dict[str, Any]:
        """Let the stop orders arrive, checkpoint, evaluate a last time; the counters."""
        core, st, s = self.core, self.state, self.settings
        # The stop orders are on their links' threads: let them arrive (bounded) before the
        # links are closed.
        self.transport.settle(self.transport.connect_timeout.total_seconds())
        if s.checkpoint is not None:
            s.checkpoint(core)
        self.transport.mark_finished()
        out = st.counters(core)
        if s.evaluate is not None:
            # The final evaluation, unless the last one was of this very theta (no record
            # twice).
            last = st.last
            if (
                last.get("updates") != core.updates_applied
                or last.get("step") != core.steps_applied
            ):
                last = st.last = report(core, s.evaluate, s.on_eval, st.clock0)
            out["val_loss"] = last["val_loss"]
            out["metrics"] = {k: v for k, v in last.items() if k not in RECORD}
        return out
