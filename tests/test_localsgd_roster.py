"""The roster: admission, waiting and the grace deadline, deaths, strikes, overdue rounds."""

from __future__ import annotations

from thinwire.localsgd.algorithm.roster import Roster


def test_admit_tells_a_return_from_the_dead_and_clears_the_past() -> None:
    r = Roster()
    assert not r.admit(1) and not r.admit(1)  # new, then already live
    assert r.remove(1) is not None and r.dead == {1} and r.remove(1) is None
    r.evicted.add(1)
    r.strikes[1] = 2
    assert r.admit(1)  # presumed dead: back
    assert 1 in r.live and not r.dead and not r.evicted and 1 not in r.strikes
    r.retire(1)
    assert 1 not in r.live and r.retired == {1}
    assert not r.admit(1) and not r.retired


def test_grace_deadline_starts_with_the_first_arrival() -> None:
    r = Roster(grace_s=2.0)
    for w in (3, 1, 2):
        r.admit(w)
    r.wait(3, 10.0)
    r.wait(1, 11.0)
    r.wait(3, 11.5)  # already waiting: not twice, and the deadline stays
    assert r.waiting == [3, 1] and r.deadline == 12.0
    assert r.take_waiting(ordered=False) == [3, 1] and r.deadline is None
    r.wait(2, 20.0)
    r.wait(1, 20.5)
    assert r.deadline == 22.0 and r.take_waiting(ordered=True) == [1, 2]
    r.wait(2, 30.0)
    r.remove(2)  # a dead worker waits no longer
    assert r.waiting == []


def test_strikes_count_refusals_in_a_row() -> None:
    r = Roster()
    assert not r.strike(1, 3) and not r.strike(1, 3)
    r.forgive(1)
    assert not r.strike(1, 3) and not r.strike(1, 3) and r.strike(1, 3)


def test_overdue_uses_the_expected_round_time_or_the_floor() -> None:
    r = Roster()
    for w in (1, 2, 3):
        r.admit(w)
    for w in (1, 2):
        r.live[w].busy, r.live[w].steps, r.live[w].since = True, 10, 0.0
    assert r.busy == 2

    def expected(worker: int, steps: int) -> float | None:
        return None if worker == 2 else 0.5 * steps  # worker 2's speed is unknown

    # worker 1: limit max(3, 2 * 5) = 10 s; worker 2: the floor, 3 s; 3 is idle.
    assert r.overdue(5.0, 2.0, 3.0, expected) == [2]
    assert r.overdue(10.5, 2.0, 3.0, expected) == [1, 2]
