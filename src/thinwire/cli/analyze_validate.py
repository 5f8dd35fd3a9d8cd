"""``thinwire analyze validate``: the analyzer's predicted step against the testbed.

Predicts the training step on each link rate with the what-if model, then trains on
emulated hosts and measures it (needs root); see :mod:`thinwire.analysis.validate` for
the method and how to read the numbers. ``--from-json`` redraws an earlier result, and
with ``--refit-min-bytes`` predicts it again from the same measurements.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from thinwire.units import parse_size

__all__ = ["add_validate_verb"]


def add_validate_verb(verbs: Any) -> None:
    from thinwire.analysis.validate_config import ValidationConfig

    d = ValidationConfig()
    p = verbs.add_parser(
        "validate",
        help="predict the step on testbed links, then measure it (needs root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=d.model)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--hosts", type=int, default=d.hosts)
    p.add_argument("--rates", default=",".join(d.rates), help="comma list of link rates")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--freeze-step", type=int, default=d.freeze_step)
    p.add_argument("--skip-steps", type=int, default=d.skip_steps)
    p.add_argument("--onebit-algo", default=d.onebit_algo)
    p.add_argument("--profile-steps", type=int, default=d.profile_steps)
    p.add_argument("--no-fit", action="store_true", help="nominal link rate, no latency")
    p.add_argument(
        "--fit-min-bytes",
        default=d.fit_min_bytes,
        help="smallest message of the link fit: bytes or e.g. 64KiB (K/M/G 1024-based)",
    )
    p.add_argument("--fit-max-bytes", default=d.fit_max_bytes, help="largest message of the fit")
    p.add_argument(
        "--delay", default=None, help="one-way delay between the hosts, e.g. 50ms (default none)"
    )
    p.add_argument("--local-steps", type=int, default=d.local_steps, help="DiLoCo's H; 0: none")
    p.add_argument("--out", default="runs/validate")
    p.add_argument("--plot", default=None, help="PNG to draw")
    p.add_argument(
        "--from-json", default=None, help="re-render table and plot from an earlier validation.json"
    )
    p.add_argument(
        "--refit-min-bytes",
        default=None,
        help="with --from-json: predict again, the link fitted from this size up",
    )
    p.set_defaults(func=_validate)


def _validate(args: argparse.Namespace) -> int:
    from thinwire.analysis.validate import repredict, run_validation
    from thinwire.analysis.validate_config import ValidationConfig
    from thinwire.analysis.validate_report import format_table, read_result, write_result

    plot = Path(args.plot) if args.plot else None
    # Zero passes the parser: ValidationConfig and the refit own the range of these sizes.
    fit_min = parse_size(args.fit_min_bytes, "--fit-min-bytes", allow_zero=True)
    fit_max = parse_size(args.fit_max_bytes, "--fit-max-bytes", allow_zero=True)
    if args.from_json and args.refit_min_bytes is not None:
        refit_min = parse_size(args.refit_min_bytes, "--refit-min-bytes", allow_zero=True)
        result = repredict(Path(args.from_json).parent, refit_min)
    elif args.from_json:
        result = read_result(Path(args.from_json))
    else:
        cfg = ValidationConfig(
            model=args.model,
            batch_size=args.batch_size,
            hosts=args.hosts,
            rates=tuple(r.strip() for r in args.rates.split(",") if r.strip()),
            steps=args.steps,
            freeze_step=args.freeze_step,
            skip_steps=args.skip_steps,
            onebit_algo=args.onebit_algo,
            profile_steps=args.profile_steps,
            fit=not args.no_fit,
            fit_min_bytes=fit_min,
            fit_max_bytes=fit_max,
            delay=args.delay,
            local_steps=args.local_steps,
        )
        result = run_validation(cfg, Path(args.out), plot)
    if args.from_json:
        write_result(result, Path(args.out), plot)
    print(format_table(result))
    return 0
