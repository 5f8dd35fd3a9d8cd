"""The quantized allreduce on 3 ranks: bit-identical to a one-process reference built from
the codec and to the simulator's exchange, the same output everywhere, its bytes, resume,
and the errors every rank raises together."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from thinwire.comm import COUNTER, QuantizedAllreduce, quantized_wire_bytes
from thinwire.comm.launch import spawn
from thinwire.comm.momentum_exchange import make_exchange
from thinwire.comm.onebit_exchange import LengthMismatchError, NonFiniteError
from thinwire.compress.quantize import block_codec
from thinwire.localsgd.algorithm.streaming_sim import SimulatedExchange

KINDS = ("int8", "fp8", "int4", "onebit")
BITS = {"int8": 8, "fp8": 8, "int4": 4, "onebit": 1}
N, W, BLOCK = 1000, 3, 64  # 1000 is not a multiple of W * BLOCK: the last segment pads


def _input(rank: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * call + rank)
    return torch.randn(N, generator=g) * (1 + rank)


def _rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        COUNTER.reset()
        ar = QuantizedAllreduce(kind, block=BLOCK)
        results = [ar(_input(rank, c)) for c in range(3)]
        saved = ar.state_dict()
        twin = QuantizedAllreduce(kind, block=BLOCK)
        twin.load_state_dict(saved)
        out[kind] = {
            "results": results,
            "errors": (saved["worker_error"], saved["server_error"]),
            "bytes": COUNTER.wire_bytes,
            "resumed": (ar(_input(rank, 3)), twin(_input(rank, 3))),
        }
    plain = QuantizedAllreduce("int4", block=BLOCK, error_feedback=False)
    plain(_input(rank, 0))
    out["plain_errors"] = plain.state_dict()
    out["before_nan"] = ar.state_dict()["worker_error"]
    out["nan"] = _raises(lambda: ar(_input(rank, 4) * (float("nan") if rank == 1 else 1.0)))
    out["after_nan"] = ar.state_dict()["worker_error"]
    out["length"] = _raises(lambda: QuantizedAllreduce("int8")(torch.ones(N + rank)))
    # A number of the caller's rides in the call's check: summed, no collective of its own.
    COUNTER.reset()
    exchange = make_exchange("int8", None, None)
    flat = _input(rank, 0)
    exchange(flat, out=flat, side=torch.tensor(0.25 + rank, dtype=torch.float64))
    out["side"] = (exchange.side_mean, exchange._reduce.side_sum, sorted(COUNTER.ops))
    return out


def _raises(fn: Any) -> str:
    try:
        fn()
    except (NonFiniteError, LengthMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _reference(kind: str, calls: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The collective's arithmetic on one process: every rank's worker error over its
    whole input, the server error per segment, sums in rank order; the padding sums and
    keeps nothing (the sign code would send its zeros as +scale)."""
    codec = block_codec(kind, block=BLOCK)
    seg = -(-N // (BLOCK * W)) * BLOCK
    worker = [torch.zeros(seg * W) for _ in range(W)]
    server = torch.zeros(seg * W)
    outputs = []
    for c in range(calls):
        total = torch.zeros(seg * W)
        for r in range(W):
            target = torch.nn.functional.pad(_input(r, c), (0, seg * W - N)) + worker[r]
            sent = codec.decompress(codec.compress(target))
            sent[N:] = 0.0
            worker[r] = target - sent
            total += sent
        y = total / W + server
        mean = codec.decompress(codec.compress(y))
        server = y - mean
        server[N:] = 0.0
        outputs.append(mean[:N])
    return outputs, worker[0]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(_rank, W, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference_bit_for_bit_on_every_rank(kind: str, ranks: list) -> None:
    expected, worker0 = _reference(kind, 3)
    for r in ranks:
        for got, want in zip(r[kind]["results"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(ranks[0][kind]["errors"][0], worker0, rtol=0, atol=0)
    # Close to the exact mean, and closer the more bits.
    exact = sum(_input(r, 0) for r in range(W)) / W
    rel = float((ranks[0][kind]["results"][0] - exact).norm() / exact.norm())
    assert rel < {"int8": 0.01, "fp8": 0.05, "int4": 0.2, "onebit": 0.9}[kind]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_error_feedback_loses_nothing_for_good(kind: str, ranks: list) -> None:
    """What each call rounds away is in the residuals: the outputs summed over the calls
    are the exact means summed, less the mean worker residual and the server's. This
    holds for the sign code too, whose single call is far from the mean."""
    exact = sum(sum(_input(r, c) for r in range(W)) / W for c in range(3))
    sent = sum(ranks[0][kind]["results"])
    worker = sum(r[kind]["errors"][0][:N] for r in ranks) / W
    server = torch.cat([r[kind]["errors"][1] for r in ranks])[:N]
    torch.testing.assert_close(sent, exact - worker - server, rtol=0, atol=1e-4)
    # Not an identity that holds anyway: the residuals are not small.
    assert float((worker + server).abs().max()) > 1e-2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_and_resume(kind: str, ranks: list) -> None:
    per_call = quantized_wire_bytes(N, W, kind, BLOCK)
    assert ranks[0][kind]["bytes"] == 3 * per_call
    seg = 384  # 1000 elements padded to whole blocks per rank: 3 x 6 blocks of 64
    bits = BITS[kind]
    assert per_call == 2 * (W - 1) * (seg * bits // 8 + 4 * seg // BLOCK)
    # At a real size, against an fp32 ring allreduce: 3.9x (8 bits), 7.8x (4), 28x (1).
    big = 1 << 20
    ratio = (2 * 3 * big * 4 // 4) / quantized_wire_bytes(big, 4, kind)
    assert ratio == pytest.approx(32 / (bits + 1 / 8), rel=1e-3)
    for r in ranks:
        resumed, twin = r[kind]["resumed"]
        torch.testing.assert_close(resumed, twin, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_errors_are_raised_on_every_rank_and_change_nothing(ranks: list) -> None:
    for r in ranks:
        assert r["nan"].startswith("NonFiniteError") and "rank(s) [1]" in r["nan"]
        assert r["length"].startswith("LengthMismatchError")
        assert float(r["plain_errors"]["worker_error"].abs().max()) == 0.0
    # The failed call left the error feedback as the last good call did.
    for r in ranks:
        torch.testing.assert_close(r["after_nan"], r["before_nan"], rtol=0, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_the_simulators_exchange_is_the_collective_bit_for_bit(kind: str, ranks: list) -> None:
    """The simulator's Streaming DiLoCo averages W workers in one process: the same
    outputs as the collective, error feedback carried over calls, and the same bytes."""
    sim = SimulatedExchange(kind, block=BLOCK)
    for c in range(3):
        got = sim.mean(0, [_input(r, c) for r in range(W)])
        torch.testing.assert_close(got, ranks[0][kind]["results"][c], rtol=0, atol=0)
    assert sim.bytes_per_worker == ranks[0][kind]["bytes"]
    assert sim.peak_bytes == quantized_wire_bytes(N, W, kind, BLOCK)
    # Without error feedback nothing is kept, and the second call differs from the first
    # collective's second output (which carried the first call's rounding).
    plain = SimulatedExchange(kind, error_feedback=False, block=BLOCK)
    plain.mean(0, [_input(r, 0) for r in range(W)])
    assert not plain.errors
    second = plain.mean(0, [_input(r, 1) for r in range(W)])
    assert not torch.equal(second, ranks[0][kind]["results"][1])


@pytest.mark.timeout(120)
def test_a_side_number_rides_in_the_check(ranks: list) -> None:
    """The 1-bit optimizers' momentum exchange sends a number beside the momentum (their
    gauge's statistic); with a quantizer it travels in the check's gather, so a
    compressed step spends no collective of its own on it."""
    total = sum(0.25 + r for r in range(W))
    for r in ranks:
        mean, summed, ops = r["side"]
        assert summed == total and mean == total / W
        assert ops == ["momentum.int8.phase1", "momentum.int8.phase2"]
