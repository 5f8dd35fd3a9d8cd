"""The Local-SGD wire messages: exact layouts, round trips, and malformed input refused."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from thinwire.comm.launch import free_port
from thinwire.localsgd.messages import (
    HEADER_LEN,
    Envelope,
    Hello,
    Kind,
    MessageError,
    Refused,
    RunInfo,
    Update,
    Why,
    Work,
    decode,
    dtype_code,
    encode,
    pack_queued,
    unpack_queued,
)
from thinwire.localsgd.runtime.auth import AuthError, RunKey
from thinwire.localsgd.runtime.transport import Transport

_MESSAGES = [
    Hello(numel=437_760, checksum=2**32 - 1),
    Hello(numel=4, checksum=0, late=True),
    Hello(numel=4, checksum=0, late=True, force=True),
    Update(epoch=2, steps=17, seconds_per_step=0.125, loss=3.5, dtype=torch.float32),
    Update(epoch=0, steps=1, seconds_per_step=2.5e-3, loss=-1.0, dtype=torch.float16),
    Update(epoch=0, steps=0, seconds_per_step=0.0, loss=0.0, dtype=torch.bfloat16),
    Work(epoch=1, version=99, shard=3, steps=20, lr_clock=140, planned=200),
    Work(epoch=4, version=12, stop=True),
    Update(epoch=1, steps=3, seconds_per_step=0.5, loss=2.0, dtype=torch.uint8, version=41),
    Work(
        epoch=1, version=7, shard=0, steps=5, lr_clock=3, planned=9, dtype=torch.uint8, delta=True
    ),
    Refused(numel=10, checksum=12345),
    Refused(numel=10, checksum=12345, reason=Why.ALIVE),
    Refused(numel=1, checksum=2, reason=Why.EVICTED),
]


@pytest.mark.parametrize("msg", _MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: object) -> None:
    header = encode(msg)  # type: ignore[arg-type]
    assert len(header) == HEADER_LEN and all(isinstance(v, float) for v in header)
    assert decode(header) == msg
    # Through the float64 tensor a server-to-worker header travels as, and through the
    # store queue a worker-to-server header travels through.
    assert decode(torch.tensor(header, dtype=torch.float64).tolist()) == msg
    blob = pack_queued(3, 2, msg)  # type: ignore[arg-type]
    assert len(blob) == 16 + 8 * HEADER_LEN
    assert unpack_queued(blob) == Envelope(src=3, incarnation=2, message=msg)  # type: ignore[arg-type]


def test_header_layouts_are_the_documented_ones() -> None:
    # The wire format: the kind, the fields in order, zero padding. A change here changes
    # what every running worker and server expects.
    assert encode(Hello(5, 6, True)) == [1.0, 5.0, 6.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert encode(Update(7, 8, 0.5, 2.25, torch.bfloat16)) == [2.0, 7, 8, 0.5, 2.25, 2, 0, 0]
    assert encode(Work(1, 2, 3, 4, 5, 6)) == [3.0, 1, 2, 3, 4, 5, 6, 0]
    assert encode(Work(1, 2, stop=True)) == [4.0, 1, 2, 0, 0, 0, 0, 0]
    assert encode(Refused(9, 10)) == [5.0, 9, 10, 0, 0, 0, 0, 0]
    assert encode(Update(7, 8, 0.5, 2.25, torch.uint8, 11)) == [2.0, 7, 8, 0.5, 2.25, 3, 11, 0]
    delta = Work(1, 2, 3, 4, 5, 6, dtype=torch.bfloat16, delta=True)
    assert encode(delta) == [6.0, 1, 2, 3, 4, 5, 6, 2]
    assert [int(k) for k in Kind] == [1, 2, 3, 4, 5, 6]
    assert Work(0, 0).kind == Kind.WORK and Work(0, 0, stop=True).kind == Kind.STOP


def test_a_nan_loss_is_carried_but_counts_must_be_whole() -> None:
    # A diverged round's loss is information, not a malformed message.
    nan_loss = decode(encode(Update(0, 3, 0.1, math.nan)))
    assert isinstance(nan_loss, Update) and math.isnan(nan_loss.loss)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([9.0] + [0.0] * 7, "unknown message kind 9.0"),
        ([math.nan] + [0.0] * 7, "unknown message kind nan"),
        ([3.0, 1.5, 0, 0, 0, 0, 1, 0], "WORK field epoch must be a whole number >= 0, got 1.5"),
        ([3.0, 0, -1.0, 0, 0, 0, 1, 0], "WORK field version must be a whole number >= 0"),
        ([3.0, 0, 0, math.inf, 0, 0, 1, 0], "WORK field shard must be a whole number"),
        ([1.0, 4, 0, 0.5, 0, 0, 0, 0], "HELLO field late must be 0 or 1, got 0.5"),
        ([2.0, 0, 1, 0.1, 0.0, 7.0, 0, 0], "UPDATE field dtype: unknown dtype code 7"),
        ([4.0, 1, 2, 3.0, 0, 0, 0, 0], "STOP header has numbers past its 2 fields"),
        ([5.0, 1, 2, 0, 0, 0, 0, 1.0], "ERROR header has numbers past its 4 fields"),
        ([1.0, 4, 0, 0], "a header has 8 numbers, got 4"),
    ],
)
def test_malformed_headers_are_refused_with_a_clear_error(values: list[float], match: str) -> None:
    with pytest.raises(MessageError, match=match):
        decode(values)


def test_other_bad_input_is_refused() -> None:
    with pytest.raises(MessageError, match="a queued header is 80 bytes, got 3"):
        unpack_queued(b"abc")
    with pytest.raises(MessageError, match="bad sender rank -1"):
        unpack_queued(pack_queued(-1, 0, Hello(1, 1)))
    with pytest.raises(MessageError, match="cannot encode dict"):
        encode({"kind": 1})  # type: ignore[arg-type]
    with pytest.raises(MessageError, match=r"unsupported payload dtype torch\.float64"):
        dtype_code(torch.float64)
    with pytest.raises(MessageError, match="unsupported payload dtype"):
        encode(Update(0, 1, 0.1, 0.0, torch.int8))
    with pytest.raises(MessageError, match="published settings are unreadable"):
        RunInfo.from_json('{"workers": 2}')
    with pytest.raises(MessageError, match="published settings are unreadable"):
        RunInfo.from_json(b"\xff not json")


def test_run_info_round_trips() -> None:
    info = RunInfo(workers=3, numel=437_760, checksum=2**31 + 5, shards=12)
    assert RunInfo.from_json(info.to_json()) == info
    assert RunInfo.from_json(info.to_json(), finished=True).finished
    # The published text is what earlier releases published: finished lives apart.
    assert info.to_json() == (
        '{"workers": 3, "numel": 437760, "checksum": 2147483653, "shards": 12}'
    )


@pytest.mark.timeout(30)
def test_server_transport_consumes_a_malformed_queued_header_and_reads_on() -> None:
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    key = RunKey.from_token(b"a test token of the run")
    server = Transport(store, rank=0, run_id="m", key=key, connect_timeout_s=2, timeout_s=5)
    worker = Transport(store, rank=1, run_id="m", key=key, connect_timeout_s=2, timeout_s=5)
    try:
        queue = dist.PrefixStore("thinwire.localsgd/m/", store)
        queue.queue_push("to_server", b"forged")
        queue.queue_push("to_server", b"x" * 200)  # as long as a message, and nonsense
        worker.send(0, Update(0, 2, 0.1, 1.0))  # a header only: no link is needed for it
        with pytest.raises(MessageError, match="longer than its seal, got 6 bytes"):
            server.poll()
        with pytest.raises(MessageError, match="a queued header is 80 bytes, got 112"):
            server.poll()
        # Well formed and sealed, but an UPDATE from a connection that never said hello.
        with pytest.raises(AuthError, match="never said a verified hello"):
            server.poll()
        assert server.poll() is None
    finally:
        server.close()
        worker.close()
