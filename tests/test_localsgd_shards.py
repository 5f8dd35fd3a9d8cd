"""The shard book (least-progress and the paper's Eq. 2 sampling, per-shard clocks) and
the inner lr clock."""

from __future__ import annotations

import pytest

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.shards import ShardBook, inner_lr


def test_least_progress_shard_and_lr_clock() -> None:
    book = ShardBook([100, 100, 200], total_steps=40)
    assert book.planned == [10, 10, 20]
    assert book.take(1, 5) == (0, 0)  # all at 0: lowest index
    assert book.take(2, 5) == (1, 0)
    assert book.take(3, 5) == (2, 0)  # progress 5/20 = 0.25 < 0.5
    book.release(1)
    assert book.take(1, 5) == (0, 5)  # only free shard; the clock continues
    book.release(2)
    book.release(3)
    assert book.take(2, 4) == (2, 5)  # 0.25 is the least progress
    book.release(2, completed=False)  # died: the round is rewound
    assert book.clock[2] == 5


def test_inner_lr_warmup_cosine_floor() -> None:
    assert inner_lr(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert inner_lr(9, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert inner_lr(55, 100, 1.0, 10, 0.1) == pytest.approx(0.55)
    assert inner_lr(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert inner_lr(500, 100, 1.0, 10, 0.1) == pytest.approx(0.1)  # past the plan: floor


def test_paper_sampling_draws_only_shards_behind_their_share() -> None:
    book = ShardBook([30, 10], 400, sampling="paper", seed=1)
    assert book.weights() == pytest.approx([0.75, 0.25])  # nothing spent: by size
    draws = [book.take(w, 5)[0] for w in range(1, 41)]  # non-exclusive: 40 takes
    # Eq. 2 keeps each shard within a round of its share of the steps handed out.
    assert abs(book.clock[0] - 0.75 * sum(book.clock)) <= 5
    assert set(draws) == {0, 1}
    book.clock = [10, 10]
    assert book.weights() == pytest.approx([0.25, 0.0])  # shard 1 is ahead: not drawable
    again = ShardBook([30, 10], 400, sampling="paper", seed=1)
    assert [again.take(w, 5)[0] for w in range(1, 41)] == draws  # seeded
    with pytest.raises(ConfigError, match="unknown shard sampling"):
        ShardBook([1], 10, sampling="random")
