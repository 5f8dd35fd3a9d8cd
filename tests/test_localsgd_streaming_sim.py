"""Streaming DiLoCo on the simulator's clock: one fragment is the sync method bit for bit,
fragments cut the bytes per sync, quantizers with and without error feedback, the overlap
on a jittered clock, the sweep and the CLI, and the refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from thinwire.cli.main import main
from thinwire.comm import quantized_wire_bytes
from thinwire.errors import ConfigError
from thinwire.localsgd import AsyncConfig, SimClock, for_method, simulate
from thinwire.localsgd.algorithm.compression import PushEncoder
from thinwire.localsgd.algorithm.streaming_sim import simulate_streaming
from thinwire.train.async_task import gpt_task
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData

SPEEDS = (0.5, 1.0, 2.0)


@pytest.fixture(scope="module")
def data() -> TextData:
    return TextData(None, 16, 0.05, 0)


def _task(data: TextData) -> Any:
    model = TrainConfig(
        n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=4, eval_sequences=8, seed=0
    )
    return gpt_task(model, data)


def _cfg(**kw: Any) -> AsyncConfig:
    return for_method(
        AsyncConfig(**({"local_steps": 4, "steps": 8, "warmup_steps": 2} | kw)), "sync"
    )


def _clock(**kw: Any) -> SimClock:
    return SimClock(**({"seconds_per_step": SPEEDS, "eval_points": 2} | kw))


@pytest.mark.timeout(120)
def test_one_fragment_is_the_sync_method_bit_for_bit(data: TextData) -> None:
    """Streaming DiLoCo with one whole fragment is DiLoCo: the simulator's sync method
    (the server's Delayed Nesterov with N = W) and the library's StreamingDiLoCo in
    lockstep agree on every evaluation, in loss and in time. ``fresh`` keeps the inner
    state out of it (the server hands shards to whichever worker asks)."""
    cfg = _cfg(inner_momentum="fresh")
    sync = simulate(_task(data), cfg, _clock())
    own, curve, now = simulate_streaming(_task(data), cfg, _clock(), None)
    assert [p["val_loss"] for p in curve] == [p["val_loss"] for p in sync["curve"]]
    assert [p["time_s"] for p in curve] == [p["time_s"] for p in sync["curve"]]
    assert now == sync["sim_time_s"] == 2 * 4 * 2.0  # two rounds of the slowest worker
    assert own["updates"] == 2  # the last round's sync is the end: finish() adds none
    assert own["inner_steps"] == sync["inner_steps"] == 24


@pytest.mark.timeout(180)
def test_fragments_and_quantizers_cut_the_bytes_and_error_feedback_carries_over(
    data: TextData,
) -> None:
    whole = simulate(_task(data), _cfg(fragments=1, compress="none"), _clock())
    two = simulate(_task(data), _cfg(fragments=2), _clock())
    int4 = simulate(_task(data), _cfg(fragments=2, compress="int4"), _clock())
    plain = simulate(
        _task(data), _cfg(fragments=2, compress="int4", error_feedback=False), _clock()
    )
    assert "streaming" not in whole and two["streaming"]["fragments"] == 2
    assert two["config"]["inner_momentum"] == "keep"  # per fragment; restart has no form
    # Two fragments: each sync about half the model; the same total but the last one-off
    # sync of the first fragment at the end (finish()).
    n, w = two["parameters"], len(SPEEDS)
    fp32_all = 2 * (w - 1) * 4 * n // w
    assert two["peak_sync_bytes"] == pytest.approx(fp32_all / 2, rel=0.2)
    assert two["updates"] == 5  # 2 rounds x 2 fragments, then finish() syncs fragment 0
    assert int4["peak_sync_bytes"] < two["peak_sync_bytes"] / 7
    assert int4["push_bytes"] == plain["push_bytes"] < two["push_bytes"] / 7
    assert int4["peak_sync_bytes"] <= quantized_wire_bytes(n, w, "int4")
    assert int4["streaming"]["error_feedback"] and not plain["streaming"]["error_feedback"]
    # Error feedback changes what is sent; both train (below the start, near fp32).
    assert int4["final_val_loss"] != plain["final_val_loss"]
    for run in (int4, plain):
        assert run["final_val_loss"] < run["curve"][0]["val_loss"]
        assert run["final_val_loss"] == pytest.approx(two["final_val_loss"], rel=0.02)
    assert all(r["sim_time_s"] == whole["sim_time_s"] for r in (two, int4, plain))
    # Every sync counted, and only those: one whole int4 fragment, 2 rounds, no extra
    # sync at the end (the last round's is the end).
    one = simulate(_task(data), _cfg(compress="int4"), _clock())
    assert one["updates"] == 2
    assert one["push_bytes"] == 2 * w * quantized_wire_bytes(n, w, "int4")


@pytest.mark.timeout(180)
def test_one_bit_fragments_need_their_error_feedback(data: TextData) -> None:
    """``onebit`` sends each fragment's signs and an RMS per 256 elements: 28x fewer bytes
    than fp32. Without its error feedback (the same fragments, the same exchange) the run
    is the worse one: the signs alone drop every magnitude inside a block."""
    steps = {"steps": 16, "local_steps": 4, "fragments": 2}
    fp32 = simulate(_task(data), _cfg(**steps), _clock())
    ef = simulate(_task(data), _cfg(compress="onebit", **steps), _clock())
    plain = simulate(_task(data), _cfg(compress="onebit", error_feedback=False, **steps), _clock())
    assert ef["streaming"]["error_feedback"] and not plain["streaming"]["error_feedback"]
    assert ef["push_bytes"] == plain["push_bytes"]
    n, w = fp32["parameters"], len(SPEEDS)
    assert ef["peak_sync_bytes"] <= quantized_wire_bytes(n, w, "onebit") < fp32["peak_sync_bytes"]
    assert quantized_wire_bytes(1 << 20, w, "onebit") * 28 < 2 * (w - 1) * 4 * (1 << 20) // w
    assert ef["final_val_loss"] < plain["final_val_loss"]
    assert ef["final_val_loss"] == pytest.approx(fp32["final_val_loss"], rel=0.03)


@pytest.mark.timeout(180)
def test_whole_one_bit_pushes_turn_their_feedback_off(data: TextData) -> None:
    """With one fragment onebit stays the sync method's own 1-bit pushes, and turning the
    feedback off turns off theirs: the same bytes, another run."""
    whole = simulate(_task(data), _cfg(compress="onebit"), _clock())
    whole_plain = simulate(_task(data), _cfg(compress="onebit", error_feedback=False), _clock())
    assert "streaming" not in whole and "streaming" not in whole_plain
    assert whole_plain["push_bytes"] == whole["push_bytes"]
    assert whole_plain["final_val_loss"] != whole["final_val_loss"]
    # the asynchronous methods' pushes keep theirs: refused there
    with pytest.raises(ConfigError, match=r"sync method's .*, not naive's"):
        for_method(AsyncConfig(compress="onebit", error_feedback=False), "naive").validate(
            3, simulated=True
        )


def test_a_push_without_error_feedback_keeps_no_residual() -> None:
    """The 1-bit push codec with the feedback off sends the same payload for the same
    input every time (nothing carried); with it on, the second push carries the first's
    residual."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    plain, fed = PushEncoder("onebit", error_feedback=False), PushEncoder("onebit")
    assert plain.feedback is None
    first = plain.encode(x)
    assert torch.equal(first, fed.encode(x)) and torch.equal(plain.encode(x), first)
    assert not torch.equal(fed.encode(x), first)


@pytest.mark.timeout(180)
def test_rounds_that_do_not_divide_the_budget_and_alpha_alone(data: TextData) -> None:
    """10 steps at H = 4 with 2 fragments and an overlap: the fragments sync at steps 2,
    4, 6, 8, 10 and land a step later (the last one by the flush at the end), then the
    fragment that trained since its last sync syncs once more."""
    run = simulate(
        _task(data), _cfg(steps=10, fragments=2, fragment_overlap=1, compress="int8"), _clock()
    )
    assert run["updates"] == 6 and run["inner_steps"] == 30
    assert run["curve"][-1]["steps"] == 30 and run["final_val_loss"] < run["curve"][0]["val_loss"]
    # A mixing alpha alone is Streaming DiLoCo too (the mixing changes the run).
    mixed = simulate(_task(data), _cfg(fragment_alpha=0.5), _clock())
    assert mixed["streaming"]["alpha"] == 0.5
    plain = simulate(_task(data), _cfg(fragment_alpha=0.5, fragments=1), _clock())
    assert plain["final_val_loss"] == mixed["final_val_loss"]


@pytest.mark.timeout(180)
def test_the_overlap_waits_only_where_the_average_lands(data: TextData) -> None:
    """On a jittered clock of equal speeds the slowest worker changes from round to
    round: with an overlap a worker waits for an exchange only where its average is
    applied, so the run ends sooner than one that waits at every send."""
    clock = _clock(seconds_per_step=(1.0, 1.0, 1.0), jitter=0.5, seed=3)
    cfg = _cfg(local_steps=4, steps=12, fragments=2)
    waits = simulate(_task(data), cfg, clock)
    overlaps = simulate(_task(data), replace(cfg, fragment_overlap=1, fragment_alpha=0.5), clock)
    assert overlaps["sim_time_s"] < waits["sim_time_s"]
    assert overlaps["final_val_loss"] != waits["final_val_loss"]
    assert overlaps["streaming"]["overlap"] == 1 and overlaps["streaming"]["alpha"] == 0.5


def test_refusals_are_one_line(data: TextData) -> None:
    with pytest.raises(ConfigError, match=r"Streaming DiLoCo is synchronous.*not dn-dylu"):
        simulate(_task(data), for_method(_cfg(fragments=2), "dn-dylu"), _clock())
    with pytest.raises(ConfigError, match="train it with --algo diloco"):
        AsyncConfig(fragments=2).validate(3)  # the asynchronous runtime
    with pytest.raises(ConfigError, match="train it with --algo diloco"):
        AsyncConfig(fragment_alpha=0.5).validate(3)
    with pytest.raises(ConfigError, match="quantizers are diloco's"):
        AsyncConfig(compress="int4").validate(3)
    with pytest.raises(ConfigError, match="fragments must be an integer >= 1, got 0"):
        simulate(_task(data), _cfg(fragments=0), _clock())
    with pytest.raises(ConfigError, match="inner-state rule per fragment"):
        simulate(_task(data), _cfg(fragments=2, inner_momentum="restart"), _clock())
    with pytest.raises(ConfigError, match="overlap must be an integer in"):
        simulate(_task(data), _cfg(fragments=2, fragment_overlap=2), _clock())
    with pytest.raises(ConfigError, match="shards must equal the 3 workers"):
        _cfg(fragments=2, shards=6).validate(3, simulated=True)  # before any run
    with pytest.raises(ConfigError, match="no pulls"):
        _cfg(fragments=2, compress_pull="bf16").validate(3, simulated=True)
    with pytest.raises(ConfigError, match="no outer-momentum warmup"):
        _cfg(fragments=2, outer_momentum_warmup=5).validate(3, simulated=True)
    with pytest.raises(ConfigError, match="no shard sampling"):
        _cfg(fragments=2, shard_sampling="paper").validate(3, simulated=True)
    with pytest.raises(ConfigError, match="error feedback is the quantizers'"):
        _cfg(error_feedback=False).validate(3, simulated=True)
    with pytest.raises(ConfigError, match="train it with --algo diloco"):
        AsyncConfig(error_feedback=False).validate(3)


def test_the_trainer_turns_one_bit_error_feedback_off_whole_or_in_fragments() -> None:
    """``--algo diloco --compress onebit --no-error-feedback``: DiLoCo's own 1-bit
    allreduce with its feedback off (still DiLoCo, with DiLoCo's inner-state rule); with
    fragments, Streaming DiLoCo's exchange with its own off; a one-line refusal where
    there is no rounding to carry."""
    from thinwire.cli.train import diloco_words
    from thinwire.train.algorithms import check_config, make_strategy
    from thinwire.train.compare import parse_run_spec

    whole = TrainConfig(algo="diloco", compress="onebit", error_feedback=False)
    assert not whole.streaming()
    check_config(whole, 2)
    assert whole.resolved_inner_momentum() == "restart"  # DiLoCo's from scratch, not keep
    strategy = make_strategy(torch.nn.Linear(4, 2), whole)
    diloco = strategy.state_dict.__self__  # DiLoCo's exchange, not the fragments'
    assert diloco._onebit is not None and diloco._onebit.error_feedback is False
    # thinwire compare checks a run spec the same way before any run starts
    algo, spec = parse_run_spec("diloco@compress=onebit,error_feedback=false")
    check_config(TrainConfig(algo=algo, **spec), 2)
    plain = TrainConfig(algo="diloco", compress="onebit", fragments=2, error_feedback=False)
    assert plain.streaming()
    check_config(plain, 2)
    # the run's summary says which DiLoCo ran
    assert diloco_words(whole) == "onebit, no error feedback"
    assert diloco_words(plain) == "Streaming DiLoCo: 2 fragments, onebit, no error feedback"
    assert diloco_words(TrainConfig(algo="diloco", compress="onebit")) is None
    with pytest.raises(ConfigError, match=r"error feedback is the quantizers'.*'bf16'"):
        check_config(TrainConfig(algo="diloco", compress="bf16", error_feedback=False), 2)


@pytest.mark.timeout(300)
def test_cli_sweeps_fragments_for_sync_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim"
    common = ["simulate", "--steps", "8", "--local-steps", "4", "--eval-points", "2"]
    common += ["--seconds-per-step", "1,2", "--batch-size", "4", "--out", str(out)]
    rc = main([*common, "--methods", "sync,dn-dylu", "--sweep", "sync:fragments=1,2"])
    assert rc == 0
    # From scratch the rule left unset would differ (restart against Streaming DiLoCo's
    # keep): every sync run takes keep, and says so; dn-dylu keeps its restart.
    assert "all take the inner-state rule keep" in capsys.readouterr().out
    runs = {r["key"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    streamed = runs["sync__fragments=2_inner-momentum=keep__seed0"]
    assert streamed["streaming"]["fragments"] == 2
    whole = runs["sync__fragments=1_inner-momentum=keep__seed0"]
    assert "streaming" not in whole and whole["config"]["inner_momentum"] == "keep"
    assert runs["dn-dylu__default__seed0"]["config"]["inner_momentum"] == "restart"
    assert "inner-state rule restart (sync: keep" in (out / "table.md").read_text()
    # Flags for every method: the asynchronous ones are refused in one line.
    assert main([*common, "--methods", "sync,naive", "--fragments", "2"]) == 2
    assert "not naive" in capsys.readouterr().err
    rc = main([*common, "--methods", "sync", "--compress", "int4", "--no-error-feedback"])
    assert rc == 0
    run = json.loads((out / "runs" / "sync__default__seed0.json").read_text())
    assert run["streaming"] == {
        "fragments": 1,
        "overlap": 0,
        "alpha": 0.0,
        "compress": "int4",
        "error_feedback": False,
    }
