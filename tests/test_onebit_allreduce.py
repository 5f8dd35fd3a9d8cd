"""The two-phase 1-bit allreduce: exactness, error feedback, bad input, state, bytes."""

from __future__ import annotations

import io
import math
import time

import pytest
import torch

from thinwire.comm import COUNTER, spawn
from thinwire.comm.onebit_allreduce import (
    GPU_CHUNK,
    LengthMismatchError,
    NonFiniteError,
    OneBitAllreduce,
    onebit_padded_numel,
    onebit_wire_bytes,
)
from thinwire.comm.piece_tuner import MIN_PIECE_BYTES
from thinwire.compress import ErrorFeedback, OneBitCompressor


def _inputs(n: int, world: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(world)]


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def _rms_blocks(x: torch.Tensor, real: int, block: int | None) -> torch.Tensor:
    """Per element of ``x``: the RMS of its block's real elements (one block: all of
    ``x[:real]``), written out plainly."""
    if block is None:
        s = torch.linalg.vector_norm(x[:real]) / math.sqrt(real) if real else torch.tensor(0.0)
        return s.expand(x.numel())
    out = torch.zeros(x.numel())
    for lo in range(0, real, block):
        hi = min(real, lo + block)
        out[lo : lo + block] = torch.linalg.vector_norm(x[lo:hi]) / math.sqrt(hi - lo)
    return out


def reference(xs: list[torch.Tensor], block: int | None = None) -> torch.Tensor:
    """Straightforward single-process simulation of W ranks with zero error buffers."""
    world, n = len(xs), xs[0].numel()
    padded = onebit_padded_numel(n, world, block)
    seg = padded // world
    full = [torch.cat([x.reshape(-1).float(), torch.zeros(padded - n)]) for x in xs]
    sent = [_rms_blocks(x, n, block) * _sign(x) for x in full]
    out = []
    for r in range(world):
        acc = sent[0][r * seg : (r + 1) * seg]
        for i in range(1, world):
            acc = acc + sent[i][r * seg : (r + 1) * seg]
        y = acc / world
        real = min(seg, max(0, n - r * seg))
        y[real:] = 0
        out.append(_rms_blocks(y, real, block) * _sign(y))
    return torch.cat(out)[:n]


def _reference_body(
    rank: int, world: int, pieces: int | None, phase2: str, block: int | None
) -> list[tuple]:
    results = []
    for n in [1, 7, 8 * world + 3, 1000, 4096]:
        COUNTER.reset()
        xs = _inputs(n, world, seed=n)
        out = OneBitAllreduce(pieces=pieces, phase2=phase2, block=block)(xs[rank])
        snap = COUNTER.snapshot()
        wire = sum(v["wire_bytes"] for k, v in snap.items() if k.startswith("onebit."))
        results.append(("fp32", n, out, reference(xs, block), wire))
    for dtype in (torch.float16, torch.bfloat16):
        xs = [x.to(dtype) for x in _inputs(333, world, seed=1)]
        out = OneBitAllreduce(pieces=pieces, block=block)(xs[rank])
        results.append((str(dtype), 333, out, reference(xs, block).to(dtype), None))
    # Non-contiguous 2-D input: every other column of a wider matrix.
    wide = [x.view(10, 20) for x in _inputs(200, world, seed=2)]
    views = [w[:, ::2] for w in wide]
    assert not views[rank].is_contiguous()
    out = OneBitAllreduce(pieces=pieces, block=block)(views[rank])
    ref = reference([v.contiguous() for v in views], block).view(10, 10)
    results.append(("strided", 100, out, ref, None))
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world", "pieces", "phase2", "block"),
    [
        (2, None, "ring", None),
        (4, None, "ring", None),
        (4, 3, "ring", None),
        (3, 3, "fanout", None),
        (2, None, "ring", 256),
        (3, 3, "ring", 16),
        (4, 3, "fanout", 8),
    ],
)
def test_bit_exact_against_reference_on_every_rank(
    world: int, pieces: int | None, phase2: str, block: int | None
) -> None:
    # pieces=3 splits both phases into 3 collectives (2 where a segment has 2 bytes),
    # with the partial last byte of an odd length falling inside a piece. The fan-out
    # phase 2 carries the same bytes to the same places: the same result and accounting.
    # Blocks of 8 and 16 put many block scales, and partial last blocks, in every piece.
    per_rank = spawn(_reference_body, world, (pieces, phase2, block), timeout_s=170)
    for rank_results in per_rank:
        for kind, n, out, ref, wire in rank_results:
            assert out.dtype == ref.dtype and out.shape == ref.shape, kind
            assert torch.equal(out, ref), f"{kind} n={n}"
            if wire is not None:
                assert wire == onebit_wire_bytes(n, world, block)
    # Identical output on every rank.
    for results in per_rank[1:]:
        for (_, _, a, _, _), (_, _, b, _, _) in zip(per_rank[0], results, strict=True):
            assert torch.equal(a, b)


class CompressorReference:
    """The 1-bit allreduce of W ranks on one process, written with the compressor
    interface only: each rank's input through its own ``ErrorFeedback(OneBitCompressor())``
    (the worker error), then, per segment, the rank-order mean of what the W ranks sent
    through that segment's own ``ErrorFeedback(OneBitCompressor())`` (the server error).
    It is what the collective computes, with none of its buffers, pieces or exchange."""

    def __init__(self, world: int, n: int, block: int | None = None) -> None:
        self.world, self.n = world, n
        self.seg = onebit_padded_numel(n, world, block) // world
        self.workers = [ErrorFeedback(OneBitCompressor(block)) for _ in range(world)]
        self.servers = [ErrorFeedback(OneBitCompressor(block)) for _ in range(world)]

    def segment(self, rank: int) -> slice:
        """The real elements of ``rank``'s segment (empty where it is all padding)."""
        lo = min(self.n, rank * self.seg)
        return slice(lo, min(self.n, lo + self.seg))

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        sent = [
            ef.decompress(ef.compress(x.reshape(-1)))
            for ef, x in zip(self.workers, xs, strict=True)
        ]
        out = torch.zeros(self.n)
        for r, server in enumerate(self.servers):
            part = self.segment(r)
            if part.start == part.stop:
                continue
            mean = sent[0][part].clone()
            for i in range(1, self.world):
                mean.add_(sent[i][part])
            out[part] = server.decompress(server.compress(mean.div_(self.world)))
        return out


def _steps_body(rank: int, world: int, n: int, steps: int, block: int | None) -> list[tuple]:
    # a fixed plan: from the second call on, phase 1 leaves before the metadata is in
    allreduce = OneBitAllreduce(pieces=2, block=block, phase2="fanout" if world == 3 else "ring")
    results = []
    for step in range(steps):
        out = allreduce(_inputs(n, world, seed=100 * n + step)[rank])
        state = allreduce.state_dict()
        results.append((out, state["worker_error"], state["server_error"]))
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world", "n", "block"),
    [(2, 1000, None), (3, 8 * 3 * 5 + 3, None), (4, 7, None), (2, 1000, 64), (3, 5003, 256)],
)
def test_collective_is_the_compressor_reference_step_after_step(
    world: int, n: int, block: int | None
) -> None:
    """Same signs, same scales, same residuals on every rank for several calls: the
    distributed collective is ErrorFeedback(OneBitCompressor(block)) applied per rank and
    per segment. (4, 7): three of the four segments are all padding."""
    steps = 6
    per_rank = spawn(_steps_body, world, (n, steps, block), timeout_s=170)
    ref = CompressorReference(world, n, block)
    for step in range(steps):
        expected = ref(_inputs(n, world, seed=100 * n + step))
        for rank, results in enumerate(per_rank):
            out, worker_error, server_error = results[step]
            assert torch.equal(out, expected), (step, rank)
            assert torch.equal(worker_error, ref.workers[rank].residual), (step, rank)
            server = ref.servers[rank].residual
            if server is None:  # an all-padding segment has no error to keep
                assert server_error.numel() == 0
            else:
                assert torch.equal(server_error, server), (step, rank)


def _plain_body(rank: int, world: int, n: int, steps: int, block: int | None) -> list[tuple]:
    plain = OneBitAllreduce(pieces=2, block=block, error_feedback=False)
    fed = OneBitAllreduce(pieces=2, block=block)
    results = []
    for step in range(steps):
        x = _inputs(n, world, seed=100 * n + step)[rank]
        out, carried = plain(x), fed(x)
        state = plain.state_dict()
        results.append((out, carried, state["worker_error"], state["server_error"]))
    # A residual saved with the feedback on is not carried by an instance with it off.
    plain.load_state_dict(fed.state_dict())
    x = _inputs(n, world, seed=1)[rank]
    results.append((plain(x), None, None, None))
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world", "n", "block"), [(2, 1000, None), (3, 5003, 256)])
def test_without_error_feedback_every_call_is_the_plain_code(
    world: int, n: int, block: int | None
) -> None:
    """``error_feedback=False``: each call is the two-phase code of its input alone
    (:func:`reference`, zero error buffers), call after call, with both errors left at
    zero; the same calls with the feedback on carry something and differ."""
    steps = 3
    per_rank = spawn(_plain_body, world, (n, steps, block), timeout_s=170)
    for rank, results in enumerate(per_rank):
        for step in range(steps):
            out, carried, worker_error, server_error = results[step]
            assert torch.equal(out, reference(_inputs(n, world, seed=100 * n + step), block))
            assert not worker_error.any() and not server_error.any(), (step, rank)
            assert step == 0 or not torch.equal(out, carried), (step, rank)
        assert torch.equal(results[steps][0], reference(_inputs(n, world, seed=1), block))


def _converge_body(rank: int, world: int) -> tuple[float, float, bool]:
    xs = _inputs(512, world, seed=7)
    truth = torch.stack(xs).mean(0)
    allreduce = OneBitAllreduce()
    total = torch.zeros(512)
    steps = 400
    first_error = None
    for step in range(steps):
        out = allreduce(xs[rank])
        if step == 0:
            first_error = (out - truth).abs().max().item()
        total += out
    avg_error = (total / steps - truth).abs().max().item()
    # In-place form on a copy gives the same result as the returned form; a side number
    # travels exactly beside the bits and comes back averaged over the ranks.
    again = xs[rank].clone()
    ref = OneBitAllreduce()(xs[rank])
    side = OneBitAllreduce()
    side(again, out=again, side=torch.tensor(0.1 + 3.0 * rank, dtype=torch.float64))
    return first_error, avg_error, torch.equal(again, ref), side.side_mean


@pytest.mark.timeout(180)
def test_running_average_converges_to_true_mean() -> None:
    for first_error, avg_error, inplace_ok, side in spawn(_converge_body, 2, timeout_s=170):
        assert first_error > 0.3  # one call alone is a coarse approximation
        assert avg_error < 0.05 * first_error  # error feedback removes the bias over time
        assert inplace_ok
        assert side == pytest.approx(1.6, abs=1e-12)  # (0.1 + 3.1) / 2, fp64 on the wire


def _nan_on_rank_1(allreduce: OneBitAllreduce, x: torch.Tensor, rank: int) -> tuple[str, bool]:
    """Call with a NaN in rank 1's input: the error this rank got, and whether both its
    error buffers were left as they were."""
    before = allreduce.state_dict()
    poisoned = x.clone()
    if rank == 1:
        poisoned[5] = float("nan")
    message = ""
    try:
        allreduce(poisoned)
    except NonFiniteError as exc:
        message = str(exc)
    after = allreduce.state_dict()
    kept = all(torch.equal(before[k], after[k]) for k in ("worker_error", "server_error"))
    return message, kept


def _bad_input_body(rank: int, world: int) -> dict:
    report: dict = {}
    xs = _inputs(50, world, seed=3)
    allreduce, twin = OneBitAllreduce(), OneBitAllreduce()
    allreduce(xs[rank])
    twin(xs[rank])
    report["nan"], report["state_kept"] = _nan_on_rank_1(allreduce, xs[rank], rank)
    report["continues"] = torch.equal(allreduce(xs[rank]), twin(xs[rank]))
    inf = xs[rank].clone()
    inf[0] = float("inf") if rank == 0 else 1.0
    try:
        allreduce(inf)
    except NonFiniteError as exc:
        report["inf"] = str(exc)
    # Different lengths on different ranks: an error naming them, not a hang.
    try:
        OneBitAllreduce()(torch.ones(10 + 2 * rank))
    except LengthMismatchError as exc:
        report["mismatch"] = str(exc)
    # The same instance called with another length on every rank.
    try:
        allreduce(torch.ones(51))
    except ValueError as exc:
        report["relength"] = str(exc)
    # A server scale that overflows (rank 1's server error is huge) is caught after
    # phase 2's first piece; the later pieces are drained, so the next call is in step.
    # (Blocks of 8, so that rank 1's segment of this short buffer holds real elements.)
    split = OneBitAllreduce(pieces=3, block=8)
    split(xs[rank])
    state = split.state_dict()
    if rank == 1:
        state["server_error"].fill_(3e38)
    split.load_state_dict(state)
    try:
        split(xs[rank])
    except NonFiniteError as exc:
        report["server"] = str(exc)
    report["server_state_kept"] = torch.equal(
        split.state_dict()["worker_error"], state["worker_error"]
    )
    report["in_step"] = torch.equal(
        OneBitAllreduce(pieces=3, block=8)(xs[rank]), reference(xs, block=8)
    )
    # Ranks set up with different piece counts: an error naming each rank's plan.
    try:
        OneBitAllreduce(pieces=2 if rank == 0 else None)(xs[rank])
    except ValueError as exc:
        report["plans"] = str(exc)
    # A tuner reset on one rank only: its call count no longer matches.
    tuned = OneBitAllreduce()
    tuned(xs[rank])
    if rank == 1:
        tuned.load_state_dict(tuned.state_dict())
    try:
        tuned(xs[rank])
    except ValueError as exc:
        report["tuner_calls"] = str(exc)
    # Ranks set up with different blocks: their messages would differ in size.
    try:
        OneBitAllreduce(block=None if rank == 0 else 64)(xs[rank])
    except ValueError as exc:
        report["blocks"] = str(exc)
    # A NaN in one block of many is seen before any bit is sent.
    poisoned = xs[rank].clone()
    if rank == 0:
        poisoned[-1] = float("nan")
    try:
        OneBitAllreduce(block=8)(poisoned)
    except NonFiniteError as exc:
        report["block_nan"] = str(exc)
    return report


@pytest.mark.timeout(120)
def test_nan_inf_and_length_errors_are_reported_on_every_rank() -> None:
    for report in spawn(_bad_input_body, 2, timeout_s=100):
        assert "non-finite input (NaN/Inf) on rank(s) [1]" in report["nan"]
        assert report["state_kept"] and report["continues"]
        assert "rank(s) [0]" in report["inf"]
        assert report["mismatch"] == (
            "1-bit allreduce: ranks disagree on the length: rank 0 has 10, rank 1 has 12"
        )
        assert "holds error buffers for 50 elements but got 51" in report["relength"]
        assert "server scale of rank(s) [1] overflowed" in report["server"]
        assert report["server_state_kept"] and report["in_step"]
        assert (
            "ranks disagree on the piece count: rank 0 uses 2 pieces, rank 1 tunes them "
            in (report["plans"])
        )
        assert "rank 0 tunes them (call 1), rank 1 tunes them (call 0)" in report["tuner_calls"]
        assert (
            "ranks disagree on the elements per scale: rank 0 one scale, rank 1 block=64"
            in report["blocks"]
        )
        assert "non-finite input (NaN/Inf) on rank(s) [0]" in report["block_nan"]


def _logged(allreduce: OneBitAllreduce, log: list[str]) -> None:
    """Log when the metadata leaves and lands and when phase 1 leaves."""
    ex = allreduce._exchange
    start_meta, start_all_to_all = ex.start_meta, ex.start_all_to_all

    def meta(m: torch.Tensor) -> object:
        wait = start_meta(m)
        log.append("meta out")

        def landed() -> torch.Tensor:
            out = wait()
            log.append("meta in")
            return out

        return landed

    def bits(recvs: list, sends: list) -> object:
        log.append("bits out")
        return start_all_to_all(recvs, sends)

    ex.start_meta, ex.start_all_to_all = meta, bits  # type: ignore[method-assign]


def _slow_ring(allreduce: OneBitAllreduce) -> None:
    """Make phase 2's ring 50 ms slower than the fan-out, so the tuner keeps the fan-out."""
    ex = allreduce._exchange
    start_all_gather = ex.start_all_gather

    def gather(outs: list, msgs: list) -> list:
        if ex.phase2 == "ring":
            time.sleep(0.05)
        return start_all_gather(outs, msgs)

    ex.start_all_gather = gather  # type: ignore[method-assign]


def _early_body(rank: int, world: int) -> dict:
    report: dict = {}
    xs = _inputs(50, world, seed=3)
    # a fixed plan: no trials of counts or schemes
    allreduce = OneBitAllreduce(pieces=2, phase2="ring")
    twin = OneBitAllreduce(pieces=2, phase2="ring")
    log: list[str] = []
    _logged(allreduce, log)
    allreduce(xs[rank])
    twin(xs[rank])
    report["first"], log[:] = list(log), []
    allreduce(xs[rank])
    twin(xs[rank])
    report["second"], log[:] = list(log), []
    # A NaN in a call whose bits left early: raised on every rank, nothing changed.
    report["nan"], report["nan_kept"] = _nan_on_rank_1(allreduce, xs[rank], rank)
    # Another length on one rank: its bits leave in the agreed layout, every rank raises.
    try:
        allreduce(xs[rank] if rank == 0 else torch.ones(51))
    except LengthMismatchError as exc:
        report["length"] = str(exc)
    report["in_step"] = torch.equal(allreduce(xs[rank]), twin(xs[rank]))
    # One rank drops its buffers (a fixed plan): it waits for the metadata, the other
    # does not, and the call still meets in the same collectives.
    if rank == 1:
        allreduce.reset()
        twin.reset()
    log[:] = []
    report["one_reset"] = torch.equal(allreduce(xs[rank]), twin(xs[rank]))
    report["one_reset_log"] = list(log)
    # The same with a tuned plan whose phase 2 became the fan-out (the ring made slow
    # here): the plans differ, both raise, and nothing is left in flight. The metadata
    # always fans out, so the rank that restarted on the ring still meets it.
    tuned = OneBitAllreduce(phase2="auto")
    _slow_ring(tuned)
    for _ in range(40):
        if tuned.tuned:
            break
        tuned(xs[rank])
    report["tuned_scheme"] = tuned.phase2_in_use
    tuned(xs[rank])  # a call with the final plan: the next one sends early
    if rank == 1:
        tuned.reset()
    _logged(tuned, log)
    log[:] = []
    try:
        tuned(xs[rank])
    except ValueError as exc:
        report["tuner"] = str(exc)
    report["tuner_log"] = list(log)
    fresh = OneBitAllreduce(pieces=2, phase2="ring", block=8)
    report["group_in_step"] = torch.equal(fresh(xs[rank]), reference(xs, block=8))
    return report


@pytest.mark.timeout(120)
def test_a_call_after_an_agreed_one_sends_its_bits_before_the_metadata_is_in() -> None:
    for rank, report in enumerate(spawn(_early_body, 2, timeout_s=100)):
        # the first call waits for the lengths to be agreed; later ones do not
        assert report["first"] == ["meta out", "meta in", "bits out"]
        assert report["second"] == ["meta out", "bits out", "meta in"]
        assert "non-finite input (NaN/Inf) on rank(s) [1]" in report["nan"]
        assert report["nan_kept"]
        assert report["length"] == (
            "1-bit allreduce: ranks disagree on the length: rank 0 has 50, rank 1 has 51"
        )
        assert report["in_step"]
        assert report["one_reset"]
        expected = ["meta out", "meta in", "bits out"] if rank == 1 else report["second"]
        assert report["one_reset_log"] == expected
        assert report["tuned_scheme"] == "fanout"
        assert "ranks disagree on the piece count" in report["tuner"]
        # rank 0's bits had left; rank 1 sent zeros in their layout before raising
        tuner_log = ["meta out", "bits out", "meta in"] if rank == 0 else report["first"]
        assert report["tuner_log"] == tuner_log
        assert report["group_in_step"]


def _tuning_early_body(rank: int, world: int) -> tuple[list[tuple], bool, str]:
    gen = torch.Generator().manual_seed(rank)
    n = 8 * world * 4 * MIN_PIECE_BYTES  # 4 x 16 KiB of bits per segment: 1, 2, 4 tried
    tuned = OneBitAllreduce()  # count and scheme tuned, the overlap on
    whole = OneBitAllreduce(pieces=1, phase2="ring", overlap_meta=False)
    log: list[str] = []
    _logged(tuned, log)
    calls, same = [], True
    for _ in range(24):
        log[:] = []
        x = torch.randn(n, generator=gen)
        same &= torch.equal(tuned(x), whole(x))
        early = log.index("bits out") < log.index("meta in")
        tuner = tuned._tuner
        assert tuner is not None
        calls.append((early, tuner.current, tuner.current_scheme, tuned.tuned))
    # One rank drops its buffers amid the trials: its plan restarts, the other's bits of
    # a trial had left; both raise, nothing is left in flight, and a reset on both
    # starts them afresh together.
    x = torch.randn(n, generator=gen)
    mid = OneBitAllreduce()
    for _ in range(5):
        mid(x)
    if rank == 1:
        mid.reset()
    try:
        mid(x)
        error = ""
    except ValueError as exc:
        error = str(exc)
    mid.reset()
    same &= torch.equal(mid(x), OneBitAllreduce()(x))
    return calls, same, error


@pytest.mark.timeout(180)
def test_the_piece_count_is_tuned_with_the_bits_sent_ahead_of_the_metadata() -> None:
    (calls, same, error), (calls1, same1, error1) = spawn(_tuning_early_body, 2, timeout_s=170)
    assert same and same1  # bit-identical to one serial piece throughout
    assert "ranks disagree on the piece count" in error and error == error1
    assert calls == calls1  # both ranks planned every call alike
    waited = [i for i, (early, *_) in enumerate(calls) if not early]
    # The first call, the count's choice and the scheme's wait (one more if giving up
    # was judged ahead and undone): every trial runs as the tuned calls will.
    assert waited[0] == 0 and 3 <= len(waited) <= 4
    trials = {(k, s) for early, k, s, done in calls if early and not done}
    assert {(1, "ring"), (2, "ring")} <= trials and any(s == "fanout" for _, s in trials)
    # tuned in the call that chose the scheme (which waited), early ever after
    first_tuned = next(i for i, (*_, done) in enumerate(calls) if done)
    assert first_tuned == waited[-1] and all(early for early, *_ in calls[first_tuned + 1 :])


def _checkpoint_body(rank: int, world: int) -> bool:
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(300, generator=gen) for _ in range(10)]
    straight = OneBitAllreduce()
    outs = [straight(x) for x in inputs]
    first = OneBitAllreduce()
    for x in inputs[:5]:
        first(x)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = OneBitAllreduce()
    resumed.load_state_dict(torch.load(saved))
    return all(torch.equal(resumed(x), o) for x, o in zip(inputs[5:], outs[5:], strict=True))


@pytest.mark.timeout(120)
def test_checkpoint_resume_is_bit_identical() -> None:
    assert spawn(_checkpoint_body, 3, timeout_s=100) == [True, True, True]


def test_single_process_is_a_no_op() -> None:
    x = torch.randn(5)
    allreduce = OneBitAllreduce()
    assert allreduce.world_size == 1
    assert allreduce(x) is x
    out = torch.empty(5)
    assert allreduce(x, out=out) is out and torch.equal(out, x)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        allreduce(torch.ones(3, dtype=torch.int64))


def test_block_must_fill_whole_bytes() -> None:
    for bad in (0, 4, 12, True):
        with pytest.raises(ValueError, match="block must be None or a multiple of 8 >= 8"):
            OneBitAllreduce(block=bad)


def test_pieces_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pieces must be at least 1, got 0"):
        OneBitAllreduce(pieces=0)
    with pytest.raises(ValueError, match="phase2 must be ring, fanout or auto, got 'tree'"):
        OneBitAllreduce(phase2="tree")


def test_state_dict_rejects_another_rank_or_world() -> None:
    allreduce = OneBitAllreduce()
    with pytest.raises(ValueError, match="world_size 4, this rank has 1"):
        allreduce.load_state_dict({"numel": 3, "world_size": 4, "rank": 0})


def test_compute_only_matches_reference_for_identical_ranks() -> None:
    # The loopback stand-in does rank 0's full share of the work for W ranks that hold
    # the same input, without a process group: its own segment comes out exact.
    x = torch.randn(1024)
    for pieces, block in ((None, None), (4, None), (None, 256), (4, 64)):
        out = OneBitAllreduce.compute_only(4, pieces=pieces, block=block)(x)
        assert torch.equal(out[:256], reference([x] * 4, block)[:256])


def test_wire_bytes_formula() -> None:
    assert onebit_wire_bytes(1000, 1) == 0
    # 4 ranks, 1024 elements, one scale: 128 bytes of signs, 2 * 3/4 of it, plus 3 * 76
    # bytes of metadata and server scale.
    assert onebit_wire_bytes(1024, 4, block=None) == 192 + 228
    # Blocks of 256: 4 scales (16 bytes) travel beside the signs in both phases.
    assert onebit_wire_bytes(1024, 4, block=256) == 2 * 3 * (128 + 16) // 4 + 3 * 72
    n = 16 * 2**20
    fp32_ring = 2 * 3 * 4 * n // 4
    assert fp32_ring / onebit_wire_bytes(n, 4, block=None) == pytest.approx(32, rel=1e-3)
    assert fp32_ring / onebit_wire_bytes(n, 4) == pytest.approx(32 / (1 + 32 / 256), rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compute_matches_cpu() -> None:
    x = torch.randn(4099)
    cpu = OneBitAllreduce.compute_only(4)
    gpu = OneBitAllreduce.compute_only(4)
    for _ in range(3):  # error feedback state carried on the device too
        a = cpu(x)
        b = gpu(x.cuda())
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a)
    assert gpu.tuned and gpu.pieces_in_use == 1  # no tuning on CUDA unless asked


def test_the_default_chunk_follows_the_buffers_device() -> None:
    from thinwire.compress.onebit import DEFAULT_CHUNK

    cpu = OneBitAllreduce.compute_only(4, pieces=1)
    cpu(torch.randn(5_000))
    assert cpu.chunk == DEFAULT_CHUNK
    gpu_like = OneBitAllreduce.compute_only(4, pieces=1)
    gpu_like._allocate(5_000, torch.device("meta"))  # any device but the CPU
    assert gpu_like.chunk == GPU_CHUNK
    given = OneBitAllreduce.compute_only(4, chunk=1_003, pieces=1)
    given._allocate(5_000, torch.device("meta"))
    assert given.chunk == 1_000  # whole bytes of bits, as asked, on any device
    # A state allocated on the CPU (a checkpoint is loaded there), then used on a GPU:
    # the buffers move, and the chunk becomes the GPU's.
    moved = OneBitAllreduce.compute_only(4, pieces=1)
    moved._allocate(1 << 22, torch.device("cpu"))  # 4 ranks: segments of 1M elements
    assert moved.chunk == DEFAULT_CHUNK and moved._bufs["tmp"].numel() == DEFAULT_CHUNK
    moved._ready_for(1 << 22, torch.device("meta"))
    assert moved.chunk == GPU_CHUNK and moved._bufs["tmp"].numel() == 1 << 20
    assert moved._bufs["tmp"].device.type == "meta"
