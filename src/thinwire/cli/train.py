"""``thinwire train``: run the example trainer on W local workers, or under torchrun.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process joins the existing group
and ``--workers`` is ignored; otherwise ``--workers W`` gloo ranks are spawned on
loopback (one process, no group, when W is 1).

``--rejoin RANK`` (``--algo async-diloco`` only) starts worker RANK again, in a fresh
process, inside a run that is still going (its old process died): set ``MASTER_ADDR``
and ``MASTER_PORT`` to the run's rank 0 and repeat the run's other options. It needs the
run's token: ``THINWIRE_RUN_TOKEN`` (or ``THINWIRE_RUN_TOKEN_FILE``), or, on the run's
host, the run's ``--out``, where a generated token is kept. It replaces only a worker the
server considers dead, unless ``--force-rejoin``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from thinwire.cli.train_config import config_from_args, lr_given, note_trained_lr, track_explicit
from thinwire.comm.launch import launched_by_torchrun
from thinwire.comm.momentum_exchange import EXCHANGES
from thinwire.compress.cast import WIRE_DTYPES
from thinwire.compress.quantize import BLOCK_CODES, QUANT_KINDS
from thinwire.errors import ConfigError
from thinwire.localsgd.algorithm.compression import CODECS
from thinwire.localsgd.settings import LocalSGDSettings
from thinwire.train.algorithms import ALGORITHMS, RUNNERS, algorithm_names
from thinwire.train.config import TrainConfig
from thinwire.train.data import BUILTIN_CORPORA, BUILTIN_CORPUS
from thinwire.train.model import PRESETS
from thinwire.train.run import run_training  # the launch policy; importable here as well

__all__ = ["check_timeout", "config_from_args", "format_summary", "register", "run_training"]


def _speeds(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.5,1,2, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"seconds per step must be > 0, got {text!r}")
    return values


def _slowdown(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,1,2,4, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"slowdown factors must be >= 1 (1 = full speed, 2 = half speed), got {text!r}"
        )
    return values


MAX_TIMEOUT_S = 365 * 86400.0
"""The longest ``--timeout``: a year. Far past any run, and far below what the process
group's deadline can hold (``1e30`` seconds overflows it once the ranks start)."""


def check_timeout(seconds: float) -> None:
    """``--timeout`` must be seconds in ``(0, MAX_TIMEOUT_S]``: 0 would stop every run as
    its ranks start, and nan or a huge number would fail only then, as a traceback."""
    if not 0 < seconds <= MAX_TIMEOUT_S:  # nan fails every comparison
        raise ConfigError(
            f"--timeout must be seconds in (0, {MAX_TIMEOUT_S:.0f}] (a year at most), "
            f"got {seconds:g}"
        )


def freeze_step_arg(text: str) -> int | str:
    """``--freeze-step``: ``auto`` or a whole number (its range is checked with the rest of
    the config, in one line)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a step number, got {text!r}"
        ) from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``thinwire train`` (shared with ``thinwire demo``)."""
    d = TrainConfig()
    _add_run_arguments(p.add_argument_group("run"), d)
    _add_model_arguments(p.add_argument_group("model"), d)
    _add_optimizer_arguments(p.add_argument_group("optimizer"), d)
    _add_powersgd_arguments(p.add_argument_group("PowerSGD (adamw-powersgd)"), d)
    ls = p.add_argument_group("local SGD")
    _add_local_sgd_arguments(ls, d)
    _add_async_arguments(ls, d)
    _add_round_state_arguments(ls, d)
    _add_reporting_arguments(p.add_argument_group("reporting"), d)
    track_explicit(p)


def _add_run_arguments(g: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """What to train, on what, for how long, and where it starts."""
    algos = "; ".join(f"{n}: {ALGORITHMS.get(n, RUNNERS.get(n))[1]}" for n in algorithm_names())
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings from a .json or .toml file of TrainConfig fields (a run's "
        "OUT/config.json repeats it); flags given beside it win",
    )
    g.add_argument("--algo", default=d.algo, help=f"training algorithm ({algos})")
    g.add_argument("--workers", type=int, default=4, help="local worker processes (default 4)")
    g.add_argument(
        "--shard-within",
        type=int,
        default=d.shard_within,
        metavar="K",
        help="lamb, onebit-*, diloco: FSDP2 shards the model over islands of K ranks, the algorithm "
        "runs across islands on each shard (HSDP; default 1: a replica per rank under DDP); "
        "async-diloco: each worker is an island of K ranks (run 1 + W*K workers)",
    )
    g.add_argument(
        "--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)"
    )
    g.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="sequences per worker per step"
    )
    g.add_argument(
        "--data",
        default=None,
        help=f"UTF-8 text file, or a bundled corpus: {', '.join(BUILTIN_CORPORA)} "
        f"(default {BUILTIN_CORPUS})",
    )
    g.add_argument("--out", default=None, help="output directory (default runs/ALGO)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out")
    g.add_argument(
        "--stop-after", type=int, default=None, help="stop with a checkpoint at this step"
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    g.add_argument(
        "--pretrain-steps",
        type=int,
        default=None,
        help="start after this many steps of ordinary data-parallel AdamW (default 0); "
        "a synchronous algorithm's is saved every --checkpoint-interval steps, so --resume "
        "goes on from a stop in it",
    )
    g.add_argument(
        "--init-from", default=None, metavar="FILE", help="start from this model state file"
    )


def _add_model_arguments(m: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """The model's size."""
    m.add_argument("--model", default=d.model, help=f"preset: {', '.join(PRESETS)}")
    m.add_argument("--seq-len", type=int, default=None)
    m.add_argument("--n-layer", type=int, default=None)
    m.add_argument("--n-head", type=int, default=None)
    m.add_argument("--n-embd", type=int, default=None)


def _add_optimizer_arguments(o: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """The inner optimizer and the 1-bit optimizers' warmup."""
    o.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default: tuned per algorithm)"
    )
    o.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    o.add_argument("--weight-decay", type=float, default=d.weight_decay)
    o.add_argument("--grad-clip", type=float, default=d.grad_clip)
    o.add_argument(
        "--freeze-step",
        type=freeze_step_arg,
        default=d.freeze_step,
        metavar="{auto,N}",
        help="1-bit optimizers: end the full-precision warmup once the second moment has "
        "settled (auto, the default) or after N steps",
    )
    o.add_argument(
        "--freeze-tolerance",
        type=float,
        default=d.freeze_tolerance,
        help="with --freeze-step auto: end the warmup once sqrt(v) changes by less than this "
        "fraction per 10 steps (default %(default)s)",
    )
    o.add_argument(
        "--freeze-cap",
        type=float,
        default=d.freeze_cap,
        help="with --freeze-step auto: end the warmup after this share of --steps at the "
        "latest (default %(default)s)",
    )
    o.add_argument(
        "--grad-dtype",
        default=d.grad_dtype,
        choices=tuple(WIRE_DTYPES),
        help="what averaged gradients travel as in lamb and in the 1-bit optimizers' warmup "
        "(default: bf16 for onebit-*, fp32 for lamb)",
    )
    o.add_argument(
        "--precondition",
        action=argparse.BooleanOptionalAction,
        default=d.precondition,
        help="1-bit optimizers: compress the momentum divided by the frozen sqrt(v) instead "
        "of the raw momentum (default: on for onebit-adam, off for onebit-lamb)",
    )
    o.add_argument(
        "--exchange",
        default=d.exchange,
        choices=EXCHANGES,
        help="1-bit optimizers: the code the momentum travels in after the freeze (default "
        "onebit; int8/fp8 send 7x more bytes than it, int4 3.6x, bf16 14x, each a finer code)",
    )
    o.add_argument(
        "--bias-correction",
        action=argparse.BooleanOptionalAction,
        default=d.bias_correction,
        help="1-bit optimizers: bias-correct Adam's moments (default on; off is the 1-bit "
        "papers' reference rule, which can diverge on short runs)",
    )


def _add_powersgd_arguments(g: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """PyTorch's PowerSGD hook under ``--algo adamw-powersgd``."""
    g.add_argument(
        "--powersgd-rank",
        type=int,
        default=d.powersgd_rank,
        help="rank of each gradient matrix's approximation, 1 to 1024: lower sends fewer "
        "bytes and a coarser gradient (default %(default)s)",
    )
    g.add_argument(
        "--powersgd-start",
        type=int,
        default=d.powersgd_start,
        help="steps of plain fp32 allreduce before PowerSGD starts (default %(default)s)",
    )


def _add_local_sgd_arguments(ls: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """Local SGD's rounds, outer step, DyLU and staleness."""
    ls.add_argument(
        "--local-steps", type=int, default=d.local_steps, help="inner steps H per round"
    )
    ls.add_argument(
        "--outer-lr", type=float, default=d.outer_lr, help="default: the method's tuned value"
    )
    ls.add_argument(
        "--outer-momentum",
        type=float,
        default=d.outer_momentum,
        help="default: the method's tuned value; 0 is plain SGD on the averaged update",
    )
    ls.add_argument("--outer", default=d.outer, choices=("dn", "nesterov", "buffer"))
    add_streaming_arguments(ls, d, "diloco")
    ls.add_argument("--dylu", action="store_true", help="dynamic local updates")
    ls.add_argument(
        "--speeds",
        type=_speeds,
        default=None,
        help="async-diloco: declared seconds per step of each worker, for DyLU's first "
        "round (default: a short calibration round measures them)",
    )
    ls.add_argument("--calibration-steps", type=int, default=None, help="DyLU calibration")
    ls.add_argument("--min-local-steps", type=int, default=None, help="DyLU's floor")
    ls.add_argument(
        "--staleness",
        default=None,
        choices=("none", "poly"),
        help="async-diloco: poly scales each push by (1 + staleness)^-1/2",
    )
    ls.add_argument("--max-staleness", type=int, default=None, help="drop staler pushes")


def _add_async_arguments(ls: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """Data shards, slow workers and the asynchronous server."""
    ls.add_argument(
        "--shard-sampling",
        default=None,
        choices=("least-progress", "paper"),
        help="how a round's data shard is chosen (default least-progress)",
    )
    ls.add_argument(
        "--shard-layout",
        default=d.shard_layout,
        choices=("striped", "contiguous"),
        help="Local-SGD shards: 4 KiB blocks dealt round-robin, or contiguous stretches",
    )
    ls.add_argument(
        "--slowdown", type=_slowdown, default=None, help="per-worker factors, e.g. 1,1,2,4"
    )
    ls.add_argument(
        "--grace",
        type=float,
        default=None,
        help="async: seconds the server waits for more arrivals before applying them "
        "together (default 0; with --dylu the inner-momentum restart makes it unneeded)",
    )
    ls.add_argument(
        "--shards",
        type=int,
        default=None,
        help="async-diloco: data shards (default one per worker; more let the "
        "least-progress rule balance uneven workers)",
    )
    ls.add_argument(
        "--sync",
        action="store_true",
        help="async-diloco: every round waits for all workers (synchronous DiLoCo "
        "through the server: the baseline for --slowdown comparisons)",
    )
    ls.add_argument(
        "--dead-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="async-diloco: heartbeat silence after which the server drops a worker as dead "
        "(default 10); a rejoin of a worker waits for this",
    )


def _add_round_state_arguments(ls: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """What the inner optimizer keeps between rounds, and what travels compressed."""
    ls.add_argument(
        "--inner-state",
        "--inner-momentum",
        dest="inner_momentum",
        default=d.inner_momentum,
        metavar="{keep,round,restart,fresh}",
        help="diloco, async-diloco: what the inner AdamW carries into the next round: "
        "everything (keep), a zeroed first moment (round), a zeroed and bias-corrected one "
        "(restart), or nothing (fresh); default: keep from a trained model (--pretrain-steps, "
        "--init-from), restart from scratch",
    )
    ls.add_argument(
        "--compress",
        default=d.compress,
        choices=(*CODECS, *QUANT_KINDS),
        help="pseudo-gradients (diloco: the allreduce, where int8, fp8 and int4 run "
        "Streaming DiLoCo's quantized exchange, and onebit does with Streaming DiLoCo's "
        "fragments, overlap or alpha; async-diloco: every push)",
    )
    ls.add_argument(
        "--compress-pull",
        default=None,
        choices=tuple(CODECS),
        help="async-diloco: theta to workers as a delta to their copy in this codec",
    )


def _add_reporting_arguments(r: argparse._ArgumentGroup, d: TrainConfig) -> None:
    """Logs, evaluation, checkpoints and the run's deadline."""
    r.add_argument("--eval-interval", type=int, default=d.eval_interval)
    r.add_argument("--eval-sequences", type=int, default=d.eval_sequences)
    r.add_argument("--log-interval", type=int, default=d.log_interval)
    r.add_argument(
        "--checkpoint-interval",
        type=int,
        default=d.checkpoint_interval,
        help="steps between checkpoints, a synchronous algorithm's pretraining's too "
        "(0: only at the end); "
        f"default {d.checkpoint_interval}",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events")
    r.add_argument(
        "--no-record",
        dest="record",
        action="store_false",
        help="do not record the steps to OUT/record.jsonl (for thinwire analyze run)",
    )
    r.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before a stuck run is stopped"
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="train the small GPT with a chosen algorithm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    p.add_argument(
        "--rejoin",
        type=int,
        default=None,
        metavar="RANK",
        help="async-diloco: run worker RANK again in a fresh process inside the running run "
        "whose rank 0 is at MASTER_ADDR:MASTER_PORT (after the worker's process died); give "
        "the run's other options unchanged",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as JSON (a file for --config) and exit",
    )
    p.add_argument(
        "--force-rejoin",
        action="store_true",
        help="with --rejoin: replace worker RANK even if the server considers it alive "
        "(its old process is stalled, not dead)",
    )
    p.set_defaults(func=_main)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def diloco_words(cfg: TrainConfig) -> str | None:
    """Which DiLoCo ran, for the summary: ``Streaming DiLoCo: 2 fragments, overlap 1,
    alpha 0.5, int4 with error feedback``, or ``onebit, no error feedback`` for DiLoCo's
    own exchange with its feedback off; None for any other run."""
    if cfg.algo != "diloco":
        return None
    if not cfg.streaming():
        return None if cfg.error_feedback else f"{cfg.compress}, no error feedback"
    words = [f"{cfg.fragments} fragment{'s' * (cfg.fragments > 1)}"]
    if cfg.fragment_overlap:
        words.append(f"overlap {cfg.fragment_overlap}, alpha {cfg.fragment_alpha:g}")
    if cfg.compress != "none":
        feedback = " with error feedback" if cfg.error_feedback else ", no error feedback"
        words.append(cfg.compress + (feedback if cfg.compress in BLOCK_CODES else ""))
    return "Streaming DiLoCo: " + ", ".join(words)


def format_summary(s: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    who = f"{s['world_size']} worker(s)"
    within = s.get("shard_within", 1)
    if s["algo"] == "async-diloco":  # rank 0 serves and does not train
        workers = s.get("workers", s["world_size"] - 1)
        each = f" of {within} ranks (FSDP2 inside each)" if within > 1 else ""
        who = f"{workers} workers{each} plus the server"
    elif within > 1:  # the bytes below are the cross-island ones only
        who += f", FSDP2 inside {s['world_size'] // within} islands of {within}"
    algo = s["algo"]
    if s.get("exchange") not in (None, "onebit"):
        algo += f" (momentum exchanged in {s['exchange']})"
    rows = [
        ("algorithm", f"{algo} on {who}"),
        ("steps / samples", f"{s['steps']} / {s['samples']:,}"),
        ("parameters", f"{s['parameters']:,}"),
        ("start", s.get("start", "from scratch")),
        ("final val loss", f"{s['final_val_loss']:.4f}"),
        ("final val perplexity", f"{s['final_val_ppl']:.2f}"),
        ("throughput", f"{s['samples_per_s']:,.1f} samples/s"),
        ("training time", f"{s['train_time_s']:.1f} s"),
        (
            "bytes through the server" if s["algo"] == "async-diloco" else "bytes sent per worker",
            _mib(s["comm_bytes"]),
        ),
        ("output", s["out_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _interrupt_note(out_dir: Path) -> str:
    """What survives a Ctrl-C, for the one line ``thinwire`` prints on its way out."""
    from thinwire.localsgd.runtime.server_process import PRETRAIN_CHECKPOINT, SERVER_CHECKPOINT
    from thinwire.train import pretrain_checkpoint
    from thinwire.train.checkpoint import latest_step

    if (out_dir / SERVER_CHECKPOINT).is_file():  # an asynchronous run's
        return "the server's last checkpoint is intact: --resume continues from it"
    if (out_dir / PRETRAIN_CHECKPOINT).is_file():
        return "the pretraining's last save is intact: --resume goes on from it"
    step = latest_step(out_dir)
    pretrained = pretrain_checkpoint.latest(out_dir)
    if step is None and pretrained is not None:
        return (
            f"the pretraining's save at step {pretrained[0]:,} is intact: --resume goes on from it"
        )
    if step is None:
        return f"no checkpoint was written yet, so {out_dir} cannot be resumed"
    return f"the last checkpoint, step {step}, is intact: --resume continues from it"


def _main(args: argparse.Namespace) -> int:
    check_timeout(args.timeout)
    cfg = config_from_args(args)
    if not lr_given(args):
        note_trained_lr([cfg.algo], cfg)
    if args.print_config:
        cfg.validate()
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if args.force_rejoin and args.rejoin is None:
        raise ConfigError("--force-rejoin goes with --rejoin RANK")
    if args.rejoin is not None:
        if cfg.algo != "async-diloco":
            raise ConfigError(
                f"--rejoin restarts a worker of an asynchronous run (--algo async-diloco); "
                f"--algo {cfg.algo} restarts with --resume"
            )
        from thinwire.train.async_task import rejoin

        out = rejoin(cfg, args.rejoin, force=args.force_rejoin)
        print(
            f"  worker {out['worker']} (incarnation {out['incarnation']}): {out['rounds']} "
            f"rounds, {out['steps']} inner steps"
        )
        return 0
    first = not launched_by_torchrun() or os.environ.get("RANK") == "0"
    unused = cfg.unused_options()
    if unused and first:
        print(
            f"thinwire: warning: --algo {cfg.algo} does not use {', '.join(unused)}; ignored",
            file=sys.stderr,
        )
    args.on_interrupt = lambda: _interrupt_note(Path(cfg.out_dir))
    summary = run_training(cfg, args.workers, args.timeout)
    if not first:
        return 0
    if "note" in summary:
        print(f"thinwire: {summary['note']}", file=sys.stderr)
    which = diloco_words(cfg)
    if which is not None:  # say which DiLoCo ran
        summary = {**summary, "algo": f"diloco ({which})"}
    print(format_summary(summary))
    if summary.get("incomplete"):
        print(f"thinwire: error: {summary['incomplete']}", file=sys.stderr)
        return 1
    return 0


def add_streaming_arguments(p: Any, d: LocalSGDSettings, who: str) -> None:
    """Streaming DiLoCo's flags, with ``d``'s defaults; ``who`` (the algorithm or method
    that runs it) starts each help line. ``thinwire simulate`` takes them too."""
    p.add_argument(
        "--fragments",
        type=int,
        default=d.fragments,
        help=f"{who}: Streaming DiLoCo, the model's fragments synced in turn (default 1)",
    )
    p.add_argument(
        "--fragment-overlap",
        type=int,
        default=d.fragment_overlap,
        help=f"{who}: inner steps a fragment's exchange runs behind (tau, default 0)",
    )
    p.add_argument(
        "--no-error-feedback",
        dest="error_feedback",
        action="store_false",
        default=d.error_feedback,
        help=f"{who} with int8/fp8/int4/onebit: plain quantization, its rounding lost "
        "(default: error feedback on)",
    )
    p.add_argument(
        "--fragment-alpha",
        type=float,
        default=d.fragment_alpha,
        help=f"{who}: share of the local weights kept when a fragment arrives (default 0)",
    )
