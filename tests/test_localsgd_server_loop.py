"""The server's loop in one process: its handler table, its state, its counters.

A scripted transport stands in for the workers: each says hello, and answers every round
it is handed with a push whose payload is in at once. Nothing here starts a process.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.server_core import ServerCore
from thinwire.localsgd.messages import Envelope, Hello, Message, Refused, Update, Why, Work
from thinwire.localsgd.runtime.server_loop import ServerLoop, ServeSettings, serve
from thinwire.localsgd.runtime.server_loop_state import LoopState

NUMEL, CRC = 6, 77


class ScriptedTransport:
    """The server's side of a transport whose workers answer every round at once."""

    connect_timeout = timedelta(seconds=1)

    def __init__(self, queue: list[Envelope]) -> None:
        self.queue = list(queue)
        self.refused: list[tuple[int, int, Refused]] = []
        self.sent: list[tuple[int, Message]] = []
        self.incarnations: dict[int, int] = {}
        self.beats = 0
        self.finished = False

    def publish(self, info: Any) -> None:
        pass

    def poll(self) -> Envelope | None:
        self.beats += 1  # every worker process beats while the server polls
        return self.queue.pop(0) if self.queue else None

    def accept(self, worker: int, incarnation: int) -> None:
        self.incarnations[worker] = incarnation

    def refuse(self, worker: int, incarnation: int, why: Refused) -> None:
        self.refused.append((worker, incarnation, why))

    def send(self, worker: int, msg: Message, payload: torch.Tensor | None = None) -> None:
        self.sent.append((worker, msg))
        if isinstance(msg, Work) and not msg.stop:
            push = Update(msg.epoch, msg.steps, 0.1, 1.0, torch.float32, msg.version)
            self.queue.append(Envelope(worker, self.incarnations[worker], push))

    def receive_payload(self, worker: int, numel: int, dtype: torch.dtype) -> Future[torch.Tensor]:
        fut: Future[torch.Tensor] = Future()
        fut.set_result(torch.full((numel,), 0.01))
        return fut

    def heartbeat(self, worker: int, incarnation: int) -> int:
        return self.beats

    def latest_incarnation(self, worker: int) -> int:
        return self.incarnations.get(worker, 1)

    def linked(self, worker: int) -> bool:
        return worker in self.incarnations

    def close(self, peer: int | None = None, *, drain: bool = False) -> None:
        pass

    def broken_links(self) -> set[int]:
        return set()

    def settle(self, timeout_s: float) -> None:
        pass

    def mark_finished(self) -> None:
        self.finished = True


def _core(total_steps: int = 8) -> ServerCore:
    return ServerCore.of(
        torch.zeros(NUMEL), workers=2, local_steps=2, total_steps=total_steps, shard_sizes=[9, 9]
    )


def _hello(
    worker: int, incarnation: int = 1, *, numel: int = NUMEL, late: bool = False
) -> Envelope:
    return Envelope(worker, incarnation, Hello(numel, CRC, late))


def _serve(queue: list[Envelope], **settings: Any) -> tuple[dict[str, Any], ScriptedTransport]:
    transport = ScriptedTransport(queue)
    out = serve(_core(), transport, [1, 2], (NUMEL, CRC), ServeSettings(**settings))  # type: ignore[arg-type]
    return out, transport


def test_the_handler_table_names_the_two_kinds_a_worker_sends() -> None:
    loop = ServerLoop(_core(), ScriptedTransport([]), [1, 2], (NUMEL, CRC), ServeSettings())  # type: ignore[arg-type]
    assert set(loop.handlers) == {Hello, Update}
    assert isinstance(loop.state, LoopState)


def test_a_run_is_served_to_its_end_and_counted() -> None:
    records: list[dict[str, Any]] = []
    out, transport = _serve(
        [_hello(1), _hello(2)],
        evaluate=lambda theta: float(theta.sum()),
        eval_every_steps=4,
        on_eval=records.append,
    )
    assert transport.finished and out["incarnations"] == {1: 1, 2: 1}
    assert [j["worker"] for j in out["joins"]] == [1, 2]
    steps = sum(u["inner_steps"] for u in out["updates_by_incarnation"])
    assert (
        steps == 8
        and out["push_bytes"]
        == sum(u["updates"] for u in out["updates_by_incarnation"]) * NUMEL * 4
    )
    assert [r["step"] for r in records] == [0, 4, 8]  # the start, every 4 steps, the end
    assert out["val_loss"] == records[-1]["val_loss"] and out["metrics"] == {
        "val_loss": out["val_loss"]
    }
    assert list(out)[:2] == ["wall_s", "dead_workers"] and out["stale_messages"] == 0


def test_strays_and_unknown_ranks_are_counted_stale() -> None:
    # A stop order in the workers' queue (no handler: stray), and a rank not in the run.
    queue = [_hello(1), _hello(2), Envelope(1, 1, Work(0, 0, stop=True)), _hello(9)]
    out, _ = _serve(queue)
    assert out["stale_messages"] == 2 and out["incarnations"] == {1: 1, 2: 1}


def test_a_late_joiner_with_another_model_is_refused_and_the_run_goes_on() -> None:
    out, transport = _serve([_hello(1), _hello(2), _hello(2, 2, numel=5, late=True)])
    assert transport.refused == [(2, 2, Refused(NUMEL, CRC, Why.MODEL))]
    assert out["incarnations"] == {1: 1, 2: 1}


def test_a_launched_worker_with_another_model_stops_the_run() -> None:
    with pytest.raises(ConfigError, match="worker rank 2 has a model of 5 parameters"):
        _serve([_hello(1), _hello(2, numel=5)])


def test_settings_are_frozen_and_a_resumed_state_keeps_its_intervals() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServeSettings().eval_every_steps = 3  # type: ignore[misc]
    state = LoopState.begin([1, 2], 5, ServeSettings(eval_every_steps=4, elapsed_s=2.0), 10.0)
    assert (state.next_eval, state.next_ckpt, state.clock0) == (8, float("inf"), 8.0)
    assert state.beats == {1: (0, -1, 10.0), 2: (0, -1, 10.0)}
