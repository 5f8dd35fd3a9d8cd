"""Who takes part in an asynchronous run: live, waiting, dead, retired and evicted workers.

:class:`Roster` is the liveness bookkeeping of
:class:`~thinwire.localsgd.algorithm.server_core.ServerCore`: the round each live worker
is on (how many steps, since when, where on its shard's lr schedule), the workers
waiting for an answer and the end of their grace period, the workers presumed dead,
those sent home (retired), and the refused pushes in a row that get a worker evicted. It holds no
parameters and no budget: the server decides what a change of membership means for the
outer optimizer, the shards and the steps handed out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Roster", "Round"]


@dataclass
class Round:
    """A live worker's current round."""

    busy: bool = False
    """A round is handed out and not back yet."""
    steps: int = 0
    """Inner steps of the round."""
    since: float = 0.0
    """When it was handed out (wall or virtual seconds)."""
    clock: int = 0
    """Where the round started on its shard's lr schedule."""
    planned: int = 1
    """Length of that shard's lr schedule."""
    version: int = 0
    """The theta version handed out with the round: its push must carry this one."""


class Roster:
    """The workers of one run and their state.

    Args:
        grace_s: how long an arrival waits for others before it is answered (the server's
            grace period; wall or virtual seconds).
    """

    def __init__(self, grace_s: float = 0.0) -> None:
        self.grace_s = grace_s
        self.live: dict[int, Round] = {}
        self.dead: set[int] = set()
        self.retired: set[int] = set()
        self.evicted: set[int] = set()
        self.strikes: dict[int, int] = {}  # refused pushes in a row, per worker
        self.faults: dict[int, int] = {}  # refusals no accepted push forgives, per worker
        self.waiting: list[int] = []
        self.deadline: float | None = None  # when the first waiting arrival's grace ends

    def admit(self, worker: int) -> bool:
        """Make ``worker`` live (a no-op if it is); True if it was presumed dead."""
        if worker in self.live:
            return False
        self.live[worker] = Round()
        self.retired.discard(worker)
        self.evicted.discard(worker)
        self.strikes.pop(worker, None)
        self.faults.pop(worker, None)
        if worker in self.dead:
            self.dead.discard(worker)
            return True
        return False

    def remove(self, worker: int) -> Round | None:
        """``worker`` is dead: its last round, or None if it was not live."""
        info = self.live.pop(worker, None)
        if info is None:
            return None
        if worker in self.waiting:
            self.waiting.remove(worker)
        self.dead.add(worker)
        return info

    def retire(self, worker: int) -> None:
        """``worker`` was sent home (a stop order)."""
        self.live.pop(worker, None)
        self.retired.add(worker)

    def wait(self, worker: int, now: float) -> None:
        """``worker`` waits for an answer; the first waiting arrival starts the grace period."""
        if worker not in self.waiting:
            self.waiting.append(worker)
        if self.deadline is None:
            self.deadline = now + self.grace_s

    def take_waiting(self, ordered: bool) -> list[int]:
        """Every waiting worker (in worker order if ``ordered``, else in arrival order);
        the grace period starts afresh with the next arrival."""
        out, self.waiting, self.deadline = self.waiting, [], None
        return sorted(out) if ordered else out

    def strike(self, worker: int, limit: int, lasting: bool = False) -> bool:
        """Count a refused push of ``worker``; True once it has ``limit`` in a row, or
        ``limit`` ``lasting`` ones (refusals an accepted push does not forgive) in all."""
        self.strikes[worker] = self.strikes.get(worker, 0) + 1
        if lasting:
            self.faults[worker] = self.faults.get(worker, 0) + 1
        return self.strikes[worker] >= limit or self.faults.get(worker, 0) >= limit

    def forgive(self, worker: int) -> None:
        """An accepted push ends ``worker``'s run of refusals."""
        self.strikes.pop(worker, None)

    def state_dict(self) -> dict[str, Any]:
        """Every worker's state, in the order the roster keeps them (it decides who is
        answered first); plain values."""
        return {
            "live": [(w, asdict(info)) for w, info in self.live.items()],
            "dead": sorted(self.dead),
            "retired": sorted(self.retired),
            "evicted": sorted(self.evicted),
            "strikes": dict(self.strikes),
            "faults": dict(self.faults),
            "waiting": list(self.waiting),
            "deadline": self.deadline,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`. ``live``, ``dead``, ``retired`` and ``evicted``
        are refilled in place: the server holds them by reference."""
        self.live.clear()
        self.live.update((int(w), Round(**info)) for w, info in state["live"])
        for name in ("dead", "retired", "evicted"):
            kept = getattr(self, name)
            kept.clear()
            kept.update(int(w) for w in state[name])
        self.strikes = {int(w): int(n) for w, n in state["strikes"].items()}
        self.faults = {int(w): int(n) for w, n in state["faults"].items()}
        self.waiting = [int(w) for w in state["waiting"]]
        self.deadline = None if state["deadline"] is None else float(state["deadline"])

    @property
    def busy(self) -> int:
        """Rounds in flight."""
        return sum(1 for w in self.live.values() if w.busy)

    def overdue(
        self,
        now: float,
        factor: float,
        floor_s: float,
        expected_s: Callable[[int, int], float | None],
    ) -> list[int]:
        """Busy workers silent for ``max(floor_s, factor * expected_s(worker, steps))``
        (``floor_s`` alone where the expected round time is unknown)."""
        out = []
        for w, info in self.live.items():
            if not info.busy:
                continue
            expected = expected_s(w, info.steps)
            limit = floor_s if expected is None else max(floor_s, factor * expected)
            if now - info.since > limit:
                out.append(w)
        return out
