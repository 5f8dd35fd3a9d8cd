"""``thinwire demo``: the whole story on built-in defaults, in a few minutes on a CPU.

1. **Train** the job (thinwire's GPT on one worker per core, 2 to 4) with LAMB, recording every step: as
   root on W emulated hosts joined by ``tc``-limited links, otherwise over loopback (and
   the demo says so).
2. **Analyze** LAMB's own record: is the network the bottleneck at the link rate, which
   fix, and the step both algorithms should take after the freeze.
3. **Train** it with 1-bit LAMB and **compare** side by side: validation loss, samples/s,
   the step after the freeze as predicted and as measured, training time, bytes per
   worker; and a plot (``OUT/demo.png``).

The pipeline is :func:`thinwire.workflow.run_demo`; this command parses its settings.
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire.cli.train import freeze_step_arg
from thinwire.workflow.demo import DEMO_LR, DEMO_STEPS, DemoSettings, run_demo

__all__ = ["register"]


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole story on built-in defaults: analyze, train LAMB vs 1-bit LAMB, compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers / emulated hosts (default: one per core, 2 to 4)",
    )
    p.add_argument("--rate", default="100mbit", help="emulated link rate (default 100mbit)")
    p.add_argument(
        "--delay",
        default=None,
        help="one-way delay between the emulated hosts, e.g. 50ms (needs the testbed); the "
        "analysis prices each message with the round trip, twice it",
    )
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--steps", type=int, default=DEMO_STEPS, help=f"steps per run (default {DEMO_STEPS})"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    p.add_argument(
        "--freeze-step",
        type=freeze_step_arg,
        default="auto",
        metavar="{auto,N}",
        help="1-bit LAMB's warmup: auto (until the second moment settles, the default) or N",
    )
    p.add_argument(
        "--lr", type=float, default=DEMO_LR, help=f"learning rate of both runs (default {DEMO_LR})"
    )
    p.add_argument("--out", default="runs/demo", help="output directory (replaced)")
    p.add_argument("--no-testbed", action="store_true", help="train over loopback, even as root")
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-layer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-embd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--n-head", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    run_demo(
        DemoSettings(
            workers=args.workers,
            rate=args.rate,
            delay=args.delay,
            model=args.model,
            steps=args.steps,
            batch_size=args.batch_size,
            freeze_step=args.freeze_step,
            lr=args.lr,
            out=args.out,
            testbed=not args.no_testbed,
            seq_len=args.seq_len,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )
    return 0
