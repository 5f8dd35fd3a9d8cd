"""``thinwire bench zoo``: every thinwire piece on models that are not thinwire's GPT.

Trains each zoo model (:mod:`thinwire.zoo.tasks`: a ReLU CNN, a ReLU MLP with dead units,
a bag-of-words model with unused embedding rows, a BERT classifier and a GPT-2 from
``transformers`` configs, thinwire's GPT) with each piece and its uncompressed baseline
in the same loop, on local gloo ranks, and prints how far each piece ends from its
baseline (:mod:`thinwire.zoo.compare`). ``--out DIR`` keeps ``zoo.json`` (every run,
every verdict) and ``zoo.png``, and ``runs.jsonl``, where each run lands as it ends:
``--resume`` with the same ``--out`` finishes an interrupted benchmark without running
again what it already holds. Exits 1 when a piece fails without a documented reason.
"""

from __future__ import annotations

import argparse
import sys

from thinwire.errors import ConfigError
from thinwire.rundir import writable_dir

__all__ = ["add_parser"]


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ConfigError(
            f"unknown zoo {what} {bad[0] if bad else text!r}; choose from {','.join(known)}"
        )
    return names


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds):
        raise ConfigError(f"--seeds takes comma-separated integers >= 0, got {text!r}")
    return seeds


def run(args: argparse.Namespace) -> int:
    from thinwire.zoo import PIECES, SIZES, TASKS, run_jobs
    from thinwire.zoo.compare import render, verdicts, write_json, zoo_jobs
    from thinwire.zoo.plot import plot_verdicts

    models = _names(args.models, tuple(TASKS), "model")
    pieces = _names(args.pieces, PIECES, "piece")
    if args.size not in SIZES:
        raise ConfigError(f"--size must be one of {', '.join(SIZES)}, got {args.size!r}")
    if args.steps < 10:
        raise ConfigError(f"--steps must be at least 10, got {args.steps}")
    if args.workers < 2:
        raise ConfigError(f"--workers must be at least 2, got {args.workers}")
    if args.resume and not args.out:
        raise ConfigError("--resume needs the --out of the benchmark to finish")
    out = writable_dir(args.out) if args.out else None
    log = None if out is None else out / "runs.jsonl"
    if log is not None and log.exists() and not args.resume:
        raise ConfigError(
            f"{out} already holds a zoo benchmark ({log.name}); pass --resume to finish it, "
            "or choose another --out"
        )
    jobs = zoo_jobs(models, pieces, _seeds(args.seeds), args.steps, args.size)
    print(
        f"thinwire bench zoo: {len(jobs)} runs ({len(models)} models, {args.steps} steps, "
        f"{args.workers} workers, size {args.size})",
        file=sys.stderr,
    )
    results = run_jobs(jobs, workers=args.workers, progress=not args.no_progress, log=log)
    items = verdicts(results)
    print(render(items))
    if out is not None:
        write_json(out / "zoo.json", results, items)
        figure = plot_verdicts(items, out / "zoo.png")
        print(f"\nwrote {out / 'zoo.json'}" + (f" and {figure}" if figure else ""))
    return 0 if all(v.ok for v in items) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    from thinwire.zoo import PIECES, TASKS

    p = sub.add_parser(
        "zoo",
        help="every piece against its uncompressed baseline on a zoo of models",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
    )
    p.add_argument("--models", default=",".join(TASKS), help=f"subset of {','.join(TASKS)}")
    p.add_argument("--pieces", default=",".join(PIECES), help=f"subset of {','.join(PIECES)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    p.add_argument("--size", default="tiny", help="tiny (CI) or small (default tiny)")
    p.add_argument("--workers", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument(
        "--out", default=None, help="directory for runs.jsonl (as they end), zoo.json, zoo.png"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="finish the benchmark in --out: run only what its runs.jsonl does not hold",
    )
    p.add_argument("--no-progress", action="store_true", help="no line per finished run")
    p.set_defaults(func=run)
