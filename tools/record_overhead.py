"""What the step recorder costs: the trainer's GPT under DDP, with and without it.

Each of W gloo ranks builds two copies of the same DDP model (thinwire's counted fp32
hook, AdamW), one recorded by :func:`thinwire.comm.step_record.record_run` and one not,
and trains them in alternating blocks of steps on the same batches, so both see the same
machine load. Prints the median step of each and the recorder's cost in percent::

    python tools/record_overhead.py --workers 4 --model tiny --steps 300
    python tools/record_overhead.py --workers 4 --model small --steps 100

The recorder writes its file as in a real run (every step of the first 50, then one in
10), into a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from thinwire.comm import spawn
from thinwire.comm.register import register_comm_hook
from thinwire.comm.resumable_ddp import ResumableDDP
from thinwire.comm.step_record import record_run
from thinwire.train.model import GPT, PRESETS


def _body(rank: int, world: int, model: str, steps: int, block: int, out: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = PRESETS[model]
    nets, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        net = ResumableDDP(GPT(cfg))
        register_comm_hook(net, "fp32")
        nets.append(net)
        opts.append(torch.optim.AdamW(net.parameters(), lr=1e-3))
    rec = record_run(nets[1], opts[1], Path(out) / "record.jsonl")
    gen = torch.Generator().manual_seed(rank)
    times: list[list[float]] = [[], []]
    for start in range(0, steps, block):
        for which in (0, 1) if (start // block) % 2 == 0 else (1, 0):
            for _ in range(min(block, steps - start)):
                x = torch.randint(cfg.vocab_size, (16, cfg.seq_len), generator=gen)
                t0 = time.perf_counter()
                _, loss = nets[which](x, x)
                loss.backward()
                opts[which].step()
                opts[which].zero_grad()
                times[which].append(time.perf_counter() - t0)
    rec.close()
    return {"plain": times[0][block:], "recorded": times[1][block:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="tiny", choices=tuple(PRESETS))
    ap.add_argument("--steps", type=int, default=300, help="per copy")
    ap.add_argument("--block", type=int, default=10, help="steps per block, alternating")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        results = spawn(
            _body, args.workers, (args.model, args.steps, args.block, out), timeout_s=3600
        )
    r0 = results[0]
    plain, recorded = statistics.median(r0["plain"]), statistics.median(r0["recorded"])
    print(
        f"{args.model} GPT, {args.workers} workers, {len(r0['plain'])} steps each: median step "
        f"{plain * 1e3:.2f} ms plain, {recorded * 1e3:.2f} ms recorded: "
        f"{100 * (recorded / plain - 1):+.2f}%"
    )


if __name__ == "__main__":
    main()
