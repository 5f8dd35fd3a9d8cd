"""Streaming DiLoCo on the simulator's virtual clock: synchronous workers of different
speeds, the model's fragments synced in turn.

The simulator's ``sync`` method runs Streaming DiLoCo when its settings ask for it
(``fragments > 1``, a ``fragment_overlap``, a ``fragment_alpha``, or a quantizer
``compress`` of ``int8``, ``fp8`` or ``int4``; ``onebit`` with any of the others;
:meth:`~thinwire.localsgd.LocalSGDSettings.streaming`)::

    thinwire simulate --methods sync --sweep sync:fragments=1,2,4 --local-steps 50 ...
    thinwire simulate --methods sync --fragments 2 --compress int4 --no-error-feedback ...

Each simulated worker is the library's own :class:`~thinwire.localsgd.StreamingDiLoCo`
around its model and inner optimizer, so the fragments, their turns, the overlap, the
mixing alpha, the outer Nesterov step and the per-fragment inner-state rule are the
code a real run executes. Only the exchange is the simulation's: the W workers live in
one process, so a fragment's average is computed here as the collective would compute
it: fp32 averages; the 16-bit casts divided and summed in the wire's dtype; the
quantizers as :class:`~thinwire.comm.QuantizedAllreduce` does, each worker's rounding
and the mean's kept as error feedback (unless ``error_feedback=False``), and the bytes
each worker would send counted per sync (an allreduce's: the server methods count
pushes and pulls through the server instead).

Time: the workers train in lockstep on their own shards (worker ``w`` on shard
``w - 1``), each at its own seconds per step (jitter drawn per round of H steps). A
fragment's exchange needs every worker's pseudo-gradient, so it completes when the
slowest worker reaches the send; a worker waits for it where its average is applied
(at once without overlap, ``fragment_overlap`` steps later with one). The network
takes no time on this clock, as for every simulated method: the overlap shows here only
under jitter, and its cost in loss. Evaluations are of the global model (each
fragment's last outer step), at the budget's evaluation points.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from thinwire.comm.accounting import ring_allreduce_bytes
from thinwire.comm.quantized_allreduce import quantized_wire_bytes
from thinwire.compress.cast import CAST_DTYPES, cast_decode, cast_encode
from thinwire.compress.quantize import BLOCK_CODES, DEFAULT_QUANT_BLOCK, block_codec
from thinwire.localsgd.algorithm.norm_stats import NormStats
from thinwire.localsgd.algorithm.shards import ShardBook
from thinwire.localsgd.algorithm.sim_checkpoint import (
    SimCheckpoint,
    check_same_run,
    generator_states,
    restore_generators,
)
from thinwire.localsgd.algorithm.streaming import StreamingDiLoCo
from thinwire.localsgd.algorithm.virtual_clock import sim_worker, started
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.messages import Work
from thinwire.localsgd.task import (
    Task,
    flat_parameters,
    load_flat_,
    metrics_at,
    shard_sizes,
)

if TYPE_CHECKING:
    from thinwire.localsgd.algorithm.virtual_clock import SimClock
    from thinwire.localsgd.config import AsyncConfig

__all__ = ["SimulatedExchange", "simulate_streaming"]


class SimulatedExchange:
    """The average of one fragment's pseudo-gradients over W simulated workers, as the
    collective behind :class:`StreamingDiLoCo` computes it, with the bytes each worker
    would send.

    Args:
        compress: ``none``, ``fp16``, ``bf16``, ``int8``, ``fp8``, ``int4`` or ``onebit``.
        error_feedback: the quantizers and ``onebit`` keep each worker's rounding and the
            mean's, per fragment, and add them to the next sync of that fragment.
        block: the quantizers' elements per scale.
    """

    def __init__(
        self, compress: str, error_feedback: bool = True, block: int = DEFAULT_QUANT_BLOCK
    ) -> None:
        self.compress = compress
        self.codec = block_codec(compress, block) if compress in BLOCK_CODES else None
        self.error_feedback = error_feedback and self.codec is not None
        self.errors: dict[tuple[int, int], torch.Tensor] = {}  # (fragment, worker; 0: mean)
        self.bytes_per_worker = 0
        """What each worker sent over the run (every worker sends as much)."""
        self.peak_bytes = 0
        """The most one sync put on each worker's link."""

    def mean(self, fragment: int, pseudos: list[torch.Tensor]) -> torch.Tensor:
        """Every worker's ``pseudos[w - 1]`` averaged, as every worker receives it."""
        w, n = len(pseudos), pseudos[0].numel()
        if self.codec is not None:
            total = torch.zeros(n, dtype=torch.float32)
            for i, x in enumerate(pseudos, start=1):  # worker order: the collective's
                total += self._rounded(x, (fragment, i))
            out = self._rounded(total / w, (fragment, 0))
            sent = quantized_wire_bytes(n, w, self.compress, self.codec.block)
        elif self.compress in CAST_DTYPES:
            dtype = CAST_DTYPES[self.compress]
            acc = cast_encode(pseudos[0], dtype).div_(w)  # divided before the sum, as sent
            for x in pseudos[1:]:
                acc += cast_encode(x, dtype).div_(w)
            out = cast_decode(acc, torch.float32)
            sent = ring_allreduce_bytes(n * acc.element_size(), w)
        else:
            out = torch.stack(pseudos).sum(0).div_(w)
            sent = ring_allreduce_bytes(4 * n, w)
        self.bytes_per_worker += sent
        self.peak_bytes = max(self.peak_bytes, sent)
        return out

    def _rounded(self, x: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """``x`` (plus its stream's error feedback) through the quantizer and back,
        zero-filled to whole blocks as the collective pads it."""
        assert self.codec is not None
        error = self.errors.get(key) if self.error_feedback else None
        target = x if error is None else x + error
        n, block = target.numel(), self.codec.block
        padded = torch.nn.functional.pad(target, (0, -(-n // block) * block - n))
        out = self.codec.decompress(self.codec.compress(padded))[:n]
        if self.error_feedback:
            self.errors[key] = target - out
        return out


class _Replica(StreamingDiLoCo):
    """One simulated worker's Streaming DiLoCo: the averages come from the simulation,
    which computes them from every worker's pseudo-gradient before this worker steps."""

    answers: dict[int, torch.Tensor]

    def _average(self, f: int, flat: torch.Tensor) -> torch.Tensor:
        return self.answers.pop(f)


def simulate_streaming(
    task: Task,
    cfg: AsyncConfig,
    clock: SimClock,
    pretrained: dict[str, torch.Tensor] | None,
    checkpoint: SimCheckpoint | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, float]], float]:
    """Run the sync method as Streaming DiLoCo; returns (the run's own summary fields,
    the curve, the virtual time it ended). Called by
    :func:`~thinwire.localsgd.algorithm.virtual_clock.simulate`, which checks ``cfg``
    and documents ``checkpoint`` and ``progress``."""
    return _Streaming(task, cfg, clock, pretrained).run(checkpoint, progress)


class _Streaming:
    def __init__(
        self,
        task: Task,
        cfg: AsyncConfig,
        clock: SimClock,
        pretrained: dict[str, torch.Tensor] | None,
    ) -> None:
        w_count = len(clock.seconds_per_step)  # the config is checked for them already
        self.cfg, self.clock, self.metric = cfg, clock, task.evaluate
        task, self.model, sources = started(task, cfg, w_count, pretrained)
        self.norms = NormStats(self.model, sources, task.loss, cfg.norm_batches)
        self.norms.warn()
        theta = flat_parameters(self.model)
        self.model_numel = theta.numel()
        self.planned = ShardBook(shard_sizes(sources), cfg.steps * w_count).planned
        self.workers: list[LocalWorker] = []
        self.replicas: list[_Replica] = []
        for _ in range(w_count):
            worker = sim_worker(task, cfg, sources, "keep")  # the fragments' rule: below
            load_flat_(worker.params, theta)
            replica = _Replica(
                worker.model,
                worker.opt,
                cfg.local_steps,
                fragments=cfg.fragments,
                overlap=cfg.fragment_overlap,
                alpha=cfg.fragment_alpha,
                outer_lr=cfg.resolved_outer_lr(),
                outer_momentum=cfg.resolved_outer_momentum(),
                sync_initial=False,
                inner_momentum=cfg.resolved_inner_momentum(),
            )
            replica.answers = {}
            replica.close()  # no step hook: _sync drives each replica at its sends only
            self.workers.append(worker)
            self.replicas.append(replica)
        self.exchange = SimulatedExchange(cfg.compress, cfg.error_feedback)
        self.times = [0.0] * w_count  # each worker's clock
        self.factors = [1.0] * w_count  # this round's jitter
        self.jitter_rng = torch.Generator().manual_seed(clock.seed + 7919)
        self.done_at: dict[int, float] = {}  # fragment -> when its exchange completed
        self.curve: list[dict[str, float]] = []
        self.done = 0  # inner steps of each worker so far (where a resumed run goes on)

    # --- one stretch of steps, one sync ----------------------------------------------
    def _train(self, start: int, stop: int) -> None:
        """Every worker's inner steps ``start + 1 .. stop`` (one round's part)."""
        h = self.cfg.local_steps
        if start % h == 0 and self.clock.jitter > 0:
            for i in range(len(self.factors)):
                noise = float(torch.randn((), generator=self.jitter_rng))
                self.factors[i] = math.exp(self.clock.jitter * noise)
        for i, worker in enumerate(self.workers):
            work = Work(0, 0, shard=i, steps=stop - start, lr_clock=start, planned=self.planned[i])
            worker.run_round(flat_parameters(worker.model), work)
            self.times[i] += (stop - start) * self.clock.seconds_per_step[i] * self.factors[i]

    def _sync(self, step: int) -> None:
        """The applies and sends of ``step``: waits where an average is needed, answers
        computed from every worker, then each worker's Streaming DiLoCo steps."""
        first = self.replicas[0]
        for f, (due, _) in first._pending.items():
            if due <= step:  # every worker waits here for the exchange to have finished
                self._wait_for(f)
        phase = step % self.cfg.local_steps
        sending = [f for f, offset in enumerate(first.offsets) if offset == phase]
        self._answer(sending)
        for replica in self.replicas:
            replica.after_inner_step(step)
        if sending:
            finished = max(self.times)  # the slowest worker's pseudo-gradient is in
            if self.cfg.fragment_overlap == 0:
                self.times = [finished] * len(self.times)
            else:
                self.done_at.update(dict.fromkeys(sending, finished))

    def _wait_for(self, fragment: int) -> None:
        ready = self.done_at.pop(fragment)
        self.times = [max(t, ready) for t in self.times]

    def _answer(self, fragments: list[int]) -> None:
        for f in fragments:
            avg = self.exchange.mean(f, [r._pseudo(f) for r in self.replicas])
            for replica in self.replicas:
                replica.answers[f] = avg.clone()

    def _record(self, step: int) -> None:
        theta = torch.cat([g.reshape(-1).float() for g in self.replicas[0].global_params])
        # val_loss, ..., with theta's own normalization statistics
        refresh = self.norms.refresh
        metrics = metrics_at(self.model, theta, self.metric, lambda _: refresh())
        point = {
            "steps": step * len(self.workers),
            "updates": self.replicas[0].syncs,  # fragment syncs (finish()'s included)
            "time_s": max(self.times),
        }
        self.curve.append(point | metrics)

    # --- the run ---------------------------------------------------------------------
    def _stops(self) -> list[int]:
        """The steps after which something happens: a send, an apply, an evaluation."""
        cfg, h = self.cfg, self.cfg.local_steps
        offsets = self.replicas[0].offsets
        sends = {t for t in range(1, cfg.steps + 1) if t % h in offsets}
        applies = {t + cfg.fragment_overlap for t in sends if t + cfg.fragment_overlap <= cfg.steps}
        return sorted(sends | applies | self._evals() | {cfg.steps})

    def _evals(self) -> set[int]:
        """The steps after which the global model is evaluated: the budget's points."""
        points, steps = self.clock.eval_points, self.cfg.steps
        return {math.ceil(k * steps / points) for k in range(1, points + 1)}

    def run(
        self,
        checkpoint: SimCheckpoint | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, float]], float]:
        evals, w_count = self._evals(), len(self.workers)
        settings = (self.cfg, self.clock)
        if checkpoint is not None and checkpoint.resume(settings, self.load_state_dict):
            checkpoint.resumed_at = self.done * w_count
        else:
            self._record(0)
        if progress is not None:
            progress(self.done * w_count, self.cfg.steps * w_count)
        try:
            for stop in self._stops():
                if stop <= self.done:
                    continue  # before the checkpoint this run resumed from
                self._train(self.done, stop)
                self.done = stop
                self._sync(stop)
                if stop in evals and stop < self.cfg.steps:
                    self._record(stop)
                if progress is not None:
                    progress(self.done * w_count, self.cfg.steps * w_count)
                if checkpoint is not None and checkpoint.due():
                    checkpoint.save(self.state_dict())
            self._finish()
        finally:
            for replica in self.replicas:
                replica.close()
        self._record(self.cfg.steps)
        own = {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "inner_steps": self.cfg.steps * len(self.workers),
            "updates": self.replicas[0].syncs,  # fragment syncs (finish()'s included)
            "updates_dropped": 0,
            "staleness": {},
            "shard_steps": [self.cfg.steps] * len(self.workers),
            "shard_planned": list(self.planned),
            # Every worker sends as much; as the server methods count pushes: all of it.
            "push_bytes": self.exchange.bytes_per_worker * len(self.workers),
            "pull_bytes": 0,
            "peak_sync_bytes": self.exchange.peak_bytes,
            "streaming": {
                "fragments": self.cfg.fragments,
                "overlap": self.cfg.fragment_overlap,
                "alpha": self.cfg.fragment_alpha,
                "compress": self.cfg.compress,
                "error_feedback": self.exchange.error_feedback,
            },
        }
        return own, self.curve, max(self.times)

    # --- checkpoints (between two stretches: no average waits in a replica) ------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the rest of the run reads (after inner step ``done`` of each worker)."""
        return {
            "done": self.done,
            "inner": [worker.opt.state_dict() for worker in self.workers],
            "replicas": [replica.state_dict() for replica in self.replicas],
            "errors": [(f, w, e.clone()) for (f, w), e in self.exchange.errors.items()],
            "sent": (self.exchange.bytes_per_worker, self.exchange.peak_bytes),
            "times": list(self.times),
            "factors": list(self.factors),
            "done_at": dict(self.done_at),
            "curve": self.curve,
            "jitter_rng": self.jitter_rng.get_state(),
            "generators": generator_states(),  # a task's dropout, data order, ...
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict` of this very run."""
        numel = sum(g.numel() for g in state["replicas"][0]["global"])
        check_same_run((numel, len(state["inner"])), (self.model_numel, len(self.workers)))
        with torch.no_grad():
            for worker, replica, inner, saved in zip(
                self.workers, self.replicas, state["inner"], state["replicas"], strict=True
            ):
                worker.opt.load_state_dict(inner)
                replica.load_state_dict(saved)
        self.done = int(state["done"])
        self.exchange.errors = {(int(f), int(w)): e.clone() for f, w, e in state["errors"]}
        self.exchange.bytes_per_worker, self.exchange.peak_bytes = map(int, state["sent"])
        self.times = [float(t) for t in state["times"]]
        self.factors = [float(x) for x in state["factors"]]
        self.done_at = {int(f): float(t) for f, t in state["done_at"].items()}
        self.curve = [dict(point) for point in state["curve"]]
        self.jitter_rng.set_state(state["jitter_rng"])
        if "generators" in state:
            restore_generators(state["generators"])
        else:  # saved by a version that kept torch's generator alone
            torch.set_rng_state(state["torch_rng"])

    def _finish(self) -> None:
        """As :meth:`StreamingDiLoCo.finish` on every worker: the fragments in flight
        land, then the others sync once more (:meth:`StreamingDiLoCo.finishing`) and the
        replicas end equal."""
        for f in list(self.done_at):
            self._wait_for(f)
        for replica in self.replicas:
            replica.flush()
        self._answer(self.replicas[0].finishing())  # alike on every worker
        for replica in self.replicas:
            replica.finish()
        self.times = [max(self.times)] * len(self.times)
