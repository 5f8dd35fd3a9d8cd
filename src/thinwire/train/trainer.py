"""The example trainer: a small GPT on text, data-parallel over torch.distributed.

Read it top to bottom: :func:`train` is the whole run. It is called on every rank, inside
a process group made by ``torchrun`` or by ``thinwire train``'s own spawning (or in a
single process, without a group). The algorithm (DDP+AdamW, LAMB, 1-bit LAMB, DiLoCo,
...) only decides which module runs forward/backward and which optimizer steps; see
:mod:`thinwire.train.algorithms`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.accounting import COUNTER, record
from thinwire.comm.allreduce import sum_small_
from thinwire.comm.launch import local_cuda_device
from thinwire.comm.launch import rank as get_rank
from thinwire.comm.launch import world_size as get_world_size
from thinwire.comm.resumable_ddp import ResumableDDP
from thinwire.comm.step_record import RECORD_NAME, StepRecorder, record_run
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text
from thinwire.optim.sharded import local_state
from thinwire.runlock import RunLock
from thinwire.train import checkpoint as ckpt
from thinwire.train import outdir, pretrain_checkpoint
from thinwire.train.algorithms import get_runner, make_strategy
from thinwire.train.config import TrainConfig
from thinwire.train.data import TextData
from thinwire.train.guard import DivergenceGuard
from thinwire.train.metrics import MetricsWriter, Progress
from thinwire.train.model import GPT
from thinwire.train.sharding import check_sharding, full_state_dict, shard_model
from thinwire.train.start import data_offset, read_start_file, run_start, start_of

__all__ = ["evaluate", "lr_at", "parameter_digest", "pick_device", "train"]

TRAINER_OPS = "trainer."
"""Prefix of the trainer's own small collectives (loss logging, evaluation, start-up):
counted, but kept apart from the algorithm's bytes in ``comm_bytes``."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.lr * cfg.min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def pick_device(cfg: TrainConfig) -> torch.device:
    """The device of this rank: CUDA device LOCAL_RANK when asked for (or ``auto`` finds one)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but CUDA is not available")
        return local_cuda_device()
    return torch.device("cpu")


def _all_reduce_sum(t: torch.Tensor, op: str) -> torch.Tensor:
    """A small trainer-side sum (one step, :func:`sum_small_`), counted under
    ``trainer.*``: the trainer's metrics should not cost the job round trips."""
    return sum_small_(t, op_name=TRAINER_OPS + op)


def _broadcast_decision(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank, so start-up decisions (and errors) agree."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def evaluate(model: nn.Module, data: TextData, cfg: TrainConfig, device: torch.device) -> float:
    """Mean validation loss over a fixed set of windows, shared among the ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    rank, world = get_rank(), get_world_size()
    batches = data.val_batches(cfg.eval_sequences, cfg.batch_size, rank, world)
    weights = [1.0] * len(batches)
    if cfg.shard_within > 1:
        # FSDP2 gathers each block inside the island in every forward: every rank runs as
        # many as rank 0 (which holds the most windows), the extra ones weighted 0.
        first = data.val_batches(cfg.eval_sequences, cfg.batch_size, 0, world)
        extra = len(first) - len(batches)
        batches += (batches[:1] or first[:1]) * extra
        weights += [0.0] * extra
    for (x, y), w in zip(batches, weights, strict=True):
        _, loss = model(x.to(device), y.to(device))
        total += w * torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    _all_reduce_sum(total, "eval")
    model.train(was_training)
    return float(total[0] / total[1])


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical replicas (of
    the whole model: FSDP2 shards are gathered, so every rank of a sharded run calls it)."""
    h = hashlib.sha256()
    for name, p in sorted(full_state_dict(model).items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _identity(cfg: TrainConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in cfg.IDENTITY} | {"world_size": get_world_size()}


def _start_step(cfg: TrainConfig, out_dir: Path) -> tuple[int, str | None, dict | None]:
    """Decide on rank 0 where the run starts, check the output directory, tell every rank.

    Returns the start step, the run id (stamped on every checkpoint file) and, when a
    resumed run has nothing left to do, its saved summary. Errors are decided on rank 0
    and raised on every rank, so no rank is left waiting.
    """
    decision: tuple[int, str | None, dict | None, str | None] = (0, None, None, None)
    if get_rank() == 0:
        try:
            decision = (*outdir.decide_start(cfg, out_dir, _identity(cfg)), None)
        except ConfigError as exc:
            decision = (0, None, None, str(exc))
    step, run_id, finished, error = _broadcast_decision(decision)
    if error is not None:
        raise ConfigError(error)
    return step, run_id, finished


def _claim_out_dir(cfg: TrainConfig) -> RunLock | None:
    """Rank 0 locks ``--out`` for the whole run (:func:`outdir.claim`); every rank learns
    whether it could."""
    lock, error = None, None
    if get_rank() == 0:
        try:
            lock = outdir.claim(cfg.out_dir, cfg.resume)
        except ConfigError as exc:
            error = str(exc)
    error = _broadcast_decision(error)
    if error is not None:
        raise ConfigError(error)
    return lock


def _broadcast_parameters(model: nn.Module) -> None:
    """Every rank starts from rank 0's weights (fresh or loaded from a checkpoint)."""
    if get_world_size() == 1:
        return
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0)
        nbytes = t.numel() * t.element_size()
        record(TRAINER_OPS + "broadcast", nbytes, nbytes)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training on this rank; returns the run summary (complete on rank 0).

    Rank 0 holds a lock on ``cfg.out_dir`` for the whole run (:mod:`thinwire.runlock`);
    a directory that holds another run needs ``cfg.resume``.

    Raises:
        ConfigError: bad settings, or an output directory in use or holding another run.
        DivergedError: the loss turned non-finite or exploded, or most steps were skipped
            (:mod:`thinwire.train.guard`); the last good checkpoint is kept.
    """
    cfg.validate()
    start_of(cfg)  # a bad start is one line before anything is claimed
    lock = _claim_out_dir(cfg)
    try:
        COUNTER.reset()  # this run's bytes only, also when one process trains several times
        runner = get_runner(cfg.algo)
        if runner is not None:
            return runner(cfg)
        return _train(cfg)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class _Run:
    """One rank's run as the loop sees it: what it was built from, and its counters."""

    cfg: TrainConfig
    device: torch.device
    rank: int
    world: int
    data: TextData
    model: GPT
    strategy: Any
    metrics: MetricsWriter
    progress: Progress
    guard: DivergenceGuard
    start: int
    run_id: str | None
    begins: Any
    offset: int
    elapsed: float
    last_bytes: int
    val_loss: float = float("nan")
    start_elapsed: float = 0.0
    last_step: int = 0

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def samples_per_step(self) -> int:
        return self.cfg.batch_size * self.world


def _train(cfg: TrainConfig) -> dict[str, Any]:
    run = _set_up(cfg, pick_device(cfg))
    if isinstance(run, dict):
        return run  # resumed a finished run: nothing to do, nothing rewritten

    # --- the loop ------------------------------------------------------------------------
    run.model.train()
    end = min(cfg.steps, cfg.stop_after or cfg.steps)
    if 0 < run.start < end:
        _rehearse_buckets(run.strategy, run.data, cfg, run.start, run.device)
    compressing = bool(getattr(run.strategy.optimizer, "compressing", False))
    recorder = _recorder(run)  # after the rehearsal, which is not a step
    try:
        for step in range(run.start, end):
            compressing = _step(run, step, end, compressing)
            run.progress.update(1)
    finally:
        if recorder is not None:
            recorder.close()
        run.progress.close()
        run.metrics.close()
    return _summarize(run, end)


def _recorder(run: _Run) -> StepRecorder | None:
    """The run's step recorder (``cfg.record``): rank 0 appends to ``OUT/record.jsonl``."""
    cfg = run.cfg
    if not cfg.record:
        return None
    gcfg = cfg.gpt_config()
    meta = {
        "algo": cfg.algo,
        "preset": cfg.model,
        "batch_size": cfg.batch_size,
        "seq_len": gcfg.seq_len,
        "shard_within": cfg.shard_within,
    }
    path = run.out_dir / RECORD_NAME
    if cfg.resume and run.start == 0 and run.rank == 0:  # resumed from its pretraining
        path.unlink(missing_ok=True)  # what the stopped run recorded is all redone
    return record_run(
        run.strategy.model, run.strategy.optimizer, path, meta=meta, start_step=run.start
    )


def _set_up(cfg: TrainConfig, device: torch.device) -> _Run | dict[str, Any]:
    """Data, model, algorithm and the run's books on this rank, evaluated at step 0 when
    the run starts there; a resumed run with nothing left to do returns its summary."""
    rank, world = get_rank(), get_world_size()
    out_dir = Path(cfg.out_dir)

    # --- data, model, algorithm --------------------------------------------------------
    gcfg = cfg.gpt_config()
    data = TextData(cfg.data, gcfg.seq_len, cfg.val_fraction, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg).to(device)
    # A fresh run's start file is checked before the run's identity is written.
    state = None if cfg.resume else read_start_file(cfg, model)
    start, run_id, finished = _start_step(cfg, out_dir)
    if finished is not None:
        return finished
    if start > 0 and rank == 0:
        ckpt.restore_model(model, out_dir, start, run_id)
    if start == 0:
        begins = run_start(model, data, cfg, device, state, run_id)
    else:
        begins = start_of(cfg).describe()
    _broadcast_parameters(model)
    offset = data_offset(cfg)
    check_sharding(cfg, world)  # also under torchrun, which the launcher's checks skip
    replicas = shard_model(model, cfg.shard_within, device) if cfg.shard_within > 1 else None
    strategy = make_strategy(model, cfg, replicas)
    elapsed = 0.0
    if start > 0:  # checked against the live objects first: a damaged file is one line
        elapsed = ckpt.restore_rank_state(strategy, model, out_dir, start, rank, run_id)

    # A run resumed before its first checkpoint (from its pretraining's save) starts its
    # record over: whatever it wrote after step 0 is dropped, step 0 itself is rewritten.
    kept = start if start > 0 else (-1 if cfg.resume else None)
    metrics = MetricsWriter(out_dir, rank == 0, resume_step=kept, tensorboard=cfg.tensorboard)
    progress = Progress(cfg.steps, start, cfg.progress and rank == 0, desc=cfg.algo)
    run = _Run(
        cfg=cfg,
        device=device,
        rank=rank,
        world=world,
        data=data,
        model=model,
        strategy=strategy,
        metrics=metrics,
        progress=progress,
        guard=DivergenceGuard(math.log(gcfg.vocab_size), last_checkpoint=start or None),
        start=start,
        run_id=run_id,
        begins=begins,
        offset=offset,
        elapsed=elapsed,
        start_elapsed=elapsed,
        last_bytes=COUNTER.wire_bytes_excluding(TRAINER_OPS),
        last_step=start,
    )
    if start == 0:
        run.val_loss = evaluate(model, data, cfg, device)
        metrics.write(
            {"step": 0, "samples": 0, "val_loss": run.val_loss, "val_ppl": math.exp(run.val_loss)}
        )
    return run


def _step(run: _Run, step: int, end: int, compressing: bool) -> bool:
    """Train step ``step`` (0-based), then log, evaluate and save as due; returns whether
    the optimizer compresses now."""
    cfg, strategy = run.cfg, run.strategy
    lr = strategy.lr_at(step) if strategy.lr_at is not None else lr_at(step, cfg)
    if strategy.scale_lr:
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr
    if strategy.batch is not None:
        x, y = strategy.batch(step)
    else:
        x, y = run.data.batch(run.offset + step, cfg.batch_size, run.rank, run.world)
    t0 = time.perf_counter()
    _, loss = strategy.model(x.to(run.device), y.to(run.device))
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    strategy.optimizer.step()
    strategy.optimizer.zero_grad(set_to_none=True)
    if strategy.after_step is not None:
        strategy.after_step(step + 1)
    step_s = time.perf_counter() - t0
    run.elapsed += step_s
    done = step + 1
    if compressing != bool(getattr(strategy.optimizer, "compressing", False)):
        # every switch, also a stale freeze undone and the second freeze after it
        compressing = not compressing
        _announce_stage(cfg, strategy.optimizer, done, run.samples_per_step, run.metrics)

    save = (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == end
    if done % cfg.log_interval == 0 or done == end or save:  # the guard sees each save
        _log_train(run, done, loss, lr, step_s)
    if done % cfg.eval_interval == 0 or done == end:
        _log_val(run, done)
    if save:
        _save(cfg, run.out_dir, done, run.rank, run.model, strategy, run.elapsed, run.run_id)
        run.guard.saved(done)
    return compressing


def _log_train(run: _Run, done: int, loss: torch.Tensor, lr: float, step_s: float) -> None:
    """The training record of step ``done``: the loss averaged over ranks, time, bytes."""
    mean_loss = float(_all_reduce_sum(loss.detach().float().cpu().view(1), "loss")) / run.world
    comm = COUNTER.wire_bytes_excluding(TRAINER_OPS)
    rec: dict[str, Any] = {
        "step": done,
        "samples": done * run.samples_per_step,
        "loss": mean_loss,
        "lr": lr,
        "time_s": run.elapsed,
        "step_s": step_s,
        "comm_bytes": comm,
        "comm_bytes_per_step": (comm - run.last_bytes) / (done - run.last_step),
    }
    run.last_bytes, run.last_step = comm, done
    if run.strategy.metrics is not None:
        rec.update(run.strategy.metrics())
    run.metrics.write(rec)
    run.guard.check_train(done, mean_loss, rec.get("skipped_steps"))
    run.progress.update(
        0, loss=f"{mean_loss:.3f}", sps=f"{rec['samples'] / max(run.elapsed, 1e-9):.0f}"
    )


def _log_val(run: _Run, done: int) -> None:
    """Evaluate after step ``done`` and record it."""
    run.val_loss = evaluate(run.model, run.data, run.cfg, run.device)
    run.metrics.write(
        {
            "step": done,
            "samples": done * run.samples_per_step,
            "val_loss": run.val_loss,
            "val_ppl": math.exp(min(run.val_loss, 50.0)),
        }
    )
    run.guard.check_val(done, run.val_loss)


def _summarize(run: _Run, end: int) -> dict[str, Any]:
    """The run's summary, written to ``summary.json`` by rank 0."""
    model, strategy, samples_per_step = run.model, run.strategy, run.samples_per_step
    trained = (end - run.start) * samples_per_step
    run_time = run.elapsed - run.start_elapsed
    val_loss = run.val_loss
    if end <= run.start:  # resumed at its end, its summary lost: rebuild it from the checkpoint
        val_loss = evaluate(model, run.data, run.cfg, run.device)
        trained, run_time = end * samples_per_step, run.elapsed
    summary = {
        "algo": run.cfg.algo,
        "world_size": run.world,
        "shard_within": run.cfg.shard_within,
        "exchange": run.cfg.exchange if hasattr(strategy.optimizer, "compressing") else None,
        "steps": end,
        "samples": end * samples_per_step,
        "parameters": model.num_parameters(),
        "start": run.begins,
        "inner_state": run.cfg.inner_state(),
        "final_val_loss": val_loss,
        "final_val_ppl": math.exp(min(val_loss, 50.0)),
        "train_time_s": run.elapsed,
        "samples_per_s": trained / run_time if run_time > 0 else float("nan"),
        "comm_bytes": COUNTER.wire_bytes_excluding(TRAINER_OPS),
        "comm_by_op": COUNTER.snapshot(),
        # in optimizer steps (trainer steps unless some were skipped); None: never compressed
        "freeze_step": strategy.optimizer.freeze_step
        if getattr(strategy.optimizer, "compressing", False)
        else None,
        # 1-bit optimizers: compressed steps the step bound shortened (None: no bound)
        "bounded_steps": getattr(strategy.optimizer, "bounded_steps", None),
        "param_sha256": parameter_digest(model),
        "out_dir": str(run.out_dir),
    }
    if run.rank == 0:
        atomic_write_text(run.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _rehearse_buckets(
    strategy: Any, data: TextData, cfg: TrainConfig, start: int, device: torch.device
) -> None:
    """Let a resumed run's DDP rebuild its gradient buckets before step ``start``.

    The uninterrupted run reduced step ``start`` in the buckets DDP rebuilt after its
    first step; a new DDP would reduce it in its initial layout, and with 3 or more ranks
    the allreduce then rounds differently and the runs part
    (:mod:`thinwire.comm.resumable_ddp`). One forward and backward pass on one sequence
    of the step's own batch, with nothing sent, rebuilds them alike; it changes no
    weight, gradient, random state or byte count.
    """
    ddp = strategy.model
    if not isinstance(ddp, ResumableDDP):
        return  # one process, or an algorithm without DDP: nothing to rebuild
    if strategy.batch is not None:
        x, y = strategy.batch(start)
    else:
        x, y = data.batch(data_offset(cfg) + start, cfg.batch_size, get_rank(), get_world_size())

    def forward_backward() -> None:
        _, loss = ddp(x[:1].to(device), y[:1].to(device))
        loss.backward()

    ddp.rehearse(forward_backward)


def _announce_stage(
    cfg: TrainConfig, opt: Any, done: int, samples_per_step: int, metrics: MetricsWriter
) -> None:
    """One metrics record when a 1-bit optimizer switches stage, and one line on rank 0
    when it starts compressing (the optimizer itself says why it went back to the
    warmup: a frozen variance gone stale, :mod:`thinwire.optim.stale`)."""
    if not opt.compressing:
        metrics.write({"step": done, "samples": done * samples_per_step, "event": "rewarm"})
        return
    rule = getattr(opt, "auto_freeze", None)
    why = rule.describe() if rule is not None else f"--freeze-step {opt.freeze_step}"
    record: dict[str, Any] = {
        "step": done,
        "samples": done * samples_per_step,
        "event": "freeze",
        "freeze_step": opt.freeze_step,
    }
    if rule is not None:
        record["freeze_reason"] = rule.reason
        if rule.history:
            record["statistics_change"] = rule.history[-1][1]
    metrics.write(record)
    if get_rank() == 0:
        print(
            f"thinwire: {cfg.algo}: {why}; 1-bit compression from step {opt.freeze_step + 1}",
            file=sys.stderr,
            flush=True,
        )


def _save(
    cfg: TrainConfig,
    out_dir: Path,
    step: int,
    rank: int,
    model: nn.Module,
    strategy: Any,
    elapsed: float,
    run_id: str | None,
) -> None:
    rank_state = {
        "rank": rank,
        "step": step,
        # a sharded run's optimizer state as this rank's plain shards
        "optimizer": local_state(strategy.optimizer.state_dict()),
        "strategy": strategy.state_dict() if strategy.state_dict is not None else None,
        "rng": torch.get_rng_state(),
        "bytes": COUNTER.snapshot(),
        "elapsed_s": elapsed,
    }
    # The whole model, also when it is sharded (gathered on every rank of an island).
    whole = full_state_dict(model) if rank == 0 or cfg.shard_within > 1 else None
    model_state = whole if rank == 0 else None
    ckpt.save_checkpoint(out_dir, step, rank, model_state, rank_state, run_id)
    if rank == 0:  # the run's own checkpoint supersedes its pretraining's save
        pretrain_checkpoint.discard(out_dir)
