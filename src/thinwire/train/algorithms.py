"""Training algorithms the trainer can run, by name.

An algorithm is a factory ``make(model, cfg) -> Strategy`` called on every rank after the
process group exists. The :class:`Strategy` tells the trainer which module to run
forward/backward on (the model itself, or a DDP wrapper), which optimizer to step, and
optional hooks. Everything it communicates goes through thinwire's collectives, so the
bytes appear in the metrics.

Factories are referenced as ``"module:function"`` strings in :data:`ALGORITHMS` and
imported on first use, so choosing ``adamw`` never imports the Local-SGD runtime.

Algorithms that do not fit a synchronous step loop (asynchronous Local-SGD, where one
rank is a parameter server) are listed in :data:`RUNNERS` instead: ``run(cfg) -> dict``
replaces the whole trainer loop on every rank and returns the summary on rank 0.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.comm.allreduce import allreduce_hook
from thinwire.comm.launch import world_size
from thinwire.comm.resumable_ddp import ResumableDDP
from thinwire.errors import ConfigError
from thinwire.train.config import TrainConfig

__all__ = [
    "ALGORITHMS",
    "DEFAULT_LR",
    "RUNNERS",
    "TRAINED_LR",
    "Strategy",
    "algorithm_names",
    "check_config",
    "default_lr",
    "get_runner",
    "make_strategy",
]


@dataclass
class Strategy:
    """How one algorithm trains: what to call forward on, what to step, what to save."""

    model: nn.Module
    """The module forward/backward runs through (the raw model or a DDP wrapper)."""
    optimizer: torch.optim.Optimizer
    """Stepped once per training step; the trainer sets its learning rate each step."""
    after_step: Callable[[int], None] | None = None
    """Called with the number of completed steps after each optimizer step."""
    state_dict: Callable[[], dict[str, Any]] | None = None
    """Extra per-rank state to checkpoint beside the optimizer's (e.g. an outer optimizer)."""
    load_state_dict: Callable[[dict[str, Any]], None] | None = None
    """Inverse of :attr:`state_dict`."""
    metrics: Callable[[], dict[str, float]] | None = None
    """Algorithm-specific numbers to log with each metric record (e.g. trust ratios)."""
    scale_lr: bool = True
    """Whether the trainer's warmup+cosine schedule drives ``optimizer``'s learning rate."""
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    """This rank's batch of a step, replacing the trainer's slice of the global batch."""
    lr_at: Callable[[int], float] | None = None
    """The peak-scaled learning rate of a step, replacing the trainer's global schedule."""


def _ddp_adamw(
    model: nn.Module,
    cfg: TrainConfig,
    hook: Any = allreduce_hook,
    state: Any = None,
    bucket_cap_mb: float | None = None,
) -> Strategy:
    """AdamW on a DDP-wrapped model whose gradients travel through ``hook``."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    if world_size() == 1:
        return Strategy(model=model, optimizer=opt)
    # ResumableDDP: a resumed run rebuilds its buckets before its first step, as the
    # uninterrupted run did after its first (the trainer's _rehearse_buckets).
    cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = ResumableDDP(model, **cap)
    ddp.register_comm_hook(state, hook)
    return Strategy(model=ddp, optimizer=opt)


def _adamw(model: nn.Module, cfg: TrainConfig) -> Strategy:
    """Data parallel baseline: DDP's gradient allreduce (fp32, accounted) and AdamW."""
    return _ddp_adamw(model, cfg)


def _lamb_metrics(opt: Any) -> Callable[[], dict[str, float]]:
    """Trust-ratio summary and skipped steps, for the metric records."""

    def metrics() -> dict[str, float]:
        coeffs = [c[0] if isinstance(c, tuple) else c for c in opt.get_lamb_coeffs()]
        out: dict[str, float] = {"skipped_steps": opt.skipped_steps}
        if coeffs:
            out |= {
                "trust_ratio_min": min(coeffs),
                "trust_ratio_mean": sum(coeffs) / len(coeffs),
                "trust_ratio_max": max(coeffs),
            }
        return out | _stage_metrics(opt)

    return metrics


def _stage_metrics(opt: Any) -> dict[str, float]:
    """Where a 1-bit optimizer stands: compressing yet, whether its 1-bit collective has
    finished tuning itself, and the last measured change of its second moment while the
    automatic freeze watches it."""
    if not hasattr(opt, "compressing"):
        return {}
    out: dict[str, float] = {"compressing": int(opt.compressing)}
    if getattr(opt, "onebit_tuned", None) is not None:
        out["onebit_tuned"] = int(opt.onebit_tuned)
    if getattr(opt, "auto_freeze", None) is not None and not opt.compressing:
        out |= {f"{name}_change": value for name, value in opt.freeze_signals.items()}
    return out


_DDP_HAS_INIT_SYNC = "init_sync" in inspect.signature(DDP.__init__).parameters


def _under_ddp(model: nn.Module, opt: Any, cfg: TrainConfig, default_dtype: str) -> nn.Module:
    """The module to train through: a DDP wrapper whose hook averages the gradients while
    ``opt`` needs them (bucket by bucket, during the backward pass, as ``cfg.grad_dtype``),
    or the model itself in one process."""
    if world_size() == 1:
        return model
    from thinwire.compress.cast import WIRE_DTYPES

    # The trainer and the optimizer have broadcast rank 0's weights already (accounted);
    # DDP's own start-up broadcast would send them a third time, off the ledger. (torch
    # before 2.6 has no init_sync and always broadcasts.)
    skip_sync = {"init_sync": False} if _DDP_HAS_INIT_SYNC else {}
    ddp = ResumableDDP(model, **skip_sync)  # see _ddp_adamw
    opt.register_ddp(ddp, WIRE_DTYPES[cfg.grad_dtype or default_dtype])
    return ddp


def _train_through(
    model: nn.Module, opt: Any, cfg: TrainConfig, default_dtype: str, replicas: Any
) -> nn.Module:
    """The module of an optimizer that averages across ranks: ``model`` under DDP, or
    ``model`` itself when it is sharded and ``opt`` averages across the ``replicas``."""
    if replicas is None:
        return _under_ddp(model, opt, cfg, default_dtype)
    from thinwire.compress.cast import WIRE_DTYPES

    opt.set_grad_wire_dtype(WIRE_DTYPES[cfg.grad_dtype or default_dtype])
    return model


def _across(replicas: Any) -> dict[str, Any]:
    """``process_group`` for an optimizer on FSDP2 shards (:mod:`thinwire.train.sharding`)."""
    return {} if replicas is None else {"process_group": replicas}


def _lamb(model: nn.Module, cfg: TrainConfig, replicas: Any = None) -> Strategy:
    """LAMB; DDP averages the gradients during the backward pass (fp32 by default), or
    LAMB averages each shard across the islands (``replicas``)."""
    from thinwire.optim import Lamb

    opt = Lamb(
        model.parameters(),
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        **_across(replicas),
    )
    return Strategy(
        model=_train_through(model, opt, cfg, "fp32", replicas),
        optimizer=opt,
        metrics=_lamb_metrics(opt),
    )


def _precondition(cfg: TrainConfig) -> dict[str, bool]:
    """``precondition`` for the 1-bit optimizers when the run sets it, else their default."""
    return {} if cfg.precondition is None else {"precondition": cfg.precondition}


def _onebit_adam(model: nn.Module, cfg: TrainConfig, replicas: Any = None) -> Strategy:
    from thinwire.optim import OneBitAdam

    opt = OneBitAdam(
        model.parameters(),
        lr=cfg.lr,
        freeze_step=cfg.freeze_rule(),
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        bias_correction=cfg.bias_correction,
        exchange=cfg.exchange,
        **_precondition(cfg),
        **_across(replicas),
    )
    return Strategy(
        model=_train_through(model, opt, cfg, "bf16", replicas),
        optimizer=opt,
        metrics=lambda: {"skipped_steps": opt.skipped_steps} | _stage_metrics(opt),
    )


def _onebit_lamb(model: nn.Module, cfg: TrainConfig, replicas: Any = None) -> Strategy:
    from thinwire.optim import OneBitLamb

    opt = OneBitLamb(
        model.parameters(),
        lr=cfg.lr,
        freeze_step=cfg.freeze_rule(),
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        bias_correction=cfg.bias_correction,
        exchange=cfg.exchange,
        **_precondition(cfg),
        **_across(replicas),
    )
    return Strategy(
        model=_train_through(model, opt, cfg, "bf16", replicas),
        optimizer=opt,
        metrics=_lamb_metrics(opt),
    )


def _adamw_with_hook(kind: str) -> Callable[[nn.Module, TrainConfig], Strategy]:
    """DDP+AdamW with one of PyTorch's own compression hooks: the peers a PyTorch user
    would reach for (fp16 casting; PowerSGD of rank ``cfg.powersgd_rank``, default 4)."""

    def make(model: nn.Module, cfg: TrainConfig) -> Strategy:
        from thinwire.comm.peer_hooks import fp16_hook, make_powersgd_state, powersgd_hook
        from thinwire.comm.powersgd_state import (
            TrackedPowerSGD,
            load_powersgd_state_dict,
            powersgd_state_dict,
        )

        if kind == "fp16":
            return _ddp_adamw(model, cfg, fp16_hook)
        state = TrackedPowerSGD(
            make_powersgd_state(rank=cfg.powersgd_rank, start_iter=cfg.powersgd_start),
            model,
        )
        # PowerSGD chains allreduces in future callbacks; on gloo, callbacks of different
        # buckets may issue theirs in different orders on different ranks (a collective
        # mismatch), so the model's gradients go in one bucket there.
        one_bucket = 1024.0 if next(model.parameters()).device.type == "cpu" else None
        strategy = _ddp_adamw(model, cfg, powersgd_hook, state, bucket_cap_mb=one_bucket)
        # The hook's residuals, factors and step count are part of an exact resume.
        device = next(model.parameters()).device
        strategy.state_dict = lambda: powersgd_state_dict(state)
        strategy.load_state_dict = lambda saved: load_powersgd_state_dict(state, saved, device)
        return strategy

    return make


def _hook_warmup(cfg: TrainConfig) -> int:
    """Plain-allreduce steps before the 1-bit hook compresses: a fixed ``--freeze-step``,
    else (``auto``: a gradient hook has no second moment to watch) the learning-rate
    warmup, where the earliest, largest gradients would leave the biggest residuals."""
    if isinstance(cfg.freeze_step, int):
        return cfg.freeze_step
    return max(1, cfg.warmup_steps)


def _adamw_onebit(overlap: bool) -> Callable[[nn.Module, TrainConfig], Strategy]:
    """DDP+AdamW with thinwire's 1-bit comm hook (:mod:`thinwire.comm.onebit_hook`): fp32
    allreduce for the 1-bit optimizers' freeze step, then 1-bit buckets. Buckets of a
    quarter of the gradient size (DDP's 25 MB would put a small model in one bucket, with
    nothing to overlap); ``overlap=False`` runs each bucket inside backward instead."""

    def make(model: nn.Module, cfg: TrainConfig) -> Strategy:
        from thinwire.comm.onebit_hook import OneBitHookState, onebit_hook

        state = OneBitHookState(warmup_steps=_hook_warmup(cfg), overlap=overlap)
        grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        strategy = _ddp_adamw(model, cfg, onebit_hook, state, bucket_cap_mb=grad_mb / 4)
        strategy.state_dict, strategy.load_state_dict = state.state_dict, state.load_state_dict
        return strategy

    return make


ALGORITHMS: dict[str, tuple[str | Callable[[nn.Module, TrainConfig], Strategy], str]] = {
    "adamw": (_adamw, "PyTorch DDP (fp32 gradient allreduce) with AdamW: the baseline"),
    "adamw-fp16": (_adamw_with_hook("fp16"), "DDP+AdamW with PyTorch's fp16 compression hook"),
    "adamw-powersgd": (
        _adamw_with_hook("powersgd"),
        "DDP+AdamW with PyTorch's PowerSGD hook (rank 4)",
    ),
    "adamw-onebit": (
        _adamw_onebit(overlap=True),
        "DDP+AdamW with thinwire's 1-bit comm hook, overlapped with backward",
    ),
    "adamw-onebit-sync": (
        _adamw_onebit(overlap=False),
        "the same, each bucket's collective run inside backward (no overlap)",
    ),
    "lamb": (_lamb, "LAMB, fp32 gradient allreduce overlapped with the backward pass"),
    "onebit-adam": (
        _onebit_adam,
        "1-bit Adam: bf16 warmup until the variance settles, then 1-bit compressed momentum",
    ),
    "onebit-lamb": (
        _onebit_lamb,
        "1-bit LAMB: bf16 warmup until the variance settles, then 1-bit compressed momentum",
    ),
    "diloco": (
        "thinwire.train.diloco_strategy:diloco_strategy",
        "synchronous DiLoCo: H local AdamW steps, then one averaged outer Nesterov step",
    ),
}
"""name -> (factory or ``"module:function"``, one-line description)."""

DEFAULT_LR: dict[str, float] = {
    "adamw": 2e-3,
    "adamw-fp16": 2e-3,
    "adamw-powersgd": 2e-3,
    "adamw-onebit": 2e-3,  # adamw's, not swept
    "adamw-onebit-sync": 2e-3,
    "lamb": 2e-2,
    "onebit-lamb": 2e-2,
    "onebit-adam": 4e-3,
}
"""Peak learning rate ``thinwire train`` uses when ``--lr`` is not given: the best of a
short sweep on the tiny preset, 4 workers x 32 sequences (docs/results/optimizers.md,
"Optimizers"). LAMB's trust ratio makes its step relative to the weight norm, hence ~10x
Adam's. Algorithms not listed use :attr:`TrainConfig.lr`'s default."""


TRAINED_LR: dict[str, float] = {
    "lamb": 1e-2,
    "onebit-lamb": 1e-2,
}
"""Peak learning rate when the run starts from a trained model (``--pretrain-steps`` or
``--init-from``), where it differs from :data:`DEFAULT_LR`. Measured on the tiny preset,
4 workers x 16 sequences, 1,000 steps of AdamW then 3,000 steps (docs/results/
optimizers.md, "Long runs from a trained model"): LAMB at 0.02 trained to 1.79 by step
900, then climbed to 2.13 by step 1,600 as its trust ratios hit the clamp; on the tuning
seed 0.01 ended at 1.5417 and 0.005 at 1.5570. 1-bit LAMB takes LAMB's lr."""


def default_lr(algo: str, trained: bool = False) -> float:
    """The tuned default peak learning rate of ``algo`` (see :data:`DEFAULT_LR`), or of
    a run that starts from a trained model (:data:`TRAINED_LR`)."""
    if trained and algo in TRAINED_LR:
        return TRAINED_LR[algo]
    return DEFAULT_LR.get(algo, TrainConfig.lr)


RUNNERS: dict[str, tuple[str, str]] = {
    "async-diloco": (
        "thinwire.train.async_task:run",
        "asynchronous Local-SGD: rank 0 serves, ranks 1.. train (--outer dn|nesterov, --dylu)",
    ),
}
"""name -> (``"module:function"`` taking a TrainConfig, one-line description)."""


def algorithm_names() -> list[str]:
    return sorted([*ALGORITHMS, *RUNNERS])


def _resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, _, func = ref.partition(":")
    return getattr(importlib.import_module(module), func)


def check_algorithm(name: str) -> None:
    if name not in ALGORITHMS and name not in RUNNERS:
        raise ConfigError(
            f"unknown algorithm {name!r}; valid algorithms: {', '.join(algorithm_names())}"
        )


def check_config(cfg: TrainConfig, world: int) -> None:
    """Every bad setting of ``cfg`` for its algorithm on ``world`` ranks, as a one-line
    :class:`ConfigError`, before any process starts."""
    cfg.validate()
    check_algorithm(cfg.algo)
    from thinwire.localsgd.algorithm.pretrain import Start
    from thinwire.train.sharding import check_sharding

    check_sharding(cfg, world)

    Start(pretrain_steps=cfg.pretrain_steps or 0, init_from=cfg.init_from)  # checks them
    if cfg.algo == "diloco":
        from thinwire.localsgd.algorithm.diloco import COMPRESS_CHOICES
        from thinwire.localsgd.algorithm.methods import TUNED
        from thinwire.localsgd.algorithm.outer import check_outer_args
        from thinwire.localsgd.algorithm.shards import SAMPLING_CHOICES

        cfg.resolved_inner_momentum()
        check_outer_args(
            TUNED["sync"].outer_lr if cfg.outer_lr is None else cfg.outer_lr,
            TUNED["sync"].outer_momentum if cfg.outer_momentum is None else cfg.outer_momentum,
        )
        if cfg.shard_sampling not in (None, *SAMPLING_CHOICES):
            raise ConfigError(
                f"unknown shard sampling {cfg.shard_sampling!r}; choose one of {SAMPLING_CHOICES}"
            )
        if cfg.streaming() or not cfg.error_feedback:  # --no-error-feedback needs a quantizer
            cfg.check_streaming_settings()
        elif cfg.compress not in COMPRESS_CHOICES:
            raise ConfigError(
                f"unknown compression {cfg.compress!r}; choose one of {COMPRESS_CHOICES}"
            )
    elif cfg.algo == "async-diloco":
        from thinwire.train.async_task import check_async_config

        check_async_config(cfg, (world - 1) // cfg.shard_within)


def make_strategy(model: nn.Module, cfg: TrainConfig, replicas: Any = None) -> Strategy:
    """``cfg.algo``'s strategy for ``model``; with ``replicas`` (a sharded model's group
    across islands, :mod:`thinwire.train.sharding`) its optimizer averages over them."""
    check_algorithm(cfg.algo)
    make = _resolve(ALGORITHMS[cfg.algo][0])
    return make(model, cfg) if replicas is None else make(model, cfg, replicas=replicas)


def get_runner(name: str) -> Callable[[TrainConfig], dict[str, Any]] | None:
    """The custom runner of ``name``, or None when it runs in the standard step loop."""
    check_algorithm(name)
    return _resolve(RUNNERS[name][0]) if name in RUNNERS else None
