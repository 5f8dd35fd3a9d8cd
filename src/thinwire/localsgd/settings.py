"""The settings of Local-SGD, defined once: :class:`LocalSGDSettings` (what synchronous
DiLoCo and asynchronous Local-SGD share) and :class:`AsyncSettings` (everything the
asynchronous runtime adds). Each field's docstring is its tuning guide.

They are sections, not copies: :class:`~thinwire.localsgd.config.AsyncConfig` is an
:class:`AsyncSettings` plus the run's budget, seed and checkpoints, and the example
trainer's ``TrainConfig`` is one too, so ``thinwire train --outer nesterov``, a config
file's ``outer = "nesterov"`` and ``AsyncConfig(outer="nesterov")`` set one field whose
default and meaning are written here alone. A new knob is a field here (and a flag, or
a place in the trainer's list of file-only settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from thinwire.compress.quantize import QUANT_KINDS
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import CODECS
from thinwire.localsgd.algorithm.inner_state import resolve_inner_momentum
from thinwire.localsgd.algorithm.methods import method_of, tuned
from thinwire.localsgd.algorithm.server_core import OUTER_CHOICES, STALENESS_CHOICES
from thinwire.localsgd.algorithm.shards import SAMPLING_CHOICES

__all__ = ["ASYNC_ONLY", "LOCAL_SGD", "STREAMING", "AsyncSettings", "LocalSGDSettings"]


@dataclass
class LocalSGDSettings:
    """What every Local-SGD run reads, synchronous (``--algo diloco``) or not: the round
    length, the outer step, the inner optimizer's state rule and the push codec."""

    local_steps: int = 10
    """H, inner steps per round (of the fastest worker under DyLU). Larger H sends fewer
    bytes and lets replicas drift further. The outer Nesterov needs tens of rounds to pay
    off: 10 gives the default 300-step run 30 of them (at H = 20 a 100-step sync run sat
    at the byte-frequency loss); the paper uses 50 on runs of thousands of steps."""
    outer_lr: float | None = None
    """Outer learning rate; None: the tuned value of the method this config runs
    (:data:`thinwire.localsgd.algorithm.methods.TUNED`: 0.2 for sync, 0.3 for ``dn``, ``buffer`` and
    naive ``nesterov``, 0.5 for DN+DyLU; naive and DN+DyLU with momentum 0; the module
    docstring of :mod:`thinwire.localsgd.algorithm.methods` gives the sweep). From a
    trained model (``pretrain_steps``, ``init_from``) DN+DyLU takes 0.3 with momentum 0.9
    instead, its best in the long tier (:data:`~thinwire.localsgd.algorithm.methods.TUNED_TRAINED`).
    Lower it if the loss jumps at each outer step."""
    outer_momentum: float | None = None
    """Outer Nesterov momentum beta, in ``[0, 1)``; None: the method's tuned value (from
    a trained model, as ``outer_lr`` says). 0 is plain SGD on the pseudo-gradients (with
    sync and ``outer_lr=1``: plain averaging)."""
    inner_momentum: str | None = None
    """The inner-state rule, the same for every method: ``keep`` (the inner optimizer's
    state persists across rounds, DiLoCo's rule), ``round`` (the first moment restarts
    every round), ``restart`` (it restarts, bias-corrected on the round's clock) or
    ``fresh`` (a new optimizer every round). None: ``keep`` when the run starts from a
    trained model (``pretrain_steps``, ``init_from``: there ``restart``'s full first steps
    cost DiLoCo 8-10%), ``restart`` from scratch (the best for every method in the short
    ablation). See :mod:`thinwire.localsgd.algorithm.inner_state`."""
    compress: str = "none"
    """Push codec: ``none`` (fp32), ``fp16`` or ``bf16`` (half the bytes), or ``onebit``
    (signs and one scale, 32x fewer bytes, with per-worker error feedback). See
    :mod:`thinwire.localsgd.algorithm.compression`. Streaming DiLoCo (below) also takes
    the block-scaled quantizers ``int8``, ``fp8`` and ``int4``; its ``onebit`` is the same
    sign code with an RMS scale per 256 elements (28x fewer bytes), through its quantized
    allreduce."""

    # --- Streaming DiLoCo: synchronous only (the trainer's ``--algo diloco`` and the
    # simulator's ``sync``); the asynchronous runtime refuses them ----------------------
    fragments: int = 1
    """Streaming DiLoCo's fragments. 1 (the default) syncs the whole model every H steps;
    P > 1 cuts it into P runs of consecutive parameters of about equal size whose syncs
    take turns, each fragment still every H steps, so a sync carries about 1/P of the
    model and the peak bandwidth drops P-fold at the same total bytes
    (:class:`thinwire.localsgd.StreamingDiLoCo`). Start with 2-5 (both within 1% of
    DiLoCo from a trained model, docs/results/localsgd.md); H must be at least P."""
    fragment_overlap: int = 0
    """Streaming DiLoCo: inner steps a fragment's exchange may take in the background
    before its average is applied (the paper's tau), below ``local_steps // fragments``.
    0 waits for it; 1-5 hide the network behind training when a sync takes less than
    that many steps."""
    fragment_alpha: float = 0.0
    """Streaming DiLoCo: how much of the local weights a fragment keeps when its new
    global weights arrive, in ``[0, 1)``. 0 replaces them (DiLoCo's rule) and drops the
    ``fragment_overlap`` steps taken meanwhile; 0.5, the paper's choice with an overlap,
    keeps half of them."""
    error_feedback: bool = True
    """Synchronous DiLoCo with a code that rounds (``compress`` ``int8``, ``fp8``,
    ``int4`` or ``onebit``, whole or in fragments): keep what rounding lost and send it
    with the (fragment's) next sync. Off (``--no-error-feedback``) is plain quantization,
    whose rounding is lost for good (the Streaming DiLoCo paper's, with fragments). Measured
    (docs/results/localsgd.md): level at int4 (mean +0.13% over 12 pairs of runs), better
    with it at ``onebit`` (4 of 5 pairs, mean 0.78%): leave it on."""

    def streaming(self) -> bool:
        """Whether these settings run Streaming DiLoCo: fragments, an overlap, a mixing
        alpha or a quantizer (the codecs that only it has)."""
        return (
            self.fragments > 1
            or self.fragment_overlap > 0
            or self.fragment_alpha > 0
            or self.compress in QUANT_KINDS
        )

    def whole_diloco(self) -> bool:
        """No fragments, overlap, alpha or quantizer: synchronous DiLoCo's own exchange
        (whatever its error-feedback switch)."""
        whole = (self.fragments, self.fragment_overlap, self.fragment_alpha) == (1, 0, 0.0)
        return whole and not self.streaming()

    def check_streaming_settings(self) -> None:
        """Streaming DiLoCo's settings here (``thinwire train --algo diloco`` and the
        simulator's ``sync`` check them before they start), as a one-line
        :class:`ConfigError`. Without fragments, an overlap, alpha or a quantizer the run
        is DiLoCo's own, and only the error-feedback switch concerns it (``onebit``'s
        1-bit allreduce turns it off as well)."""
        from thinwire.localsgd.algorithm.streaming import (
            check_error_feedback,
            check_streaming_args,
        )

        if self.whole_diloco():
            check_error_feedback(self.compress, self.error_feedback)
            return
        check_streaming_args(
            self.local_steps,
            self.fragments,
            self.fragment_overlap,
            self.fragment_alpha,
            self.compress,
            self.resolved_inner_momentum(),
            self.error_feedback,
        )

    def check_local_sgd(self, more_codecs: tuple[str, ...] = ()) -> None:
        """A one-line :class:`ConfigError` for the first impossible setting here.

        ``more_codecs``: codecs the caller's algorithm takes beside the pushes' own
        (synchronous DiLoCo's allreduce also takes the quantizers)."""
        if self.local_steps < 1:
            raise ConfigError(f"local-steps must be >= 1, got {self.local_steps}")
        self.resolved_inner_momentum()
        codecs = (*CODECS, *more_codecs)
        if self.compress not in codecs:
            hint = " (the quantizers are diloco's)" if self.compress in QUANT_KINDS else ""
            raise ConfigError(
                f"compress must be one of {', '.join(codecs)}, got {self.compress!r}{hint}"
            )

    def starts_trained(self) -> bool:
        """Whether the run starts from a trained model. A settings section has no start:
        the configs that run (``AsyncConfig``, the trainer's) answer from theirs."""
        return False

    def resolved_inner_momentum(self) -> str:
        """``inner_momentum``, or its default: ``keep`` from a trained model, ``restart``
        from scratch (the same for every method;
        :func:`~thinwire.localsgd.algorithm.inner_state.resolve_inner_momentum`), and
        ``keep`` for Streaming DiLoCo, whose rule acts per fragment (``restart`` has no
        per-fragment form)."""
        if self.inner_momentum is None and self.streaming():
            return "keep"
        return resolve_inner_momentum(self.inner_momentum, trained=self.starts_trained())


@dataclass
class AsyncSettings(LocalSGDSettings):
    """Everything asynchronous Local-SGD adds: the outer optimizer on the server, who
    trains what and when (DyLU, shards, sync mode), the pull codec, the runtime's
    deadlines and fault handling, and the admission of pushes."""

    # --- the outer optimizer on the server ---------------------------------------------
    outer: str = "dn"
    """``dn``: Delayed Nesterov, whose momentum moves once per N arrivals so that W
    arrivals equal one DiLoCo step. ``nesterov``: momentum on every arrival, the paper's
    naive baseline; with momentum it needs a far smaller lr and still stalls, so its
    tuned setting is momentum 0 (per-arrival SGD).
    ``buffer``: the paper's asynchronous buffer, one Nesterov step per N arrivals with
    theta standing still in between."""
    outer_momentum_warmup: int = 0
    """Arrivals over which the server's outer momentum ramps up linearly from 0 to
    ``outer_momentum`` (0: from the first). Measured in the long tier (tuning seed, DN +
    DyLU at (0.3, 0.9), 424 arrivals): none 1.5920, 40 arrivals 1.6024, 100 arrivals
    1.6172; it helped only the first evaluation, so leave it at 0 unless the first
    outer steps of your run set a trained model back. Synchronous DiLoCo's outer step
    does not read it."""
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

    # --- who gets what, and when -------------------------------------------------------
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

    # --- the wire ----------------------------------------------------------------------
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

    # --- faults ------------------------------------------------------------------------
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

    # --- admission and pushes (security; see docs/security-async.md) -------------------
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

    def check_async(self, workers: int | None = None, *, simulated: bool = False) -> None:
        """A one-line :class:`ConfigError` for the first impossible setting here.

        ``workers``: W when known; it bounds ``c`` and sizes ``slowdown`` and ``speeds``.
        ``simulated``: the settings of a simulated run, whose ``sync`` method may run
        Streaming DiLoCo (the asynchronous runtime refuses its settings).
        """
        self.check_local_sgd(QUANT_KINDS if simulated else ())
        self._check_streaming(simulated, workers)
        for name in ("max_restarts", "calibration_steps", "outer_momentum_warmup"):
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
        if self.compress_pull not in CODECS:
            raise ConfigError(
                f"compress-pull must be one of {', '.join(CODECS)}, got {self.compress_pull!r}"
            )
        self._check_seconds(workers)
        self._check_pushes()

    def _check_streaming(self, simulated: bool, workers: int | None) -> None:
        knobs = (self.fragments, self.fragment_overlap, self.fragment_alpha, self.error_feedback)
        if knobs == (1, 0, 0.0, True) and not self.streaming():
            return
        if not simulated:
            raise ConfigError(
                "Streaming DiLoCo (fragments, a fragment overlap or alpha, error feedback, "
                "the int8/fp8/int4 quantizers) is synchronous: train it with --algo diloco, "
                "or simulate it with the sync method (thinwire simulate --methods sync)"
            )
        if self.method != "sync" and self.whole_diloco():  # --no-error-feedback alone
            raise ConfigError(
                f"error feedback off is the sync method's (its 1-bit pushes), not "
                f"{self.method}'s: set it for sync alone (--sweep sync:error-feedback=false)"
            )
        if self.method != "sync":
            raise ConfigError(
                f"Streaming DiLoCo is synchronous: the simulator runs it as the sync method, "
                f"not {self.method} (set it for sync alone: --sweep sync:KEY=VALUE)"
            )
        self.check_streaming_settings()
        if self.whole_diloco():  # sync DiLoCo's 1-bit pushes with their feedback off
            return
        # What the server's sync has and Streaming DiLoCo has not: refused, not ignored.
        if self.compress_pull != "none":
            raise ConfigError(
                "Streaming DiLoCo has no pulls (the workers average among themselves): "
                "compress-pull must be none"
            )
        if self.outer_momentum_warmup:
            raise ConfigError("Streaming DiLoCo has no outer-momentum warmup: set it to 0")
        if self.shard_sampling != "least-progress":
            raise ConfigError(
                "Streaming DiLoCo's workers each train their own shard: no shard sampling "
                f"({self.shard_sampling!r})"
            )
        if workers is not None and self.resolved_shards(workers) != workers:
            raise ConfigError(
                f"Streaming DiLoCo's workers each train their own shard: shards must equal "
                f"the {workers} workers, got {self.shards}"
            )

    def _check_pushes(self) -> None:
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
        _check_per_worker(
            "speeds", self.speeds, workers, "values", "(one seconds-per-step value each)", 0.0
        )

    def _check_seconds(self, workers: int | None) -> None:
        if not (self.grace_s >= 0 and math.isfinite(self.grace_s)):
            raise ConfigError(f"grace_s must be a finite number >= 0, got {self.grace_s}")
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
        why = f"(ranks 1..{workers}; rank 0 is the server)"
        _check_per_worker("slowdown", self.slowdown, workers, "factors", why, 1.0)

    def resolved_shards(self, workers: int) -> int:
        """The shard count of a run with ``workers`` workers."""
        return workers if self.shards is None else self.shards

    @property
    def method(self) -> str:
        """The paper's method these settings run (see
        :mod:`thinwire.localsgd.algorithm.methods`)."""
        return method_of(self)

    def resolved_outer_lr(self) -> float:
        """``outer_lr``, or the tuned outer lr of :attr:`method`."""
        if self.outer_lr is None:
            return tuned(self.method, self.starts_trained()).outer_lr
        return self.outer_lr

    def resolved_outer_momentum(self) -> float:
        """``outer_momentum``, or the tuned outer momentum of :attr:`method`."""
        if self.outer_momentum is None:
            return tuned(self.method, self.starts_trained()).outer_momentum
        return self.outer_momentum

    @property
    def push_dtype(self) -> torch.dtype:
        """The dtype pushes travel in (see :attr:`compress`; uint8 is 1-bit)."""
        return CODECS[self.compress]


def _check_per_worker(
    name: str,
    values: tuple[float, ...] | None,
    workers: int | None,
    unit: str,
    why: str,
    floor: float,
) -> None:
    """``values`` (one per worker, when given) number the workers and are finite and
    above ``floor`` (0: positive; 1: at least 1, as slowdown factors are)."""
    if values is None:
        return
    if workers is not None and len(values) != workers:
        raise ConfigError(
            f"--{name} lists {len(values)} {unit} but there are {workers} workers {why}"
        )
    fits = (lambda v: v > 0) if floor == 0.0 else (lambda v: v >= floor)
    if any(not (fits(v) and math.isfinite(v)) for v in values):
        kind = "positive numbers" if floor == 0.0 else f">= {floor:g}"
        what = "must be" if floor == 0.0 else "factors must be"
        raise ConfigError(f"--{name} {what} {kind}, got {list(values)}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


LOCAL_SGD: tuple[str, ...] = tuple(f.name for f in fields(LocalSGDSettings))
"""The fields every Local-SGD run reads (synchronous DiLoCo too)."""
STREAMING = ("fragments", "fragment_overlap", "fragment_alpha", "error_feedback")
"""Streaming DiLoCo's fields: synchronous only (the trainer's ``--algo diloco`` and the
simulator's ``sync``)."""
ASYNC_ONLY: tuple[str, ...] = tuple(
    f.name for f in fields(AsyncSettings) if f.name not in LOCAL_SGD
)
"""The fields only asynchronous Local-SGD reads."""
