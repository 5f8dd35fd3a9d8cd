"""``thinwire.localsgd.algorithm.sweep``: a grid of simulated runs that resumes from its files and
never reads back a run made with other settings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from test_localsgd_api import _task
from thinwire.localsgd import AsyncConfig, SimClock, for_method
from thinwire.localsgd.algorithm.sweep import fingerprint, parse_grid, run_sweep, summarize_sweep


@pytest.mark.timeout(120)
def test_a_sweep_resumes_from_its_files_but_never_from_other_settings(tmp_path: Path) -> None:
    base = AsyncConfig(steps=12, local_steps=3, warmup_steps=2)
    clock = SimClock(seconds_per_step=(1.0, 2.0), eval_points=2)
    grid = parse_grid(["outer-lr=0.1,0.3"], ["sync", "dn-dylu"])
    seen: list[tuple[str, bool]] = []

    def sweep(cfg: AsyncConfig, clk: SimClock, context: dict[str, Any]) -> list[dict[str, Any]]:
        seen.clear()
        runs = run_sweep(
            lambda seed: _task(),
            cfg,
            clk,
            grid,
            (0,),
            tmp_path,
            on_run=lambda run, cached: seen.append((run["key"], cached)),
            context=context,
        )
        return runs

    first = sweep(base, clock, {"data": "a"})
    assert len(first) == 4 and not any(cached for _, cached in seen)
    again = sweep(base, clock, {"data": "a"})
    assert all(cached for _, cached in seen)
    assert [r["final_val_loss"] for r in again] == [r["final_val_loss"] for r in first]
    # Same method, setting and seed (so the same file names), other settings: recomputed.
    for cfg, clk, context in (
        (replace(base, steps=15), clock, {"data": "a"}),
        (base, SimClock(seconds_per_step=(1.0, 4.0), eval_points=2), {"data": "a"}),
        (base, clock, {"data": "b"}),
    ):
        runs = sweep(cfg, clk, context)
        assert not any(cached for _, cached in seen), (cfg, clk, context)
        assert len(runs) == 4
    assert runs[0]["inner_steps"] == 2 * base.steps
    best = summarize_sweep(runs)["best"]
    assert set(best) == {"sync", "dn-dylu"}
    assert all(b["setting"]["outer_lr"] in (0.1, 0.3) for b in best.values())


LATER = (
    "shard_within",
    "fragments",
    "fragment_overlap",
    "fragment_alpha",
    "error_feedback",
    "norm_batches",
)
"""Fields added after runs were cached (left out of a fingerprint at their defaults)."""


def test_a_cached_run_is_keyed_by_the_inner_state_rule_it_resolved_to() -> None:
    """The inner-state default depends on the start: a run from a trained model cached
    under the earlier default (``restart``) is never read back as one of today's, naming
    today's default changes nothing, and runs from scratch keep their fingerprints."""
    clock = SimClock(seconds_per_step=(1.0, 2.0))
    trained = AsyncConfig(steps=10, pretrain_steps=5)
    assert trained.resolved_inner_momentum() == "keep"
    same = fingerprint(replace(trained, inner_momentum="keep"), clock, 0)
    assert fingerprint(trained, clock, 0) == same
    assert fingerprint(replace(trained, inner_momentum="restart"), clock, 0) != same
    scratch = AsyncConfig(steps=10)
    assert scratch.resolved_inner_momentum() == "restart"
    assert fingerprint(scratch, clock, 0) != fingerprint(
        replace(scratch, inner_momentum="keep"), clock, 0
    )
    # what a run from scratch was keyed by before the default followed the start (and
    # before the runtime-only shard_within and Streaming DiLoCo's fields existed)
    old = {k: v for k, v in asdict(scratch).items() if k not in LATER}
    blob = {"config": old, "clock": asdict(clock), "context": {}}
    text = json.dumps(blob, sort_keys=True, default=repr)
    assert fingerprint(scratch, clock, 0) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_dn_dylu_from_a_trained_model_takes_the_long_tier_outer_settings() -> None:
    """From a trained model DN + DyLU defaults to (0.3, 0.9), from scratch to (0.5, 0); a
    run cached under the short-run default is not read back as one of the new default,
    and the methods whose defaults did not change keep their fingerprints."""
    from thinwire.localsgd import for_method

    clock = SimClock(seconds_per_step=(1.0, 2.0))
    trained = for_method(AsyncConfig(steps=10, pretrain_steps=5), "dn-dylu")
    scratch = for_method(AsyncConfig(steps=10), "dn-dylu")
    assert (trained.resolved_outer_lr(), trained.resolved_outer_momentum()) == (0.3, 0.9)
    assert (scratch.resolved_outer_lr(), scratch.resolved_outer_momentum()) == (0.5, 0.0)
    named = replace(trained, outer_lr=0.3, outer_momentum=0.9)
    assert fingerprint(trained, clock, 0) == fingerprint(named, clock, 0)
    short = replace(trained, outer_lr=0.5, outer_momentum=0.0)
    assert fingerprint(trained, clock, 0) != fingerprint(short, clock, 0)
    naive = for_method(AsyncConfig(steps=10, pretrain_steps=5), "naive")
    assert (naive.resolved_outer_lr(), naive.resolved_outer_momentum()) == (0.3, 0.0)
    blob = {
        "config": {
            k: v for k, v in asdict(replace(naive, inner_momentum="keep")).items() if k not in LATER
        },
        "clock": asdict(clock),
        "context": {},
    }
    text = json.dumps(blob, sort_keys=True, default=repr)
    assert fingerprint(naive, clock, 0) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_settings_added_at_their_defaults_keep_the_cached_runs_fingerprints() -> None:
    """Streaming DiLoCo's fields and ``norm_batches`` came after runs were cached: at
    their defaults they leave a run's fingerprint as it was (these digests were computed
    before they existed), so a sweep read back from ``--out/runs`` is not simulated
    again."""
    clock = SimClock(seconds_per_step=(1.0, 2.0))
    sync = for_method(AsyncConfig(steps=10), "sync")
    assert fingerprint(sync, clock, 0) == "59a77b124c03c5dd"
    trained = for_method(AsyncConfig(steps=10, pretrain_steps=5), "dn-dylu")
    assert fingerprint(trained, clock, 1, {"model": "tiny"}) == "61a55db525a11557"
    assert fingerprint(replace(sync, fragments=2), clock, 0) != "59a77b124c03c5dd"
    assert fingerprint(replace(sync, norm_batches=4), clock, 0) != "59a77b124c03c5dd"
