"""Configuration of a training run: one dataclass, one docstring per knob."""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from thinwire.comm.momentum_exchange import EXCHANGES
from thinwire.compress.cast import parse_cast
from thinwire.compress.quantize import QUANT_KINDS
from thinwire.errors import ConfigError
from thinwire.localsgd.settings import ASYNC_ONLY, LOCAL_SGD, STREAMING, AsyncSettings
from thinwire.optim.freeze import AutoFreeze
from thinwire.train.model import PRESETS, GPTConfig

__all__ = [
    "FILE_ONLY",
    "MAX_INT",
    "ONEBIT_ALGOS",
    "USED_BY",
    "TrainConfig",
    "check_types",
    "drop_legacy_nulls",
    "refuse_extra",
    "short_repr",
]

ONEBIT_ALGOS = ("onebit-lamb", "onebit-adam")
_LOCAL_SGD = ("diloco", "async-diloco")

USED_BY: dict[str, tuple[str, ...]] = {
    "freeze_step": (*ONEBIT_ALGOS, "adamw-onebit", "adamw-onebit-sync"),
    "freeze_cap": ONEBIT_ALGOS,
    "freeze_tolerance": ONEBIT_ALGOS,
    "precondition": ONEBIT_ALGOS,
    "grad_dtype": ("lamb", *ONEBIT_ALGOS),
    "bias_correction": ONEBIT_ALGOS,
    "powersgd_rank": ("adamw-powersgd",),
    "powersgd_start": ("adamw-powersgd",),
    "shard_within": ("lamb", *ONEBIT_ALGOS, *_LOCAL_SGD),
    "exchange": ONEBIT_ALGOS,
    **dict.fromkeys(LOCAL_SGD, _LOCAL_SGD),
    **dict.fromkeys(ASYNC_ONLY, ("async-diloco",)),
    # Streaming DiLoCo is synchronous: of the trainer's algorithms diloco alone runs it.
    **dict.fromkeys(STREAMING, ("diloco",)),
}
"""The algorithm-specific fields of :class:`TrainConfig` and the algorithms that read them;
the others are read by every algorithm."""

_FROM_EXTRA = ("powersgd_rank", "powersgd_start", "bias_correction")
"""The fields that were once keys of a free dict ``extra`` (see :func:`refuse_extra`)."""

MAX_INT = 2**53
"""The largest whole number a setting may hold. Past it a JSON reader elsewhere (a plot,
a dashboard) no longer reads the number exactly, and float arithmetic on it (the cosine
schedule, the rates in the summary) loses the last step; no real run comes near it."""

_RANGED = frozenset(
    {"lr", "min_lr_ratio", "weight_decay", "grad_clip", "freeze_tolerance", "freeze_cap"}
    | {"outer_lr", "outer_momentum", "val_fraction", "fragment_alpha"}
)
"""Float fields :meth:`TrainConfig.validate` checks against a range (whose message names
the range, so nan and inf are left to it)."""

_POWERSGD_MAX_RANK = 1024
"""PowerSGD's rank is capped at a layer's smaller side anyway; past this no preset of
thinwire's compresses at all, so a larger value is a typo."""


def _is_int(value: Any) -> bool:
    """A whole number that is not a bool (``True`` is an int to Python, never to a user)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fits(type_text: str, value: Any) -> bool:
    """Whether ``value`` fits a field annotated ``type_text`` (e.g. ``"int | None"``)."""
    for part in (p.strip() for p in type_text.split("|")):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and _is_int(value):
            return True
        if part == "float" and _is_number(value):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part.startswith("tuple[") and isinstance(value, list | tuple):
            return all(_is_number(v) for v in value)
    return False


class _ShortRepr(reprlib.Repr):
    """``reprlib``'s bounded repr, with whole numbers of any size: Python refuses to print
    an int of more than 4300 digits, and a JSON file can hold one."""

    def repr_int(self, x: int, level: int) -> str:
        if abs(x) <= MAX_INT:
            return repr(x)
        return f"<a number of about {int(x.bit_length() * math.log10(2)) + 1} digits>"


_REPR = _ShortRepr()
_REPR.maxstring = _REPR.maxother = 40


def short_repr(value: Any, limit: int = 60) -> str:
    """A repr of ``value`` at most ``limit`` characters long, however large or deep the
    value is, so an error about it stays one short line."""
    text = _REPR.repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_types(values: dict[str, Any], where: str = "") -> None:
    """A one-line :class:`ConfigError` for the first value of ``values`` (field name to
    value) whose type does not fit its :class:`TrainConfig` field, or whose number is
    not finite or past :data:`MAX_INT`. ``where`` prefixes the message (a file name)."""
    prefix = f"{where}: " if where else ""
    for name, value in values.items():
        type_text = _FIELD_TYPES[name]
        if not _fits(type_text, value):
            raise ConfigError(f"{prefix}{name} must be {type_text}, got {short_repr(value)}")
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            if _is_int(item) and abs(item) > MAX_INT:
                raise ConfigError(f"{prefix}{name} is out of range: {short_repr(item)}")
            # nan and inf: the ranged fields say so with their range, in validate()
            finite = not _is_number(item) or _is_int(item) or math.isfinite(item)
            if not finite and (name not in _RANGED or item is not value):
                raise ConfigError(f"{prefix}{name} must be a finite number, got {item}")


def refuse_extra(values: dict[str, Any], where: str = "") -> None:
    """A one-line :class:`ConfigError` if ``values`` (a config file, a dict for
    :meth:`TrainConfig.from_dict`) still sets ``extra``, the free dict whose keys are
    fields of their own now: dropping it would silently train with their defaults.

    An empty ``extra`` sets nothing and passes: every ``config.json`` a run wrote before
    holds one, and repeating such a run (``--config OUT/config.json``) should still work.
    """
    if "extra" not in values or values["extra"] == {}:
        return
    prefix = f"{where}: " if where else ""
    names = ", ".join(_FROM_EXTRA[:-1]) + f" and {_FROM_EXTRA[-1]}"
    raise ConfigError(
        f"{prefix}extra is no longer read: {names} are settings of their own "
        "(--powersgd-rank, --powersgd-start, --no-bias-correction)"
    )


def drop_legacy_nulls(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` without the nulls of Local-SGD settings that take no None.

    Before the Local-SGD settings were one section, the trainer's copies of them held
    None for "the asynchronous runtime's default", and every ``config.json`` written then
    says so (``"grace_s": null``). Such a null still means the default, so that
    ``--config OLD/config.json`` and ``compare --resume`` keep working on those runs.
    """
    return {
        k: v
        for k, v in values.items()
        if not (v is None and k in ASYNC_ONLY and not _fits(_FIELD_TYPES[k], None))
    }


def _check_range(
    name: str, value: float, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
) -> None:
    """A one-line ConfigError unless ``value`` is a number in the interval (NaN never is)."""
    if not _is_number(value):
        raise ConfigError(f"{name} must be a number, got {short_repr(value)}")
    ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    # An int too large for a float (10**400 from a JSON file) is out of every range
    # (math.isfinite would raise on it rather than answer).
    huge = _is_int(value) and abs(value) > MAX_INT
    if huge or not (ok and (_is_int(value) or math.isfinite(value))):
        closing = ")" if hi_open or math.isinf(hi) else "]"
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{closing}"
        got = short_repr(value) if huge else value
        raise ConfigError(f"{name} must be a number in {interval}, got {got}")


@dataclass
class TrainConfig(AsyncSettings):
    """Everything that defines a run of the example trainer: the fields below and the
    Local-SGD settings it inherits from :class:`~thinwire.localsgd.settings.AsyncSettings`.

    Fields marked *identity* must match when a run is resumed; the others (steps,
    intervals, output options) may change between the original run and its resume.
    """

    # --- what is trained, and how ------------------------------------------------------
    algo: str = "adamw"
    """Training algorithm (*identity*); ``thinwire train --help`` lists them."""
    model: str = "tiny"
    """Model preset (*identity*): ``tiny`` (0.4M parameters), ``small`` (3.3M), ``base``."""
    seq_len: int | None = None
    """Override the preset's context length (*identity*)."""
    n_layer: int | None = None
    """Override the preset's depth (*identity*)."""
    n_head: int | None = None
    """Override the preset's attention heads (*identity*)."""
    n_embd: int | None = None
    """Override the preset's width (*identity*)."""
    data: str | None = None
    """UTF-8 text file to train on; ``None`` is the bundled Shakespeare corpus (*identity*)."""
    val_fraction: float = 0.05
    """Share of the corpus (its end) held out for validation (*identity*)."""
    seed: int = 0
    """Seeds the initial weights and the batch sampler (*identity*)."""
    pretrain_steps: int | None = None
    """Start after this many steps of ordinary data-parallel AdamW (``--pretrain-steps``,
    *identity*; None or 0: from scratch): where compression and Local-SGD are meant to
    run, and where their defaults were tuned. See :mod:`thinwire.train.start` and, for
    ``async-diloco``, ``AsyncConfig.pretrain_steps``."""
    init_from: str | None = None
    """Start from this model state file (``--init-from``, *identity*) instead; see
    :mod:`thinwire.train.start`."""
    shard_within: int = 1
    """Ranks per island that FSDP2 shards the model over (``--shard-within K``,
    *identity*): islands are ranks ``[i*K, (i+1)*K)``, joined inside by fast links, and
    ``lamb``, ``onebit-lamb``, ``onebit-adam`` or ``diloco`` run across the islands on
    each rank's shard (HSDP with thinwire's exchange across replicas,
    :mod:`thinwire.train.sharding`). Under ``async-diloco`` each worker is an island
    (rank 0 serves, so run ``1 + W * K`` ranks;
    :mod:`thinwire.localsgd.runtime.island`).
    1 (the default) keeps a whole replica per rank under DDP. Use it when the model does
    not fit one device, or when ranks come in groups joined by a faster network: only
    the cross-island traffic is compressed and counted."""

    # --- optimisation ------------------------------------------------------------------
    steps: int = 300
    """Optimizer steps in total; it also sets the length of the cosine schedule, so a run
    resumed with more steps follows a stretched schedule from the resume point on."""
    stop_after: int | None = None
    """Stop (with a checkpoint) once this step is reached, e.g. to fit a scheduler's time
    slot; ``--resume`` later continues exactly as if the run had never stopped."""
    batch_size: int = 16
    """Sequences per rank per step (*identity*); the global batch is ``batch_size * W``."""
    lr: float = 3e-3
    """Peak learning rate, reached after ``warmup_steps`` and decayed by cosine."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio``."""
    warmup_steps: int = 20
    """Linear learning-rate warmup from 0. Large batches and LAMB want a longer warmup."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW, LAMB)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam-family moment decay rates."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    # --- 1-bit optimizers --------------------------------------------------------------
    freeze_step: int | str | None = "auto"
    """When the 1-bit optimizers end their full-precision warmup: ``"auto"`` switches once
    Adam's second moment has settled (:class:`~thinwire.optim.freeze.AutoFreeze`), not
    before the learning-rate warmup ends and at :attr:`freeze_cap` of the run at the
    latest; a number fixes the step. ``None`` means ``"auto"``."""
    freeze_tolerance: float = 0.05
    """With ``freeze_step="auto"``: the warmup ends once ``sqrt(v)`` changes by less than this
    fraction per 10 steps (twice in a row). Lower waits longer."""
    freeze_cap: float = 0.3
    """With ``freeze_step="auto"``: the share of the run after which the warmup ends even if
    the second moment is still moving (the bound on the warmup's full-precision bytes)."""
    grad_dtype: str | None = None
    """What averaged gradients travel as in ``lamb`` and in the 1-bit optimizers' warmup:
    ``fp32``, ``fp16`` or ``bf16``. ``None``: bf16 for the 1-bit optimizers (half the
    warmup's bytes; fp32's exponent range, so the small gradients of a small model do not
    flush to zero as in fp16, where 60% of the tiny GPT's averaged gradient elements are
    subnormal), fp32 for ``lamb`` (the uncompressed reference)."""
    precondition: bool | None = None
    """1-bit optimizers: compress the momentum divided by the frozen ``sqrt(v)`` (on the
    scale of each element's own step) rather than the raw momentum (the papers' rule).
    ``None``: each optimizer's default (on for 1-bit Adam, off for 1-bit LAMB)."""
    bias_correction: bool = True
    """1-bit optimizers: bias-correct Adam's moments (``--no-bias-correction``: the 1-bit
    papers' reference rule, which does not). On, a 1-bit optimizer that never compresses
    is its uncompressed optimizer to the bit, and ``onebit-lamb`` is ``lamb`` until the
    freeze. Off, a variance frozen after a short warmup is a small fraction
    (``1 - beta2^t``) of its steady size, so coordinates with small gradients take huge
    steps from the +-scale noise of the 1-bit momenta: a 120-step tiny-GPT run at lr 0.02
    diverged that way. Turn it off only to reproduce the reference (docs/optimizers.md)."""
    exchange: str = "onebit"
    """1-bit optimizers (*identity*): the code their momentum travels in after the freeze:
    ``onebit`` (the default, ~28x fewer bytes than fp32), or ``int8``, ``fp8`` (3.9x),
    ``int4`` (7.8x) or ``bf16`` (2.0x), finer codes for a model or a link where 1-bit loses quality
    (:mod:`thinwire.comm.momentum_exchange`)."""

    # --- PowerSGD (adamw-powersgd) -----------------------------------------------------
    powersgd_rank: int = 4
    """Rank of PyTorch's PowerSGD approximation of each gradient matrix, in ``[1, 1024]``
    (``--powersgd-rank``). An ``n x m`` matrix travels as ``(n + m) * rank`` numbers
    instead of ``n * m``; error feedback carries what the approximation misses into later
    steps. Lower is fewer bytes and a coarser gradient: 1 is the most aggressive, 4 the
    common choice. A matrix it would shrink less than 2x, and every bias and norm vector,
    travels uncompressed (PyTorch's rule), so a rank near a layer's smaller side
    compresses nothing. Each step also pays a QR and two matmuls per matrix: a 64 MiB
    allreduce on 4 hosts ran 11.3x (rank 1) and 6.7x (rank 4) fp32's speed at 100 Mbit/s,
    but at 1 Gbit/s rank 4 was slower than fp32 (docs/results/compression.md)."""
    powersgd_start: int = 10
    """Steps of plain fp32 allreduce before PowerSGD starts (``--powersgd-start``,
    ``>= 0``; 0 and 1 mean 2, the earliest start PyTorch's hook takes with error feedback
    and warm start). The first steps move fastest, and compressing them can set the
    run on a worse path it does not recover from (PyTorch's advice); each of them costs the
    full fp32 bytes, so on a slow link keep it a small share of the run."""

    # --- Local-SGD (diloco, async-diloco) ----------------------------------------------
    # The Local-SGD settings (local_steps, outer, outer_lr, dylu, compress, ...) are the
    # fields this class inherits from thinwire.localsgd.AsyncSettings, which documents
    # each one (Streaming DiLoCo's knobs too, which the trainer's diloco alone runs of
    # its algorithms); only the trainer's own data layout is defined here.
    shard_layout: str = "striped"
    """How Local-SGD cuts the training text into shards: ``striped`` (4 KiB blocks dealt
    round-robin: every shard samples the whole text) or ``contiguous`` (one stretch each,
    so shards differ in style). ``--algo diloco`` reads them too: rank r trains on the
    shard the schedule of synchronous rounds gives it, as the simulator's sync does."""

    # --- measuring, saving -------------------------------------------------------------
    eval_interval: int = 50
    """Steps between validation passes (also run at step 0 and at the end)."""
    eval_sequences: int = 64
    """Validation windows per pass, shared among the ranks."""
    log_interval: int = 10
    """Steps between metric records."""
    checkpoint_interval: int = 100
    """Steps between checkpoints; 0 saves only at the end."""
    out_dir: str = "runs/train"
    """Where metrics, checkpoints and the summary go."""
    resume: bool = False
    """Continue the run found in ``out_dir`` from its latest checkpoint."""
    progress: bool = True
    """Show a progress bar on rank 0 (only when stderr is a terminal)."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the ``tensorboard`` package)."""
    record: bool = True
    """Record the run's steps to ``OUT/record.jsonl`` (``--no-record`` turns it off): the
    compute, when each gradient became ready, each DDP bucket's bytes and timing
    (:mod:`thinwire.comm.step_record`), what ``thinwire analyze run OUT/`` predicts the
    job's scaling from. It costs a clock read per parameter per step and a line per
    recorded step (every step of the first 50, then one in 10)."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (CUDA when available)."""

    IDENTITY: ClassVar[tuple[str, ...]] = (
        "algo",
        "model",
        "seq_len",
        "n_layer",
        "n_head",
        "n_embd",
        "data",
        "val_fraction",
        "seed",
        "batch_size",
        "pretrain_steps",
        "init_from",
        "shard_within",
        "exchange",
    )

    def gpt_config(self) -> GPTConfig:
        """The model shape: the preset with any overrides applied."""
        if self.model not in PRESETS:
            raise ConfigError(
                f"unknown model preset {self.model!r}; valid presets: {', '.join(PRESETS)}"
            )
        base = asdict(PRESETS[self.model])
        for name in ("seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if value is not None:
                base[name] = value
        try:
            return GPTConfig(**base)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def validate(self) -> None:
        """Reject impossible settings with a one-line :class:`ConfigError`."""
        check_types(self.to_dict())
        if len(self.betas) != 2:
            raise ConfigError(
                f"betas must be two numbers (beta1, beta2), got {len(self.betas)}: "
                f"{short_repr(list(self.betas))}"
            )
        positive = ("steps", "batch_size", "eval_interval", "eval_sequences", "log_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        _check_range("lr", self.lr, 0.0, math.inf, lo_open=True)
        if self.warmup_steps < 0 or self.checkpoint_interval < 0:
            raise ConfigError("warmup-steps and checkpoint-interval must be >= 0")
        _check_range("min-lr-ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_range("val-fraction", self.val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        _check_range("weight-decay", self.weight_decay, 0.0, math.inf)
        for i, beta in enumerate(self.betas):
            _check_range(f"betas[{i}]", beta, 0.0, 1.0, hi_open=True)
        _check_range("grad-clip", self.grad_clip, 0.0, math.inf)  # 0 = off; NaN is not
        if self.exchange not in EXCHANGES:
            raise ConfigError(
                f"exchange must be one of {', '.join(EXCHANGES)}; got {short_repr(self.exchange)}"
            )
        if not _is_int(self.shard_within) or self.shard_within < 1:
            raise ConfigError(
                f"shard-within must be an integer >= 1, got {short_repr(self.shard_within)}"
            )
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError(f"stop-after must be >= 1, got {self.stop_after}")
        self._check_freeze_step()
        if self.grad_dtype is not None:
            parse_cast(self.grad_dtype, "grad-dtype", plain="fp32")
        _check_range("freeze-tolerance", self.freeze_tolerance, 0.0, math.inf, lo_open=True)
        _check_range("freeze-cap", self.freeze_cap, 0.0, 1.0, lo_open=True)
        # An outer lr of 0 leaves a model that never moves; momentum must be in [0, 1) for
        # the outer step to converge (0 is plain averaging of the pseudo-gradients).
        # None: the method's tuned value (thinwire.localsgd.TUNED).
        if self.outer_lr is not None:
            _check_range("outer-lr", self.outer_lr, 0.0, math.inf, lo_open=True)
        if self.outer_momentum is not None:
            _check_range("outer-momentum", self.outer_momentum, 0.0, 1.0, hi_open=True)
        # The settings every Local-SGD run reads are checked whatever the algorithm, as
        # every field is; the asynchronous ones (whose combinations only mean something
        # there: --sync with --dylu) when the run is asynchronous.
        # diloco's allreduce also takes the quantizers (Streaming DiLoCo's codecs).
        self.check_local_sgd(QUANT_KINDS if self.algo == "diloco" else ())
        self._check_fragments()
        if self.algo == "async-diloco":
            self.check_async()
        if self.shard_layout not in ("striped", "contiguous"):
            raise ConfigError(
                f"shard layout must be striped or contiguous, got {self.shard_layout!r}"
            )
        self._check_powersgd()
        self._check_device()
        self.gpt_config()

    def _check_freeze_step(self) -> None:
        if self.freeze_step in (None, "auto"):
            return
        if isinstance(self.freeze_step, (str, bool)) or self.freeze_step < 1:
            raise ConfigError(
                f"freeze-step must be 'auto' or a step >= 1, got {self.freeze_step!r}"
            )
        # freeze_step == steps is a legitimate control run (a 1-bit optimizer that never
        # compresses); past the end it can only be a mistake, for every algorithm that
        # reads the step (the 1-bit optimizers and the 1-bit hook alike).
        if self.algo in USED_BY["freeze_step"] and self.freeze_step > self.steps:
            raise ConfigError(
                f"freeze-step {self.freeze_step} is past steps {self.steps}: {self.algo} "
                "would never compress; lower --freeze-step (or use lamb/adamw)"
            )

    def _check_fragments(self) -> None:
        if not _is_int(self.fragments) or self.fragments < 1:
            raise ConfigError(
                f"fragments must be an integer >= 1, got {short_repr(self.fragments)}"
            )
        if not _is_int(self.fragment_overlap) or self.fragment_overlap < 0:
            raise ConfigError(
                f"fragment-overlap must be an integer >= 0, got {short_repr(self.fragment_overlap)}"
            )
        _check_range("fragment-alpha", self.fragment_alpha, 0.0, 1.0, hi_open=True)

    def streaming(self) -> bool:
        """Whether the run is Streaming DiLoCo: ``--algo diloco`` with its settings (the
        other algorithms ignore them, with a warning)."""
        return self.algo == "diloco" and super().streaming()

    def _check_streaming(self, simulated: bool, workers: int | None) -> None:
        """Streaming DiLoCo is ``--algo diloco``'s here, checked with it; ``--algo
        async-diloco`` ignores its settings (with a warning) rather than refusing them."""

    def starts_trained(self) -> bool:
        """``pretrain_steps`` or ``init_from`` set (it picks the inner-state default).
        ``Start.from_scratch``'s test, written here: this config builds on the Local-SGD
        settings section alone."""
        return bool(self.pretrain_steps) or self.init_from is not None

    def inner_state(self) -> str | None:
        """The inner-state rule a Local-SGD run uses (None for the other algorithms):
        Streaming DiLoCo's ``keep`` unless set, else the rule's default for this start
        (:meth:`~thinwire.localsgd.LocalSGDSettings.resolved_inner_momentum`)."""
        if self.algo not in ("diloco", "async-diloco"):
            return None
        return self.resolved_inner_momentum()

    def _check_powersgd(self) -> None:
        # Checked whatever the algorithm, as every field is: a typo in a file that a
        # later run with --algo adamw-powersgd repeats must not wait for that run.
        if not 1 <= self.powersgd_rank <= _POWERSGD_MAX_RANK:
            raise ConfigError(
                f"powersgd-rank must be in [1, {_POWERSGD_MAX_RANK}], "
                f"got {short_repr(self.powersgd_rank)}"
            )
        if self.powersgd_start < 0:
            raise ConfigError(f"powersgd-start must be >= 0, got {self.powersgd_start}")

    def _check_device(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("--device cuda was asked for, but CUDA is not available")

    def unused_options(self) -> list[str]:
        """Options set away from their defaults that ``algo`` never reads, as
        ``--flag`` names (the command line warns about them; they change nothing)."""
        default = TrainConfig()
        unused = [
            name
            for name, algos in USED_BY.items()
            if self.algo not in algos and getattr(self, name) != getattr(default, name)
        ]
        # A switch that is on by default was typed as its --no- form.
        off = {n for n in unused if getattr(default, n) is True and getattr(self, n) is False}
        return [
            name
            if name in FILE_ONLY  # no flag: the file's own key
            else ("--no-" if name in off else "--") + name.replace("_", "-").removesuffix("-s")
            for name in unused
        ]

    def freeze_rule(self) -> int | AutoFreeze:
        """What the 1-bit optimizers get as ``freeze_step``: the fixed step, or the automatic
        rule, which waits for the learning-rate warmup and is capped at ``freeze_cap``.

        Why automatic by default: with a fixed 15% of the run, 1-bit LAMB ended 9% above
        LAMB on a text the defaults were not tuned on, and at 30% below it; the right share
        depends on the data, the learning rate and the model. See docs/optimizers.md.
        """
        if self.freeze_step in (None, "auto"):
            # Never inside the learning-rate warmup, even when the cap would be: the
            # steps after it grow with the lr while the frozen variance does not.
            return AutoFreeze.for_run(
                self.steps,
                share=self.freeze_cap,
                min_step=self.warmup_steps,
                tolerance=self.freeze_tolerance,
            )
        return int(self.freeze_step)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: the trainer's own first, then the Local-SGD section (the
        order ``config.json`` shows them in)."""
        names = [f.name for f in fields(self)]
        section = set(LOCAL_SGD + ASYNC_ONLY)
        ordered = [n for n in names if n not in section] + [n for n in names if n in section]
        return {name: getattr(self, name) for name in ordered}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config ``d`` (field name to value) describes; keys that are no field are
        left out, but a non-empty ``extra`` is refused (:func:`refuse_extra`)."""
        refuse_extra(d)
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in drop_legacy_nulls(d).items() if k in known}
        for key in ("betas", "slowdown", "speeds"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)


FILE_ONLY = (
    "val_fraction",
    "min_lr_ratio",
    "betas",
    "c",
    "outer_momentum_warmup",
    "dylu_ema",
    "connect_timeout_s",
    "link_timeout_s",
    "heartbeat_s",
    "hung_after_s",
    "hung_after_factor",
    "max_restarts",
    "token_file",
    "bind_addr",
    "max_push_ratio",
    "push_history",
    "push_warmup",
    "max_refused_pushes",
)
"""The :class:`TrainConfig` fields no ``thinwire train`` flag sets; a config file
(``--config``) or Python sets them. Each is one the defaults were tuned around and a run
rarely changes, so a flag would only lengthen ``--help``: ``val_fraction`` fixes what
the validation loss measures (``thinwire compare`` holds it the same for every run);
``min_lr_ratio`` and ``betas`` are the schedule's floor and Adam's decay rates, which
every algorithm's tuned lr assumes; ``c``, ``outer_momentum_warmup`` and ``dylu_ema``
are Delayed Nesterov's momentum share and ramp and DyLU's speed average, whose defaults
the asynchronous methods were tuned with; the asynchronous runtime's deadlines (``connect_timeout_s`` to
``max_restarts``) matter only on real links, where the testbed hands each host its
settings as a file; and the admission settings (``token_file`` to
``max_refused_pushes``) belong with a deployment's files (``THINWIRE_RUN_TOKEN_FILE``
and ``THINWIRE_BIND_ADDR`` also set the first two per host). Every other field has a
flag (a test keeps the two in step)."""

_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in fields(TrainConfig)}
"""Each field's annotation as text (``from __future__ import annotations`` keeps them so)."""
