"""The server's loop: read the workers' messages, apply pushes, hand out rounds, watch
heartbeats. :class:`~thinwire.localsgd.server.ServerCore` decides *what* happens; this
loop feeds it the wall clock and the transport's messages
(:mod:`thinwire.localsgd.messages`), and carries out its answers.

A worker is dead when its heartbeat has not moved for ``dead_after_s`` (a killed
process), or when a send to it fails; it is *hung* (and dropped too) when a round takes
``max(hung_after_min_s, hung_after_factor * expected round time)``.

A worker process that says hello with a newer incarnation than the one admitted (a
restarted process, see :func:`thinwire.localsgd.rejoin_async`) replaces it: the older
incarnation's link is closed, its round in flight is lost (rewound and handed out
again), and whatever it still had queued is ignored. The newcomer starts as a worker
that joined late: no DyLU speed yet, back in Delayed Nesterov's N, the free shard with
least progress.

Admission (see :mod:`thinwire.localsgd.auth`): every message's seal is checked before
anything else; one that fails (forged, replayed, sent without the run's token) is
consumed, logged and counted (``unauthenticated_messages``), and changes nothing. A
rejoin replaces only a worker the server considers dead: its hello waits until the old
incarnation is declared dead (heartbeat silent for ``dead_after_s``) and is refused as
soon as the old one is seen beating, unless the rejoin is forced (``Hello.force``).
Pushes the :class:`~thinwire.localsgd.push_guard.PushGuard` refuses are logged; a
worker the core evicts for them is told why and cut off.

Nothing a worker sends makes this loop wait: a push's payload is received on the
worker's link thread (:meth:`~thinwire.localsgd.transport.Transport.receive_payload`)
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
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.auth import AuthError
from thinwire.localsgd.compression import PullEncoder, decode
from thinwire.localsgd.messages import Hello, MessageError, Refused, RunInfo, Update, Why
from thinwire.localsgd.push_guard import REASONS, describe
from thinwire.localsgd.server import ServerCore
from thinwire.localsgd.task import EvalResult, eval_metrics
from thinwire.localsgd.transport import Transport

__all__ = ["serve"]

_log = logging.getLogger("thinwire.localsgd")
_LOGGED_FORGERIES = 10  # then only counted: a flood must not flood the log too
_SUMMARY_EVERY_S = 1.0  # malformed messages: one summary line a second at most


def _detail(reason: str | None) -> int:
    # A refusal reason as the Refused message carries it (0: none named).
    return REASONS.index(reason) + 1 if reason in REASONS else 0


def serve(
    core: ServerCore,
    transport: Transport,
    workers: list[int],
    signature: tuple[int, int],
    *,
    evaluate: Callable[[torch.Tensor], EvalResult] | None = None,
    eval_every_steps: int = 0,
    on_eval: Callable[[dict[str, Any]], None] | None = None,
    checkpoint: Callable[[ServerCore], None] | None = None,
    checkpoint_every_steps: int = 0,
    dead_after_s: float = 10.0,
    hung_after_min_s: float = 600.0,
    hung_after_factor: float = 10.0,
    max_wall_s: float | None = None,
    elapsed_s: float = 0.0,
    pull: PullEncoder | None = None,
) -> dict[str, Any]:
    """Serve until every worker is stopped or dead; returns the run's counters.

    ``evaluate(theta)`` runs at the start (of a fresh run), every ``eval_every_steps``
    inner steps applied, and at the end, each record going to ``on_eval``: ``step``,
    ``updates``, ``rejected``, ``time_s``, ``val_loss`` and any other metrics it names
    (:func:`~thinwire.localsgd.task.eval_metrics`). The counters then carry the final
    record's ``val_loss``, and all its metrics as ``metrics``.
    ``checkpoint(core)`` runs every ``checkpoint_every_steps`` and at the end.
    ``elapsed_s``: seconds a resumed run had already been served; reported times
    (``time_s``, ``wall_s``) continue from it.
    ``pull``: the pull codec (None: theta goes out whole, in fp32).
    """
    pull = pull or PullEncoder("none")
    numel, crc = signature
    start = time.monotonic()
    clock0 = start - elapsed_s
    transport.publish(RunInfo(len(workers), numel, crc, len(core.shards)))
    admitted: dict[int, int] = {}  # worker -> incarnation whose link is open
    beats: dict[int, tuple[int, int, float]] = {w: (0, -1, start) for w in workers}
    updates: dict[tuple[int, int], list[int]] = {}  # (worker, incarnation) -> [pushes, steps]
    joins: list[dict[str, Any]] = []
    stale = bad = forged = refused_rejoins = pushed = 0
    bad_told, bad_told_at = 0, start  # malformed messages already summarised, and when
    reading: dict[int, tuple[Any, Future[torch.Tensor]]] = {}  # worker -> push being received
    pending: dict[int, tuple[int, int, int]] = {}  # worker -> rejoin (incarnation, watched, beats)
    banned: set[tuple[int, int]] = set()  # evicted incarnations
    next_beat_check = next_pending_check = start
    next_eval = (
        (core.steps_applied // eval_every_steps + 1) * eval_every_steps
        if eval_every_steps
        else math.inf
    )
    next_ckpt = (
        (core.steps_applied // checkpoint_every_steps + 1) * checkpoint_every_steps
        if checkpoint_every_steps
        else math.inf
    )
    if core.steps_applied >= core.total_steps:
        core.steps_assigned = core.total_steps  # resumed a finished run: just stop everyone

    last: dict[str, Any] = {}  # the latest evaluation record
    if evaluate is not None and core.steps_applied == 0:
        last = _report(core, evaluate, on_eval, clock0)

    def accounted() -> bool:
        return all(w in core.retired or w in core.dead for w in workers)

    def lost(w: int) -> None:
        # The link broke (the process is gone): drop it, and let only a new incarnation
        # back in, since nothing can reach the old one any more.
        reading.pop(w, None)
        core.drop(w)
        transport.close(w)
        pull.forget(w)

    def stop_worker(w: int, inc: int, why: str | None) -> None:
        # Evicted: tell it why (after whatever is already on its link, for a bounded
        # time) and cut it off; whatever its incarnation still sends is ignored.
        banned.add((w, inc))
        reading.pop(w, None)
        pull.forget(w)
        with contextlib.suppress(RuntimeError):
            transport.send(w, Refused(numel, crc, Why.EVICTED, _detail(why)))
        transport.close(w, drain=True)
        _log.warning(
            "thinwire: stopped worker %d for its refused pushes, the last: %s", w, describe(why)
        )

    def applied(w: int, env: Any, payload: torch.Tensor) -> None:
        # A push's payload is in: check it and apply it (or refuse it).
        nonlocal pushed
        msg = env.message
        pushed += payload.numel() * payload.element_size()
        grad = decode(payload, numel)
        refused0 = core.pushes_refused
        if core.submit(
            w, msg.epoch, grad, msg.steps, msg.seconds_per_step, time.monotonic(), msg.version
        ):
            tally = updates.setdefault((w, env.incarnation), [0, 0])
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
                stop_worker(w, env.incarnation, why)

    def admit(w: int, inc: int, now: float) -> None:
        # A new incarnation of ``w`` (first contact, or a restarted process).
        reading.pop(w, None)  # a push the older incarnation was still sending is lost too
        if w in core.live:
            core.drop(w)  # the older incarnation's round in flight is lost
        try:
            transport.accept(w, inc)
        except RuntimeError:  # it died between its hello and connecting
            core.drop(w)
            core.dead.add(w)
            return
        admitted[w] = inc
        joins.append({"worker": w, "incarnation": inc, "time_s": now - clock0})
        pull.forget(w)  # a new process holds no copy of theta we can count on
        core.join(w, now)

    def replaceable(w: int) -> bool:
        return w in core.dead or w in core.retired

    while not (core.finished and accounted()):
        now = time.monotonic()
        if max_wall_s is not None and now - start > max_wall_s:
            raise TimeoutError(f"the server ran past max_wall_s={max_wall_s}")
        try:
            env = transport.poll()
        except AuthError as exc:
            # Forged, replayed, or sealed without the run's token: consumed, nothing else.
            env, forged = None, forged + 1
            if forged <= _LOGGED_FORGERIES:
                _log.warning("thinwire: refused a message: %s", exc)
        except MessageError:
            # A malformed header in the queue: no worker of this run sent it (or it is
            # from another version of thinwire). It is consumed; nothing else is read.
            env, bad = None, bad + 1
        if bad > bad_told and now - bad_told_at >= _SUMMARY_EVERY_S:
            # One line a second at most, however many arrive: a flood of garbage must not
            # become a flood in the log.
            _log.warning(
                "thinwire: ignored %d malformed messages in the run's queue (%d in all)",
                bad - bad_told,
                bad,
            )
            bad_told, bad_told_at = bad, now
        msg = env.message if env is not None else None
        if env is not None and (
            env.src not in workers
            or env.incarnation < admitted.get(env.src, 0)
            or (env.src, env.incarnation) in banned
            or (not isinstance(msg, Hello) and env.incarnation != admitted.get(env.src))
        ):
            # An unknown rank, or a replaced process's leftovers (its link is closed, so
            # there is no payload to drain).
            stale += 1
        elif env is not None and isinstance(msg, Hello):
            w, inc = env.src, env.incarnation
            if (msg.numel, msg.checksum) != (numel, crc):
                transport.refuse(w, inc, Refused(numel, crc, Why.MODEL))
                if msg.late:
                    continue  # a late joiner with another model: it got the error, go on
                raise ConfigError(
                    f"worker rank {w} has a model of {msg.numel} parameters "
                    f"(shape checksum {msg.checksum}), the server's has {numel} "
                    f"(checksum {crc}); start every rank with the same model settings"
                )
            if admitted.get(w) != inc:
                watched = admitted.get(w, inc - 1)
                if msg.late and not msg.force and not replaceable(w) and watched > 0:
                    # Decided below: admitted once the old incarnation is declared dead,
                    # refused as soon as it is seen beating.
                    pending[w] = (inc, watched, transport.heartbeat(w, watched))
                else:
                    admit(w, inc, now)
            else:
                if w in core.live:
                    core.drop(w)  # the same process after a failed round: that round is lost
                pull.forget(w)  # it says hello with no copy of theta we can count on
                core.join(w, now)
        elif env is not None and isinstance(msg, Update):
            w = env.src
            # Screened before its payload is read: a push while another is still arriving
            # is one sent twice; so is one while no round is in flight.
            why = "duplicate" if w in reading else core.screen(w, msg.epoch, msg.version)
            if why is not None:
                # Its payload is read and dropped on the link thread (bounded by the link
                # timeout), so that the Refused behind it can reach the worker.
                with contextlib.suppress(RuntimeError):
                    transport.receive_payload(w, numel, msg.dtype)
                core.refuse_unread(w, why, now)
                _log.warning(
                    "thinwire: refused a push from worker %d (incarnation %d): %s",
                    w,
                    env.incarnation,
                    describe(why),
                )
                stop_worker(w, env.incarnation, why)
            else:
                try:
                    reading[w] = (env, transport.receive_payload(w, numel, msg.dtype))
                except RuntimeError:  # its link is gone already
                    lost(w)
        elif env is not None:
            stale += 1  # a server-to-worker kind in the workers' queue
        for w, (penv, fut) in list(reading.items()):
            if not fut.done():
                continue
            del reading[w]
            try:
                payload = fut.result()
            except AuthError as exc:  # a payload swapped on the link: trust nothing on it
                forged += 1
                _log.warning("thinwire: refused a push: %s; worker %d is cut off", exc, w)
                lost(w)
            except RuntimeError:  # killed between its header and its payload, or silent
                lost(w)
            else:
                applied(w, penv, payload)
            env = env or penv  # something happened: evaluate and checkpoint below
        for w in transport.broken_links():
            lost(w)  # a round or a stop order that could not be delivered
        if env is not None:
            if core.steps_applied >= next_eval and evaluate is not None:
                while next_eval <= core.steps_applied:
                    next_eval += eval_every_steps
                last = _report(core, evaluate, on_eval, clock0)
            if checkpoint is not None and core.steps_applied >= next_ckpt:
                while next_ckpt <= core.steps_applied:
                    next_ckpt += checkpoint_every_steps
                checkpoint(core)
        now = time.monotonic()
        for w in core.due(now):
            work = core.work_for(w, now)
            if work is None:
                continue
            try:
                payload = None
                if not work.stop:
                    delta, payload = pull.encode(w, core.theta.detach())
                    work = replace(work, dtype=payload.dtype, delta=delta)
                transport.send(w, work, payload)  # on its link's thread: returns at once
            except RuntimeError:  # no link to it any more
                lost(w)
        for w in core.overdue(now, hung_after_factor, hung_after_min_s):
            core.drop(w)
        if pending and now >= next_pending_check:
            next_pending_check = now + 0.1
            for w, (inc, watched, count) in list(pending.items()):
                if replaceable(w):
                    del pending[w]
                    admit(w, inc, now)
                elif transport.heartbeat(w, watched) > count:
                    del pending[w]
                    refused_rejoins += 1
                    _log.warning(
                        "thinwire: refused a rejoin of worker %d: its incarnation %d is alive",
                        w,
                        watched,
                    )
                    transport.refuse(w, inc, Refused(numel, crc, Why.ALIVE))
        if now >= next_beat_check:
            next_beat_check = now + min(1.0, dead_after_s / 4)
            _check_heartbeats(core, transport, workers, admitted, beats, now, dead_after_s)
        if env is None:
            time.sleep(0.001)
    # The stop orders are on their links' threads: let them arrive (bounded) before the
    # links are closed.
    transport.settle(transport.connect_timeout.total_seconds())
    if checkpoint is not None:
        checkpoint(core)
    transport.mark_finished()
    out = {
        "wall_s": time.monotonic() - clock0,
        "dead_workers": sorted(core.dead),
        "incarnations": dict(sorted(admitted.items())),
        "joins": joins,
        "updates_by_incarnation": [
            {"worker": w, "incarnation": i, "updates": n, "inner_steps": s}
            for (w, i), (n, s) in sorted(updates.items())
        ],
        "stale_messages": stale,
        "malformed_messages": bad,
        "unauthenticated_messages": forged,
        "refused_rejoins": refused_rejoins,
        "evicted_workers": sorted(core.evicted),
        "push_bytes": pushed,
    }
    if evaluate is not None:
        # The final evaluation, unless the last one was of this very theta (no record twice).
        if last.get("updates") != core.updates_applied or last.get("step") != core.steps_applied:
            last = _report(core, evaluate, on_eval, clock0)
        out["val_loss"] = last["val_loss"]
        out["metrics"] = {k: v for k, v in last.items() if k not in _RECORD}
    return out


def _check_heartbeats(
    core: ServerCore,
    transport: Transport,
    workers: list[int],
    admitted: dict[int, int],
    beats: dict[int, tuple[int, int, float]],
    now: float,
    dead_after_s: float,
) -> None:
    for w in workers:
        if w in core.retired:
            continue
        # Watch the admitted incarnation; before the first hello, the newest drawn.
        inc = admitted.get(w) or transport.latest_incarnation(w)
        count = transport.heartbeat(w, inc)
        watched, last, since = beats[w]
        if inc != watched or count != last:
            beats[w] = (inc, count, now)
            if inc == watched and w in core.dead and transport.linked(w):
                # Only stalled (an overloaded host): it is alive. Offer it work, so that
                # a worker waiting for a reply is never left behind.
                core.join(w, now)
        elif w not in core.dead and now - since > dead_after_s:
            core.drop(w)
            core.dead.add(w)  # also covers a worker that died before its hello


_RECORD = ("step", "updates", "rejected", "time_s")  # an evaluation record's own keys


def _report(
    core: ServerCore,
    evaluate: Callable[[torch.Tensor], EvalResult],
    on_eval: Callable[[dict[str, Any]], None] | None,
    start: float,
) -> dict[str, Any]:
    metrics = eval_metrics(evaluate(core.theta.detach()))  # val_loss first, then the rest
    rec = {
        "step": core.steps_applied,
        "updates": core.updates_applied,
        "rejected": core.updates_rejected,
        "time_s": time.monotonic() - start,
    } | metrics
    if on_eval is not None:
        on_eval(rec)
    return rec
