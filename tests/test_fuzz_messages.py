"""Fuzzing the asynchronous runtime's decoders: whatever arrives, one clean answer.

Property-style tests with a seeded generator (``random.Random`` with fixed seeds, so a
failure replays exactly): random bytes, valid messages truncated or with bits flipped,
wrong lengths, kinds, versions and epochs. Each decoder must give back a message or
refuse with its one error type (:class:`MessageError`, :class:`AuthError` for seals), and
never raise anything else or hang. The server core is fuzzed the same way: any push,
however wrong, is applied or refused, and never breaks the run's bookkeeping.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct

import pytest
import torch

from thinwire.localsgd.algorithm.push_guard import REASONS, PushGuard
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.messages import (
    DTYPES,
    HEADER_LEN,
    Hello,
    Kind,
    MessageError,
    Refused,
    RunInfo,
    Update,
    Work,
    decode,
    encode,
    pack_queued,
    unpack_queued,
)
from thinwire.localsgd.runtime.auth import TRAILER_LEN, AuthError, Channel, Keyring, RunKey

_SEEDS = range(4)
_CASES = 500  # per seed: four seeds of every test run in well under a second each

_SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0**53, 2.0**63, -(2.0**63), math.nan, math.inf, -math.inf]


def _number(rng: random.Random) -> float:
    """A header number: mostly plausible (kinds, small counts, dtype codes), some wild."""
    pick = rng.random()
    if pick < 0.4:
        return float(rng.randint(0, 8))
    if pick < 0.6:
        return rng.choice(_SPECIAL)
    if pick < 0.8:
        return rng.uniform(-1e6, 1e6)
    return struct.unpack("<d", rng.randbytes(8))[0]  # any bit pattern, NaNs included


def _valid(rng: random.Random) -> Hello | Update | Work | Refused:
    """A well-formed message of a random kind."""
    kind = rng.randrange(6)
    n = rng.randint(0, 10**6)
    dtype = DTYPES[rng.randrange(len(DTYPES))]
    if kind == 0:
        return Hello(n, rng.randint(0, 2**32 - 1), rng.random() < 0.5, rng.random() < 0.5)
    if kind == 1:
        return Update(n, rng.randint(1, 50), rng.random(), rng.random() * 5, dtype, n + 3)
    if kind == 2:
        return Work(n, n + 1, rng.randint(0, 9), rng.randint(1, 50), 7, 100, dtype=dtype)
    if kind == 3:
        return Work(n, n + 1, stop=True)
    if kind == 4:
        return Refused(n, rng.randint(0, 2**32 - 1), rng.randint(0, 2), rng.randint(0, 8))
    return Work(n, n, 1, 2, 3, 4, dtype=dtype, delta=True)


def _same(a: object, b: object) -> bool:
    # Messages compare field by field; NaN (allowed in a loss) never equals itself.
    if type(a) is not type(b):
        return False
    ea, eb = encode(a), encode(b)  # type: ignore[arg-type]
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(ea, eb, strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_random_headers_decode_to_a_message_or_one_message_error(seed: int) -> None:
    rng = random.Random(seed)
    decoded = 0
    for _ in range(_CASES):
        if rng.random() < 0.5:
            # A valid header with a few numbers replaced: the fields get fuzzed one by one.
            values = encode(_valid(rng))
            for _ in range(rng.randint(0, 2)):
                values[rng.randrange(HEADER_LEN)] = _number(rng)
        else:
            length = HEADER_LEN if rng.random() < 0.8 else rng.randint(0, 2 * HEADER_LEN)
            values = [_number(rng) for _ in range(length)]
            if length and rng.random() < 0.5:
                values[0] = float(rng.choice(list(Kind)))
        try:
            msg = decode(values)
        except MessageError as exc:
            assert str(exc) and "\n" not in str(exc)  # one line, saying what was wrong
            continue
        decoded += 1
        assert len(values) == HEADER_LEN
        assert _same(decode(encode(msg)), msg)  # what decodes, re-encodes to itself
    assert decoded > 0  # the generator does reach valid messages


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_valid_messages_round_trip_and_flipped_bits_are_caught_or_decoded(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(_CASES):
        msg = _valid(rng)
        blob = pack_queued(rng.randint(0, 64), rng.randint(0, 64), msg)
        env = unpack_queued(blob)
        assert _same(env.message, msg)
        # One to eight flipped bits: either still a message (a number changed into
        # another valid one) or a MessageError; never another exception.
        broken = bytearray(blob)
        for _ in range(rng.randint(1, 8)):
            broken[rng.randrange(len(broken))] ^= 1 << rng.randrange(8)
        with contextlib.suppress(MessageError):
            unpack_queued(bytes(broken))
        # Truncated or extended: always refused by its length.
        cut = blob[: rng.randrange(len(blob))] if rng.random() < 0.5 else blob + rng.randbytes(8)
        with pytest.raises(MessageError, match="queued header is"):
            unpack_queued(cut)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_random_bytes_in_the_queue_never_raise_anything_else(seed: int) -> None:
    rng = random.Random(seed)
    size = struct.calcsize(f"<qq{HEADER_LEN}d")
    for _ in range(_CASES):
        n = size if rng.random() < 0.7 else rng.randint(0, 3 * size)
        try:
            env = unpack_queued(rng.randbytes(n))
        except MessageError:
            continue
        assert env.src >= 0 and env.incarnation >= 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_seals_refuse_random_and_tampered_trailers_with_an_auth_error(seed: int) -> None:
    rng = random.Random(seed)
    key = RunKey(bytes(range(32)))
    ring = Keyring(key, "run")
    worker = Channel(key, "run", 1, 1)
    hello = pack_queued(1, 1, Hello(4, 0))
    ring.open_queued(1, 1, True, hello, worker.seal(hello))  # a verified hello
    server = ring.server(1, 1)
    worker.open(b"h" * 64, server.seal(b"h" * 64))  # the worker learns the server's nonce
    for _ in range(_CASES):
        header = pack_queued(1, 1, _valid(rng))
        trailer = bytearray(worker.seal(header))
        choice = rng.random()
        if choice < 0.3:
            trailer = bytearray(rng.randbytes(rng.choice([TRAILER_LEN, rng.randint(0, 200)])))
        elif choice < 0.8:
            trailer[rng.randrange(len(trailer))] ^= 1 << rng.randrange(8)
        else:
            header = header[:-1] + bytes([header[-1] ^ 1])  # the header itself changed
        with pytest.raises(AuthError):
            ring.open_queued(1, 1, False, header, bytes(trailer))
        # A stranger's message claiming any connection is refused the same way.
        with pytest.raises(AuthError):
            ring.open_queued(
                rng.randint(0, 9), rng.randint(2, 9), rng.random() < 0.5, header, bytes(trailer)
            )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_published_run_settings_parse_or_refuse_in_one_line(seed: int) -> None:
    rng = random.Random(seed)
    good = RunInfo(3, 21_472, 123, 4).to_json()
    wild = [1e400, -1, "x", None, [], {}, True, 2**70, math.nan, 1.5]
    for _ in range(_CASES):
        pick = rng.random()
        if pick < 0.3:
            text: str | bytes = rng.randbytes(rng.randint(0, 64))
        elif pick < 0.6:
            raw = bytearray(good.encode())
            raw[rng.randrange(len(raw))] = rng.randrange(256)
            text = bytes(raw[: rng.randint(0, len(raw))] if rng.random() < 0.3 else raw)
        else:
            d = json.loads(good)
            d[rng.choice(list(d))] = rng.choice(wild)
            text = json.dumps(d)
        try:
            info = RunInfo.from_json(text)
        except MessageError as exc:
            assert "\n" not in str(exc)
            continue
        assert info.workers >= 1 and info.numel >= 0 and info.shards >= 1
    with pytest.raises(MessageError):
        RunInfo.from_json("[" * 100_000)  # nesting deep enough to exhaust the parser


def _core() -> ServerCore:
    return ServerCore.of(
        torch.linspace(-1, 1, 6),
        workers=3,
        local_steps=4,
        total_steps=10**6,
        shard_sizes=[50, 50, 50],
        guard=PushGuard(max_strikes=3),
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", _SEEDS)
def test_any_push_is_applied_or_refused_and_the_books_stay_balanced(seed: int) -> None:
    rng = random.Random(seed)
    core = _core()
    rounds: dict[int, Work] = {}
    for step in range(_CASES):
        now = float(step)
        w = rng.randint(1, 3)
        if w not in core.live:
            core.join(w, now)  # a new process for a dead or evicted worker
        for due in core.due(now):
            work = core.work_for(due, now)
            if work is not None and not work.stop:
                rounds[due] = work
        honest = rounds.get(w)
        epoch = core.epoch if rng.random() < 0.8 else rng.randint(0, 3)
        steps = honest.steps if honest and rng.random() < 0.8 else rng.randint(0, 9)
        version = honest.version if honest and rng.random() < 0.7 else rng.randint(0, 40)
        numel = 6 if rng.random() < 0.9 else rng.randint(0, 9)
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(step)) * 0.01
        if rng.random() < 0.05:
            grad[0:1] = math.nan
        seconds = rng.choice([0.1, 0.1, 0.1, 0.0, -1.0, math.nan, math.inf])
        applied = core.submit(w, epoch, grad, steps, seconds, now, version)
        assert isinstance(applied, bool)
        if w in core.evicted:
            rounds.pop(w, None)
    # Whatever was pushed: theta is finite, every refusal has a reason, no step was
    # counted that was not handed out, and only refusals got anyone evicted.
    assert bool(torch.isfinite(core.theta).all())
    assert set(core.guard.refused) <= set(REASONS)
    assert core.steps_applied <= core.steps_assigned + sum(r.steps for r in rounds.values())
    assert core.pushes_refused > 0 and core.updates_applied > 0


@pytest.mark.timeout(30)
def test_screened_pushes_count_toward_stopping_the_sender() -> None:
    core = _core()
    core.join(1, 0.0)
    core.due(0.0)
    work = core.work_for(1, 0.0)
    assert work is not None
    # A push tagged with a future version, one from another epoch, then one with no
    # round in flight: each refused, counted, never forgiven; the third stops it.
    assert not core.submit(1, work.epoch, torch.zeros(6), work.steps, 0.1, 1.0, work.version + 5)
    assert 1 in core.due(1.0) and core.work_for(1, 1.0) is not None
    assert not core.submit(1, work.epoch + 1, torch.zeros(6), work.steps, 0.1, 2.0, work.version)
    assert not core.submit(1, work.epoch, torch.zeros(6), work.steps, 0.1, 3.0, work.version)
    assert core.guard.refused == {"version": 1, "epoch": 1, "duplicate": 1}
    assert 1 in core.evicted and core.steps_applied == 0
    assert core.steps_assigned == 0  # every refused round was rewound
