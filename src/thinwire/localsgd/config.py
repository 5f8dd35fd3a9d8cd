"""Every knob of asynchronous Local-SGD, in one dataclass; each field's docstring is its
tuning guide. The multi-process runtime (:func:`thinwire.localsgd.run_async`), a rejoining
worker (:func:`thinwire.localsgd.rejoin_async`) and the simulator
(:func:`thinwire.localsgd.simulate`) all read this one :class:`AsyncConfig`, so a
setting means the same everywhere and its default is written once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import CODECS
from thinwire.localsgd.algorithm.inner_state import resolve_inner_momentum
from thinwire.localsgd.algorithm.methods import TUNED, method_of
from thinwire.localsgd.algorithm.pretrain import Start
from thinwire.localsgd.algorithm.push_guard import PushGuard
from thinwire.localsgd.algorithm.server_core import OUTER_CHOICES, STALENESS_CHOICES
from thinwire.localsgd.algorithm.shards import SAMPLING_CHOICES

__all__ = ["COMPRESS", "AsyncConfig"]

COMPRESS: dict[str, torch.dtype] = CODECS
"""Payload dtype of each :attr:`AsyncConfig.compress` choice (uint8: 1-bit)."""


@dataclass
class AsyncConfig:
    """One asynchronous Local-SGD run: rank 0 serves, ranks 1..W train.

    Step counts (``steps``, ``eval_interval``, ``checkpoint_interval``) are inner steps
    *per worker*; the server counts them summed over the W workers.
    """

    # --- budget and rounds --------------------------------------------------------------
    steps: int = 300
    """Inner-step budget per worker. The run ends after ``steps * W`` inner steps, however
    they are spread over the workers: the same compute as synchronous DiLoCo's ``steps``."""
    local_steps: int = 10
    """H, inner steps per round (of the fastest worker under DyLU). Larger H sends fewer
    bytes and lets replicas drift further. The outer Nesterov needs tens of rounds to pay
    off: 10 gives the default 300-step run 30 of them (at H = 20 a 100-step sync run sat
    at the byte-frequency loss); the paper uses 50 on runs of thousands of steps."""

    # --- the outer optimizer on the server ----------------------------------------------
    outer: str = "dn"
    """``dn``: Delayed Nesterov, whose momentum moves once per N arrivals so that W
    arrivals equal one DiLoCo step. ``nesterov``: momentum on every arrival, the paper's
    naive baseline; with momentum it needs a far smaller lr and still stalls, so its
    tuned setting is momentum 0 (per-arrival SGD).
    ``buffer``: the paper's asynchronous buffer, one Nesterov step per N arrivals with
    theta standing still in between."""
    outer_lr: float | None = None
    """Outer learning rate; None: the tuned value of the method this config runs
    (:data:`thinwire.localsgd.algorithm.methods.TUNED`: 0.2 for sync, 0.3 for ``dn``, ``buffer`` and
    naive ``nesterov``, 0.5 for DN+DyLU; naive and DN+DyLU with momentum 0; the module
    docstring of :mod:`thinwire.localsgd.algorithm.methods` gives the sweep). Lower it if the loss
    jumps at each outer step."""
    outer_momentum: float | None = None
    """Outer Nesterov momentum beta, in ``[0, 1)``; None: the method's tuned value. 0 is
    plain SGD on the pseudo-gradients (with sync and ``outer_lr=1``: plain averaging)."""
    c: float = 0.0
    """Delayed Nesterov's c in ``[0, 1/N]``: the share of the momentum applied on every
    arrival instead of at the N-th. 0 (the paper's) delays it fully; ``1/(2N)`` smooths
    the trajectory when workers arrive in bursts."""
    staleness: str = "none"
    """``poly`` scales each pseudo-gradient by ``(1 + tau)^-1/2``, tau its staleness in
    outer updates (the paper's "Poly" baseline); ``none`` applies it as it is."""
    max_staleness: int | None = None
    """Drop pseudo-gradients staler than this many outer updates (the paper's
    "PolyThres" uses 10); their inner steps count as spent. None: never drop."""

    # --- who gets what, and when --------------------------------------------------------
    dylu: bool = False
    """Dynamic Local Updates: worker w runs ``H_w = max(1, floor(v_w / max v * H))``
    steps, v its measured speed, so every round takes about the fastest worker's time.
    Use it when machines differ in speed."""
    dylu_ema: float = 0.5
    """Weight of the old speed when a worker reports a new one, in ``[0, 1)``. 0.5 follows
    a machine that slowed down within two or three rounds; closer to 1 is steadier."""
    speeds: tuple[float, ...] | None = None
    """Declared seconds per inner step of each worker (one per worker), so that DyLU sizes
    even the first round; measurements then refine them. None: measured. Only ratios
    matter. The simulator declares its clock's speeds unless told to calibrate."""
    calibration_steps: int = 3
    """Under DyLU with undeclared speeds, a worker's first round is this many steps (at
    most H) and times its speed; 0 makes it a full H. A full first round from the slowest
    worker lands many updates late: calibrating removed most of DN+DyLU's gap to sync."""
    min_local_steps: int = 1
    """DyLU's floor on a round, in inner steps. 1 is the paper's formula; the paper's
    notebook uses 5, which the ``fresh`` inner-state rule needs (its 1-step rounds are
    sign steps)."""
    grace_s: float = 0.0
    """Seconds the server waits after an arrival for more, applying all of them before
    anyone restarts from the same theta. 0 answers at once; with DyLU and the per-round
    inner-momentum restart no grace period is needed."""
    sync: bool = False
    """Every round waits for all live workers: with ``outer="dn"``, ``c = 0`` and no
    DyLU this is synchronous DiLoCo through the server, the baseline to compare with."""
    shards: int | None = None
    """Data shards (``None``: one per worker). A worker takes the free shard with the least
    progress. With one per worker each keeps its own and fast workers see their data more
    often; 2-4 per worker let the least-progress rule balance uneven workers."""
    shard_sampling: str = "least-progress"
    """How a round's shard is chosen: ``least-progress`` (the free shard furthest behind
    its plan) or ``paper`` (the paper's Eq. 2: a random shard among those behind their
    share, non-exclusive). See :mod:`thinwire.localsgd.algorithm.shards`."""
    seed: int = 0
    """Seeds the server's random choices (``paper`` shard sampling)."""

    # --- the inner optimizer on each worker ---------------------------------------------
    inner_momentum: str | None = None
    """The inner-state rule, the same for every method: ``keep`` (the inner optimizer's
    state persists across rounds, DiLoCo's rule), ``round`` (the first moment restarts
    every round), ``restart`` (it restarts, bias-corrected on the round's clock) or
    ``fresh`` (a new optimizer every round). None: ``restart``, the best for every method
    in the ablation. See :mod:`thinwire.localsgd.algorithm.inner_state`."""
    warmup_steps: int = 20
    """Inner lr warmup, in steps of a shard's own clock. The inner optimizer's lr is the
    peak; it then decays by cosine over the shard's planned steps (``steps * W /
    shards``): check the warmup against that length if the loss stalls early."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``peak * min_lr_ratio``; the floor keeps rounds useful
    after a shard ran past its plan. ``warmup_steps=0, min_lr_ratio=1`` keeps the inner
    optimizer's lr constant."""
    grad_clip: float = 0.0
    """Clip each inner step's global gradient norm to this value; 0 disables clipping."""

    # --- where the run starts -----------------------------------------------------------
    pretrain_steps: int = 0
    """Steps of ordinary synchronous data-parallel training (over the W shards, inner
    optimizer and ``warmup_steps``) before Local-SGD begins; Local-SGD's shards then read
    on after them. The regime Local-SGD is for, and the asynchronous paper's: its methods
    start from 24k ordinary steps. 0: from scratch (or ``init_from``). See
    :mod:`thinwire.localsgd.algorithm.pretrain`."""
    init_from: str | None = None
    """Start from this model state file (``torch.save(model.state_dict())``, or a dict
    with it under ``"model"``) instead; not together with ``pretrain_steps``."""

    # --- the wire -----------------------------------------------------------------------
    compress: str = "none"
    """Push codec: ``none`` (fp32), ``fp16`` or ``bf16`` (half the bytes), or ``onebit``
    (signs and one scale, 32x fewer bytes, with per-worker error feedback). See
    :mod:`thinwire.localsgd.algorithm.compression`."""
    compress_pull: str = "none"
    """Pull codec: ``none`` sends theta whole in fp32; ``fp16``, ``bf16`` or ``onebit``
    send the difference to the worker's own copy, which both sides update identically
    (the worker's view stays exact; what a pull leaves out goes with the next one)."""
    connect_timeout_s: float = 120.0
    """Seconds opening a worker's link may take (its hello, the server's answer). The
    server does nothing else meanwhile, so keep it short; raise it on slow networks."""
    link_timeout_s: float = 1800.0
    """Seconds any later send or receive may take, including a worker's wait for its next
    round: keep it above the slowest round (sync mode waits for the slowest worker)."""

    # --- faults -------------------------------------------------------------------------
    dead_after_s: float = 10.0
    """Heartbeat silence after which the server drops a worker as dead. Heartbeats come
    from a background thread, so this is independent of the round length; raise it on
    overloaded hosts where a process may stall for seconds."""
    heartbeat_s: float = 0.5
    """Seconds between a worker's heartbeats; well below ``dead_after_s``."""
    hung_after_s: float = 600.0
    """A round in flight longer than ``max(hung_after_s, hung_after_factor * its expected
    time)`` is presumed hung; the worker is dropped and its round handed out again."""
    hung_after_factor: float = 10.0
    """See :attr:`hung_after_s`."""
    max_restarts: int = 3
    """Rounds a worker may fail (an exception: out of memory, a bad batch) before it gives
    up; after each it rebuilds its inner optimizer and says hello again."""
    slowdown: tuple[float, ...] | None = None
    """Per-worker factors >= 1 (one per worker) that stretch each inner step by sleeping,
    to emulate slower machines on one host. ``None``: full speed."""

    # --- admission and pushes (security; see docs/security-async.md) ---------------------
    token_file: str | None = None
    """A file holding the run's token (at least 16 characters; give every rank and every
    rejoining worker the same). ``None``: ``THINWIRE_RUN_TOKEN``, else the file
    ``THINWIRE_RUN_TOKEN_FILE`` names, else rank 0 generates one, hands it to the launched
    workers, and keeps it in ``checkpoint_dir/run.token`` (mode 0600) while the run is
    served. No worker is admitted and no rejoin accepted without it."""
    bind_addr: str | None = None
    """The address the server's store and links listen on, and only there. ``None``:
    ``THINWIRE_BIND_ADDR``, else ``MASTER_ADDR``. Name the interface address the workers
    reach the server by (e.g. the VPN's)."""
    max_push_ratio: float = 20.0
    """The server refuses a push whose norm per inner step at full lr is over this many
    times the median of the last ``push_history`` accepted pushes; 0 turns the bound off
    (NaN, inf and misshapen pushes are refused regardless). Healthy pushes measured on the
    tiny GPT stayed below 9x (``tools/push_norms.py``); lower it to react to a worker going
    astray sooner, at the risk of refusing (and redoing) healthy rounds."""
    push_history: int = 32
    """Accepted pushes the median of :attr:`max_push_ratio` is taken over."""
    push_warmup: int = 3
    """Accepted pushes before the norm bound applies (there is no median before)."""
    max_refused_pushes: int = 3
    """Refused pushes after which the server stops the worker that sent them: this many
    in a row, or this many in all of the kinds an honest worker never sends (a wrong
    shape, steps or timing, another epoch, a future version, a duplicate), which a good
    push in between does not forgive. A duplicate, a future version or another epoch
    stops the worker at once."""

    # --- evaluation and checkpoints -----------------------------------------------------
    eval_interval: int = 0
    """Inner steps per worker between evaluations on the server (0: only at the start and
    the end). The server answers no worker while it evaluates: keep evaluation cheap."""
    checkpoint_dir: str | None = None
    """Where the server keeps ``localsgd_server.pt`` (theta, outer state, shard clocks,
    speeds); ``None``: no checkpoints."""
    checkpoint_interval: int = 0
    """Inner steps per worker between checkpoints (0: only at the end)."""
    resume: bool = False
    """Continue from ``checkpoint_dir``'s checkpoint, in a new server epoch: updates
    computed from the old server's theta are rejected."""
    stop_after: int | None = None
    """Stop this launch after this many inner steps per worker, with a checkpoint;
    ``resume`` continues to ``steps`` (the lr schedules are planned for ``steps``)."""

    def validate(self, workers: int | None = None) -> None:
        """Raise a one-line :class:`ConfigError` for the first impossible setting.

        ``workers``: W when known (rank 0 serves, so W is the world size minus one);
        it bounds ``c`` and sizes ``slowdown``.
        """
        if workers is not None and workers < 1:
            raise ConfigError(
                "asynchronous Local-SGD needs at least 2 ranks: rank 0 is the server, "
                "ranks 1.. are workers"
            )
        for name in ("steps", "local_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "eval_interval",
            "checkpoint_interval",
            "max_restarts",
            "calibration_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.outer not in OUTER_CHOICES:
            raise ConfigError(
                f"unknown outer optimizer {self.outer!r}; choose one of {OUTER_CHOICES}"
            )
        lr, momentum = self.resolved_outer_lr(), self.resolved_outer_momentum()
        if not (lr > 0 and math.isfinite(lr)):
            raise ConfigError(f"outer lr must be a finite number > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"outer momentum must be in [0, 1), got {momentum}")
        self._check_paper_settings(workers)
        n = workers or 1
        if not 0.0 <= self.c <= 1.0 / n:
            raise ConfigError(
                f"Delayed Nesterov c must be in [0, 1/N] = [0, {1 / n:.4g}], got {self.c}"
            )
        if self.sync and (
            self.outer != "dn" or self.dylu or self.c != 0 or self.staleness != "none"
        ):
            raise ConfigError(
                "sync mode is synchronous DiLoCo: it needs outer dn with c = 0, no DyLU and "
                "no staleness rule"
            )
        if not 0.0 <= self.dylu_ema < 1.0:
            raise ConfigError(f"DyLU ema must be in [0, 1), got {self.dylu_ema}")
        if self.shards is not None and self.shards < 1:
            raise ConfigError(f"shards must be >= 1, got {self.shards}")
        self.resolved_inner_momentum()
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("compress", "compress_pull"):
            if getattr(self, name) not in CODECS:
                raise ConfigError(
                    f"{_flag(name)} must be one of {', '.join(CODECS)}, got {getattr(self, name)!r}"
                )
        self._check_seconds(workers)
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs the checkpoint_dir of the run to continue")
        self._check_admission()
        self.start()  # pretrain-steps and init-from

    def _check_admission(self) -> None:
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"stop-after must be >= 1, got {self.stop_after}")
        if self.stop_after is not None and not self.checkpoint_dir:
            raise ConfigError("stop_after needs a checkpoint_dir to keep the run in")
        ratio = self.max_push_ratio
        if not (ratio == 0 or (ratio > 1 and math.isfinite(ratio))):
            raise ConfigError(f"max_push_ratio must be 0 (off) or a number > 1, got {ratio}")
        for name in ("push_history", "push_warmup", "max_refused_pushes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.push_warmup > self.push_history:
            raise ConfigError(
                f"push_warmup ({self.push_warmup}) must not exceed push_history "
                f"({self.push_history})"
            )

    def _check_paper_settings(self, workers: int | None) -> None:
        if self.staleness not in STALENESS_CHOICES:
            raise ConfigError(
                f"unknown staleness rule {self.staleness!r}; choose one of "
                f"{', '.join(STALENESS_CHOICES)}"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max-staleness must be >= 0, got {self.max_staleness}")
        if self.min_local_steps < 1:
            raise ConfigError(f"min-local-steps must be >= 1, got {self.min_local_steps}")
        if self.shard_sampling not in SAMPLING_CHOICES:
            raise ConfigError(
                f"unknown shard sampling {self.shard_sampling!r}; choose one of "
                f"{', '.join(SAMPLING_CHOICES)}"
            )
        if self.speeds is not None:
            if workers is not None and len(self.speeds) != workers:
                raise ConfigError(
                    f"--speeds lists {len(self.speeds)} values but there are {workers} "
                    f"workers (one seconds-per-step value each)"
                )
            if any(not (s > 0 and math.isfinite(s)) for s in self.speeds):
                raise ConfigError(f"--speeds must be positive numbers, got {list(self.speeds)}")

    def _check_seconds(self, workers: int | None) -> None:
        for name in ("grace_s", "grad_clip"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        for name in (
            "connect_timeout_s",
            "link_timeout_s",
            "dead_after_s",
            "heartbeat_s",
            "hung_after_s",
            "hung_after_factor",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_s >= self.dead_after_s:
            raise ConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be below dead_after_s "
                f"({self.dead_after_s}), or live workers are declared dead"
            )
        if self.slowdown is not None:
            if workers is not None and len(self.slowdown) != workers:
                raise ConfigError(
                    f"--slowdown lists {len(self.slowdown)} factors but there are {workers} "
                    f"workers (ranks 1..{workers}; rank 0 is the server)"
                )
            if any(not (s >= 1.0 and math.isfinite(s)) for s in self.slowdown):
                raise ConfigError(f"--slowdown factors must be >= 1, got {list(self.slowdown)}")

    def push_guard(self) -> PushGuard:
        """The server's checks of every push, with this config's bound and lr schedule."""
        return PushGuard(
            self.max_push_ratio,
            self.push_history,
            self.push_warmup,
            self.max_refused_pushes,
            lr_warmup=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def start(self) -> Start:
        """Where this run starts (:class:`~thinwire.localsgd.algorithm.pretrain.Start`)."""
        return Start(
            pretrain_steps=self.pretrain_steps,
            init_from=self.init_from,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
        )

    def resolved_shards(self, workers: int) -> int:
        """The shard count of a run with ``workers`` workers."""
        return workers if self.shards is None else self.shards

    def resolved_inner_momentum(self) -> str:
        """``inner_momentum``, or its default (the same for every method)."""
        return resolve_inner_momentum(self.inner_momentum)

    @property
    def method(self) -> str:
        """The paper's method this config runs (see :mod:`thinwire.localsgd.algorithm.methods`)."""
        return method_of(self)

    def resolved_outer_lr(self) -> float:
        """``outer_lr``, or the tuned outer lr of :attr:`method`."""
        return TUNED[self.method].outer_lr if self.outer_lr is None else self.outer_lr

    def resolved_outer_momentum(self) -> float:
        """``outer_momentum``, or the tuned outer momentum of :attr:`method`."""
        if self.outer_momentum is None:
            return TUNED[self.method].outer_momentum
        return self.outer_momentum

    @property
    def push_dtype(self) -> torch.dtype:
        """The dtype pushes travel in (see :attr:`compress`; uint8 is 1-bit)."""
        return CODECS[self.compress]


def _flag(name: str) -> str:
    return name.replace("_", "-")
