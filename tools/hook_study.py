"""The study behind docs/compression.md, "Adaptive optimizers behind the 1-bit hook".

Trains zoo models (:mod:`thinwire.zoo.tasks`) on 2 local gloo ranks with DDP and one of
thinwire's comm hooks (``register_comm_hook``), under AdamW or momentum SGD, and prints
each variant's held-out accuracy (classifiers) or loss (language models) per seed::

    python tools/hook_study.py --models relu-cnn,embedding,gpt --seeds 0,1,2

A variant is ``OPTIMIZER METHOD [key=value ...]``: ``adamw fp32``, ``adamw onebit
block=64``, ``sgd onebit lr=0.1 warmup_steps=40``; ``--variant`` may repeat, and the
defaults are the table's rows.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.comm.launch import spawn
from thinwire.comm.register import register_comm_hook
from thinwire.zoo.tasks import TASKS, task

DEFAULT_VARIANTS = (
    "adamw fp32",
    "adamw onebit block=None",
    "adamw onebit",
    "adamw onebit block=64",
    "adamw onebit warmup_steps=40",
    "sgd fp32 lr=0.1",
    "sgd onebit lr=0.1",
    "sgd fp32 lr=0.3",
    "sgd onebit lr=0.3",
)


def _value(text: str) -> Any:
    if text == "None":
        return None
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_variant(text: str) -> dict[str, Any]:
    opt, method, *rest = text.split()
    options = dict(kv.split("=", 1) for kv in rest)
    spec: dict[str, Any] = {"opt": opt, "method": method}
    if "lr" in options:
        spec["lr"] = float(options.pop("lr"))
    spec["options"] = {k: _value(v) for k, v in options.items()}
    return spec


def _one(name: str, spec: dict[str, Any], seed: int, steps: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = task(name)
    torch.manual_seed(seed)
    model = t.build("tiny")
    net = nn.parallel.DistributedDataParallel(model)
    if spec["opt"] == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=spec.get("lr", t.lr["adam"])
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    state = register_comm_hook(net, spec["method"], **spec["options"])
    for step in range(steps):
        t.loss(net, t.batch(seed, step, rank, world, 64)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if hasattr(state, "close"):
        state.close()
    return t.evaluate(model, seed) if rank == 0 else {}


def _rank(
    rank: int, world: int, models: list[str], variants: list[str], seeds: list[int], steps: int
) -> list[tuple[str, str, int, dict[str, float]]]:
    del rank, world
    return [
        (m, v, s, _one(m, parse_variant(v), s, steps))
        for m, v, s in itertools.product(models, variants, seeds)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="relu-cnn,embedding,gpt")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--variant", action="append", help="e.g. 'adamw onebit block=64'")
    args = ap.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in TASKS]
    if unknown:
        ap.error(f"unknown zoo model {unknown[0]!r}; choose from {','.join(TASKS)}")
    variants = args.variant or list(DEFAULT_VARIANTS)
    for v in variants:
        parse_variant(v)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = spawn(_rank, 2, (models, variants, seeds, args.steps), timeout_s=7200)[0]
    table: dict[tuple[str, str], list[float]] = {}
    for model, variant, _, metrics in rows:
        table.setdefault((model, variant), []).append(metrics.get("accuracy", metrics["loss"]))
    for (model, variant), values in table.items():
        shown = " ".join(f"{x:.4f}" for x in values)
        print(f"{model:10s} {variant:32s} {shown}  mean {sum(values) / len(values):.4f}")


if __name__ == "__main__":
    main()
