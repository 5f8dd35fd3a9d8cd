"""The piece-count tuner of the 1-bit allreduce: deterministic, picks the fastest, cheap."""

from __future__ import annotations

import pytest
import torch

from thinwire.comm import spawn
from thinwire.comm.onebit_allreduce import OneBitAllreduce
from thinwire.comm.piece_tuner import CANDIDATES, MIN_PIECE_BYTES, PieceTuner


def _drive(tuner: PieceTuner, seconds_for: dict[int, float], calls: int = 20) -> list[int]:
    """Feed the tuner the time each count 'takes'; return the counts it asked for."""
    used: list[int] = []
    previous = 0.0
    for _ in range(calls):
        k = tuner.next(previous)
        used.append(k)
        previous = seconds_for[k]
    return used


def test_picks_the_fastest_count_after_trying_each() -> None:
    tuner = PieceTuner(16 * MIN_PIECE_BYTES)
    assert tuner.candidates == list(CANDIDATES)
    times = {1: 0.44, 2: 0.41, 4: 0.37, 8: 0.35, 16: 0.36}
    used = _drive(tuner, times)
    assert tuner.choice == 8 and tuner.done
    # 1 warm-up call, then three calls per count, then the choice for good.
    assert used[:16] == [1] + [k for k in (1, 2, 4, 8, 16) for _ in range(3)]
    assert set(used[16:]) == {8}
    assert sum(len(t) for t in tuner._times.values()) == 15  # nothing kept after the choice


def test_one_slow_call_does_not_decide() -> None:
    tuner = PieceTuner(16 * MIN_PIECE_BYTES)
    seq = iter([0.0, 0.2, 0.2, 0.2, 0.15, 0.5, 0.5] + [0.3] * 20)  # 2 pieces: one fast fluke
    for _ in range(20):
        tuner.next(next(seq))
    assert tuner.choice == 1  # the median of 2 pieces' calls (0.5) loses to 1 piece's 0.2


def test_keeps_fewer_pieces_when_more_are_not_clearly_faster() -> None:
    tuner = PieceTuner(16 * MIN_PIECE_BYTES)
    _drive(tuner, {1: 0.155, 2: 0.152, 4: 0.148, 8: 0.2, 16: 0.3})
    assert tuner.choice == 1  # 4 is only 4.5% faster: not worth three more collectives


def test_stops_trying_larger_counts_once_they_are_clearly_slower() -> None:
    tuner = PieceTuner(16 * MIN_PIECE_BYTES)
    used = _drive(tuner, {1: 0.155, 2: 0.16, 4: 0.20, 8: 0.21, 16: 0.22})
    assert tuner.choice == 1
    assert 8 not in used and 16 not in used  # 4 was >20% slower than 1: no further tries


def test_same_observations_give_the_same_choice_and_unknown_times_are_ignored() -> None:
    times = {1: 0.3, 2: 0.2, 4: 0.25, 8: 0.4, 16: 0.5}
    a, b = PieceTuner(1 << 20), PieceTuner(1 << 20)
    assert _drive(a, times) == _drive(b, times)
    # A call that raised reports 0: it neither counts as fast nor stalls the tuning.
    c = PieceTuner(1 << 20, trials=2)
    # call 3 raised (0.0): count 1 keeps its one good time; counts 2, 4, 8 get two each
    seq = [0.0, 0.0, 0.3, 0.0, 0.2, 0.2, 0.25, 0.25, 0.4, 0.4, 0.0, 0.0]
    for t in seq:
        c.next(t)
    assert c.choice == 2


def test_small_segments_are_sent_whole_without_tuning() -> None:
    tuner = PieceTuner(MIN_PIECE_BYTES - 1)
    assert tuner.candidates == [1] and tuner.done
    assert {tuner.next(0.1) for _ in range(3)} == {1}


def _drive_schemes(tuner: PieceTuner, seconds: dict[tuple[str, int], float], calls: int = 30):
    used, previous = [], 0.0
    for _ in range(calls):
        k = tuner.next(previous)
        used.append((tuner.current_scheme, k))
        previous = seconds[tuner.current_scheme, k]
    return used


def test_fanout_is_tried_at_the_chosen_count_and_kept_when_clearly_faster() -> None:
    # What 16 MiB on 4 hosts 10 ms apart measured (docs/results/testbed.md): the ring pays a
    # round trip per step, the fan-out one for all.
    ring = {1: 0.199, 2: 0.193, 4: 0.265, 8: 0.427, 16: 0.819}
    times = {("ring", k): t for k, t in ring.items()} | {("fanout", 1): 0.170}
    tuner = PieceTuner(16 * MIN_PIECE_BYTES, schemes=("ring", "fanout"))
    used = _drive_schemes(tuner, times)
    # 2 pieces are within 5% of 1 on the ring: the fewer stay; then the fan-out wins.
    assert tuner.done and (tuner.choice, tuner.scheme) == (1, "fanout")
    first = used.index(("fanout", 1))
    assert used[first : first + 3] == [("fanout", 1)] * 3  # three trials, after the count
    assert all(s == "ring" for s, _ in used[:first]) and set(used[first:]) == {("fanout", 1)}
    assert tuner.scheme_scores == {"ring": 0.199, "fanout": 0.170}


def test_ring_stays_when_the_fanout_is_not_clearly_faster() -> None:
    # On a LAN the two were within noise: the default keeps its place.
    times = {("ring", 4): 0.089, ("fanout", 4): 0.087}
    tuner = PieceTuner(1 << 20, schemes=("ring", "fanout"), counts=(4,))
    used = _drive_schemes(tuner, times, calls=12)
    assert (tuner.choice, tuner.scheme) == (4, "ring")
    assert ("fanout", 4) in used and used[-1] == ("ring", 4)


def test_one_scheme_and_one_count_need_no_tuning() -> None:
    tuner = PieceTuner(1 << 20, schemes=("fanout",), counts=(2,))
    assert tuner.done and tuner.next(0.0) == 2 and tuner.current_scheme == "fanout"


def _drive_ahead(tuner: PieceTuner, seconds: dict[tuple[str, int], float], calls: int = 30):
    """As :func:`_drive_schemes`, noting the calls whose plan was not known a call early."""
    used, waited, previous = [], [], 0.0
    for call in range(calls):
        upcoming = tuner.upcoming
        k = tuner.next(previous)
        if upcoming is None:
            waited.append(call)
        else:
            assert upcoming == (k, tuner.current_scheme)  # what was announced is what runs
        used.append((tuner.current_scheme, k))
        previous = seconds[tuner.current_scheme, k]
    return used, waited


@pytest.mark.parametrize(
    "ring",
    [
        {1: 0.44, 2: 0.41, 4: 0.37, 8: 0.35, 16: 0.36},  # a slow link: 8 pieces
        {1: 0.155, 2: 0.16, 4: 0.20, 8: 0.21, 16: 0.22},  # gives up after 4
        {1: 0.199, 2: 0.193, 4: 0.265, 8: 0.427, 16: 0.819},  # 10 ms apart
    ],
)
def test_ahead_the_trials_are_known_a_call_early_and_choose_alike(ring: dict) -> None:
    times = {("ring", k): t for k, t in ring.items()}
    times |= {("fanout", k): 0.9 * t for k, t in ring.items()}
    plain = PieceTuner(16 * MIN_PIECE_BYTES, schemes=("ring", "fanout"))
    ahead = PieceTuner(16 * MIN_PIECE_BYTES, schemes=("ring", "fanout"), ahead=True)
    plain_used = _drive_schemes(plain, times)
    used, waited = _drive_ahead(ahead, times)
    assert used == plain_used and ahead.done
    assert (ahead.choice, ahead.scheme) == (plain.choice, plain.scheme)
    # Only the first call, the count's choice and the scheme's wait for the metadata.
    pick = used.index(("fanout", ahead.choice)) - 1
    assert waited == [0, pick, pick + 1 + ahead.trials]


def test_ahead_judges_giving_up_on_the_trials_timed_so_far() -> None:
    # 4 pieces' trials take 0.3, 0.1, 0.1 s (1 piece: 0.15): deciding ahead sees the
    # first two (median 0.2, over 1.2 x 0.15) and waits; with the third in, 4 pieces are
    # the fastest so far and 8 is tried.
    seq = {7: 0.3, 8: 0.1, 9: 0.1}
    tuner = PieceTuner(16 * MIN_PIECE_BYTES, ahead=True)
    waited, used = [], []
    for call in range(12):
        if tuner.upcoming is None:
            waited.append(call)
        used.append(tuner.next(seq.get(call - 1, 0.15) if call else 0.0))
    assert waited == [0, 10] and used[10] == 8


def _tuned_body(rank: int, world: int) -> tuple[int | None, bool, list[int]]:
    gen = torch.Generator().manual_seed(rank)
    n = 8 * world * 4 * MIN_PIECE_BYTES  # 4 * 16 KiB of bits per segment: 1, 2, 4 tried
    tuned, whole = OneBitAllreduce(), OneBitAllreduce(pieces=1, phase2="ring")
    same = True
    counts = []
    # 1 warm-up + 3 counts x 3 calls, the choice, 3 fan-out trials, then the scheme
    for _ in range(16):
        x = torch.randn(n, generator=gen)
        same &= torch.equal(tuned(x), whole(x))
        tuner = tuned._tuner
        counts.append((tuner.current, tuner.current_scheme) if tuner else (-1, ""))
    assert tuned.tuned
    # A fixed count still has its phase-2 scheme measured: not tuned before it is.
    fixed, pinned = OneBitAllreduce(pieces=2), OneBitAllreduce(pieces=2, phase2="fanout")
    assert not fixed.tuned and pinned.tuned
    plain, calls = OneBitAllreduce(pieces=1, phase2="ring"), 0
    while not fixed.tuned and calls < 20:
        x = torch.randn(n, generator=gen)
        same &= torch.equal(fixed(x), plain(x))
        calls += 1
    # 1 warm-up and 3 timed calls at the count, the count's choice, 3 fan-out trials,
    # then the scheme is chosen
    assert calls == 9 and fixed.pieces_in_use == 2
    return (tuned.pieces_in_use, tuned.phase2_in_use), same, counts


@pytest.mark.timeout(180)
def test_ranks_agree_on_the_tuned_count_and_results_do_not_change() -> None:
    results = spawn(_tuned_body, 2, timeout_s=170)
    choices = {choice for choice, _, _ in results}
    assert len(choices) == 1  # the same count and phase-2 scheme on every rank
    ((count, scheme),) = choices
    assert count in {1, 2, 4} and scheme in {"ring", "fanout"}
    assert all(same for _, same, _ in results)  # bit-identical to the one-piece call
    assert results[0][2] == results[1][2]  # every call used the same count and scheme
    assert len({k for k, _ in results[0][2]}) > 1  # more than one count was tried
    assert {s for _, s in results[0][2]} == {"ring", "fanout"}  # and both schemes
