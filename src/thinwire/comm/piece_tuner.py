"""How many pieces the 1-bit allreduce sends each phase in, chosen by measuring.

Sending a phase in pieces lets the compute of one piece (the server average, the output
unpacking) run while the next pieces are on the wire. Whether that pays depends on the
link, and the best count differs a lot. On 4 emulated hosts sharing 2 cores, 64 MiB of
fp32, the median call took:

=========  ========  ========  ========  ========
pieces     1         4         8         16
=========  ========  ========  ========  ========
100 Mbit   ~440 ms   ~370 ms   ~350 ms   ~340 ms
1 Gbit     ~155 ms   ~163 ms   ~210 ms   ~220 ms
=========  ========  ========  ========  ========

On a slow link the wire dominates and the overlap wins. On a fast one the compute
dominates and every extra collective costs its overhead (and, on a link with real
latency, a round trip per step of gloo's ring). No size rule gets both right, so
:class:`PieceTuner` tries the counts and keeps the fastest.

With ``schemes=("ring", "fanout")`` (the collective's ``phase2="auto"``) the tuner then
tries phase 2 as a fan-out at the chosen count for ``trials`` calls and keeps it if it is
clearly faster (by :data:`PREFER_FEWER`). On a LAN the two are within noise and the ring
stays; with 10-50 ms between hosts the ring's W - 1 sequential steps, each a round trip
with gloo, lose 11-26% (docs/results/testbed.md, "What latency changes"). The same runs show
why the count is measured rather than set: with latency every extra piece costs round
trips (16 pieces took 4x as long as 2 at 50 ms), without it 8 pieces were the fastest.

Every rank must choose the same count, or the collectives would not match. The tuner
therefore only sees data that every rank holds: the shortest of the ranks' durations
of the previous call, which travel in the call's small metadata gather. (The rank that
arrived last waited least, so its time is the closest to the call's own, not to the
arrival skew of the training loop around it.) Fed the same numbers in the same order,
every rank's tuner makes the same choice; the collective checks that every rank's tuner
is at the same call and fails with a clear error otherwise.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["CANDIDATES", "MIN_PIECE_BYTES", "PieceTuner"]

CANDIDATES = (1, 2, 4, 8, 16)
"""Piece counts tried, in this order."""

MIN_PIECE_BYTES = 16 << 10
"""A piece carries at least this many bytes of one segment's bits (128K elements), so
small buffers, where per-collective overhead dominates, are sent whole."""

GIVE_UP = 1.2
"""Stop trying larger counts once one is this much slower than the best so far (the
call time is close to unimodal in the count)."""

PREFER_FEWER = 1.05
"""Keep the smallest count within this factor of the fastest. Each extra piece is one
more collective (and on a link with real latency, more round trips), and a few calls
per count cannot tell apart counts closer than this: at 1 Gbit/s, where 1-4 pieces are
about equally fast, picking 4 on noise gave 4.0-4.7x fp32 against 5.1-6.4x for 1-2."""


class PieceTuner:
    """Tries each piece count for ``trials`` calls, then keeps the fastest (the smallest
    count within 5% of it).

    The first call is a warm-up whose time is dropped (it allocates and touches fresh
    buffers). Tuning costs at most ``1 + trials * len(CANDIDATES)`` calls, fewer when
    larger counts stop paying, and the call after them is the first at the chosen count
    (a call's time reaches the tuner with the next call); all of them produce the
    normal, bit-identical result.

    With ``ahead=True`` the tuner also decides each call's count one call before it
    (:attr:`upcoming`), from the times it has by then, so that the collective can send
    its bits before the call's metadata is in and the trials are timed the way the
    tuned calls will run (``OneBitAllreduce(overlap_meta=True)``). The trial sequence is
    known in advance; only three decisions need the time of the call just before them
    and wait for it: the count (after its trials, or on giving up), and the phase-2
    scheme. Giving up on larger counts is judged on the trials timed so far.

    Args:
        segment_bytes: bytes of sign bits in one rank's segment (``N / W / 8``).
        trials: calls per candidate; the median of their times is its score (robust to
            one call slowed by something else on the machine or the link).
        schemes: phase-2 schemes to choose from, the default first: ``("ring",)`` tunes
            the count alone, ``("ring", "fanout")`` then tries the fan-out too.
        counts: the counts to try (default: :data:`CANDIDATES` the segment can hold);
            one count, e.g. a fixed ``pieces``, leaves only the scheme to tune.
        ahead: decide each call's count a call early (see above).
    """

    def __init__(
        self,
        segment_bytes: int,
        trials: int = 3,
        schemes: tuple[str, ...] = ("ring",),
        counts: tuple[int, ...] | None = None,
        ahead: bool = False,
    ) -> None:
        limit = max(1, segment_bytes // MIN_PIECE_BYTES)
        self.candidates = list(counts) if counts else [k for k in CANDIDATES if k <= limit]
        self.trials = max(1, trials)
        self.ahead = ahead
        self.schemes = schemes
        self.scores: dict[int, float] = {}
        """Each count's median time (the default scheme)."""
        self.scheme_scores: dict[str, float] = {}
        # One count and one scheme: nothing to measure. (One count and two schemes: the
        # count is still timed, as the baseline the other scheme is held against.)
        single = len(self.candidates) == 1 and len(schemes) == 1
        self.choice: int | None = self.candidates[0] if single else None
        self.scheme: str | None = schemes[0] if len(schemes) == 1 else None
        """The phase-2 scheme chosen (None while it is being tried)."""
        self.current = self.candidates[0]  # the count of the latest call
        self.current_scheme = schemes[0]  # the scheme of the latest call
        # The count stage: a warm-up call, then ``trials`` calls per candidate.
        self._plan = [self.candidates[0]] + [k for k in self.candidates for _ in range(self.trials)]
        # Each call's (count, scheme, timed) as decided, in call order; ``timed`` says
        # whether its time scores a trial.
        self._decided: list[tuple[int, str, bool]] = []
        self._times: dict[tuple[int, str], list[float]] = {}
        self._alt_start = 0  # the first call of the other scheme's trials
        self._calls = 0

    @property
    def calls(self) -> int:
        """Calls this tuner has planned so far (the same on every rank)."""
        return self._calls

    @property
    def done(self) -> bool:
        """True once the count (and the phase-2 scheme) are fixed."""
        return self.choice is not None and self.scheme is not None

    @property
    def upcoming(self) -> tuple[int, str] | None:
        """The next call's count and scheme when they are decided before its metadata
        (once tuned, or with ``ahead``); None when that call must wait for it."""
        if self.done:
            return self.choice, self.scheme  # type: ignore[return-value]
        if len(self._decided) > self._calls:
            count, scheme, _ = self._decided[self._calls]
            return count, scheme
        return None

    def next(self, previous_seconds: float) -> int:
        """The piece count for this call (:attr:`current_scheme` its phase-2 scheme).

        Args:
            previous_seconds: the shortest rank's duration of the previous call; 0 when
                unknown (the first call, or the previous call raised), which is ignored.
        """
        k = self._calls
        self._calls += 1
        if self.done:
            self.current, self.current_scheme = self.choice, self.scheme  # type: ignore[assignment]
            return self.current
        if k >= 1 and previous_seconds > 0 and math.isfinite(previous_seconds):
            self._record(k - 1, previous_seconds)
        if len(self._decided) == k:  # not decided ahead: every time it needs is in
            self._decided.append(self._decide(k, complete=True))  # type: ignore[arg-type]
        if self.ahead and not self.done:
            following = self._decide(k + 1, complete=False)
            if following is not None:
                self._decided.append(following)
        self.current, self.current_scheme, _ = self._decided[k]
        return self.current

    def _record(self, call: int, seconds: float) -> None:
        count, scheme, timed = self._decided[call]
        if not timed:
            return
        times = self._times.setdefault((count, scheme), [])
        times.append(seconds)
        if scheme == self.schemes[0]:
            self.scores[count] = statistics.median(times)

    def _decide(self, call: int, complete: bool) -> tuple[int, str, bool] | None:
        """Call ``call``'s (count, scheme, timed). ``complete``: the previous call's time
        is in (else None where the decision needs it)."""
        base = self.schemes[0]
        if self.choice is None:
            if call < len(self._plan) and not self._gave_up(call):
                return self._plan[call], base, call > 0
            if not complete:  # the choice needs every trial's time
                return None
            self.choice = self._pick()
            self._alt_start = call + 1
            return self.choice, self.scheme or base, False
        if self.scheme is None:
            if call < self._alt_start + self.trials:
                return self.choice, self.schemes[1], True
            if not complete:
                return None
            self._pick_scheme()
        return self.choice, self.scheme or base, False

    def _pick(self) -> int:
        """The smallest count whose score is within :data:`PREFER_FEWER` of the best."""
        if not self.scores:
            return self._plan[0]
        best = min(self.scores.values())
        return min(k for k, t in self.scores.items() if t <= PREFER_FEWER * best)

    def _pick_scheme(self) -> None:
        """After the count: keep the other scheme if it was clearly faster at it."""
        base = self.scores.get(self.choice, math.inf)  # type: ignore[arg-type]
        alt_times = self._times.get((self.choice, self.schemes[1]), [])  # type: ignore[arg-type]
        alt = statistics.median(alt_times) if alt_times else math.inf
        self.scheme_scores = {self.schemes[0]: base, self.schemes[1]: alt}
        self.scheme = self.schemes[1] if alt * PREFER_FEWER < base else self.schemes[0]

    def _gave_up(self, call: int) -> bool:
        """The count whose trials end before ``call`` is clearly slower than the best
        one (judged on the trials timed so far: one fewer when deciding ahead)."""
        if call < 1 + self.trials or self._plan[call] == self._plan[call - 1]:
            return False
        best = min(self.scores.values(), default=math.inf)
        return self.scores.get(self._plan[call - 1], math.inf) > GIVE_UP * best
