"""DyLU: step counts from measured speeds, and the speed tracker."""

from __future__ import annotations

import pytest

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.dylu import SpeedTracker, dylu_steps


def test_dylu_steps_for_the_papers_toy_speeds() -> None:
    seconds = {1: 0.58, 2: 0.75, 3: 1.51, 4: 3.33}
    steps = dylu_steps({w: 1 / s for w, s in seconds.items()}, 50)
    # H_w = floor(v_w / v_max * H): 50 * 0.58 / s_w
    assert steps == {1: 50, 2: 38, 3: 19, 4: 8}
    assert dylu_steps({1: 100.0, 2: 1.0}, 10) == {1: 10, 2: 1}  # floored at 1


def test_speed_tracker_ema_and_dead_worker_leaves_the_reference() -> None:
    t = SpeedTracker(local_steps=20, ema=0.5)
    assert t.steps(1) == 20  # unmeasured: H
    t.report(1, 0.1)
    t.report(2, 0.4)
    assert (t.steps(1), t.steps(2)) == (20, 5)
    t.report(2, 0.2)  # EMA: 0.5 * 0.4 + 0.5 * 0.2 = 0.3
    assert t.steps(2) == 6
    t.remove(1)  # the fast worker died: worker 2 is now the reference
    assert t.steps(2) == 20
    with pytest.raises(ConfigError, match="local steps H must be >= 1"):
        SpeedTracker(0)
    with pytest.raises(ConfigError, match="speed of worker 3"):
        dylu_steps({3: 0.0}, 5)
