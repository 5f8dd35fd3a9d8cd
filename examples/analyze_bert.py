"""Is the network the bottleneck for BERT-Large? ``thinwire analyze`` on a model of your own.

What it shows: how to point thinwire's network analysis at any model. BERT-Large (the
model of the 1-bit LAMB paper) is built from a ``BertConfig`` (random init, nothing
downloaded) and profiled for one worker: its gradient bytes, the buckets a real DDP puts
them in, and when each gradient becomes ready in the backward pass. From that profile
the what-if model predicts the scaling factor (SF = single-worker step / predicted
step) of data-parallel training on ``--workers`` workers at 1, 10 and 100 Gbit/s, with
plain fp32 DDP and with 1-bit LAMB (one 1-bit allreduce after the backward pass, its
compute measured on this machine).

Run::

    python examples/analyze_bert.py                 # BERT-Large, batch 1 x 128 tokens
    python examples/analyze_bert.py --tiny          # a small BERT: seconds, for tests

The same factories work from the command line (the contract: a function returning
``(model, batch, loss_fn)``, given ``batch_size=N`` if it takes it)::

    thinwire analyze profile --model examples/analyze_bert.py:bert_large --batch-size 1 \\
        --observe-ddp -o bert-large.json
    thinwire analyze what-if bert-large.json --workers 64 --bandwidth-gbps 10 --buckets observed

Profile on the hardware the job will run on: the prediction is only as good as the step
time, and a CPU step is far slower than an accelerator's, which hides the network.
Needs ``pip install 'thinwire[hf]'``.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any

import torch
from transformers import BertConfig, BertForPreTraining

from thinwire.analysis import (
    AddCost,
    Bucket,
    NetworkConfig,
    make_buckets,
    measure_codec_cost,
    profile_factory,
    required_compression,
    save_profile,
    simulate,
)
from thinwire.analysis.report import fmt_time

MIB = 2**20


def bert_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """BERT pre-training loss: masked-LM plus next-sentence prediction."""
    return model(**batch).loss


def _bert(cfg: BertConfig, batch_size: int, seq_len: int) -> tuple[Any, ...]:
    model = BertForPreTraining(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    labels = torch.full_like(ids, -100)  # -100: not predicted
    masked = torch.rand(ids.shape) < 0.15  # BERT masks 15% of the tokens
    labels[masked] = ids[masked]
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": (torch.arange(seq_len) >= seq_len // 2).long().expand_as(ids),
        "labels": labels,
        "next_sentence_label": torch.randint(0, 2, (batch_size,)),
    }
    return model, batch, bert_loss


def bert_large(batch_size: int = 1, seq_len: int = 128) -> tuple[Any, ...]:
    """BERT-Large: 24 layers, hidden 1024, 16 heads (~336M parameters)."""
    cfg = BertConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    )
    return _bert(cfg, batch_size, seq_len)


def bert_small(batch_size: int = 4, seq_len: int = 32) -> tuple[Any, ...]:
    """A BERT small enough for tests: 2 layers, hidden 64."""
    cfg = BertConfig(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return _bert(cfg, batch_size, seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small BERT instead of BERT-Large")
    ap.add_argument("--batch-size", type=int, default=None, help="per worker (default 1; tiny 4)")
    ap.add_argument("--workers", type=int, default=64, help="data-parallel workers to predict")
    ap.add_argument("--alpha-us", type=float, default=0.0, help="latency per message, us")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    ap.add_argument("-o", "--out", default=None, help="also save the profile JSON here")
    args = ap.parse_args()
    factory = bert_small if args.tiny else bert_large
    batch = args.batch_size or (4 if args.tiny else 1)

    # 1. One worker's step, gradient sizes and ready times, and DDP's real buckets.
    prof = profile_factory(factory, batch, warmup=args.warmup, steps=args.steps, observe_ddp=True)
    # The reductions of a gloo ring run on one thread per collective; a 2-thread add on a
    # shared machine mostly times the thread pool waiting for a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    prof.meta["add_cost"] = AddCost.measure().to_json()
    torch.set_num_threads(threads)
    if args.out:
        save_profile(prof, args.out)
    buckets = make_buckets(prof, "observed")
    sizes = [b.nbytes / MIB for b in buckets]
    s = prof.summary()
    print(
        f"{prof.model}: {len(prof.params)} parameter tensors, "
        f"{sum(p.nbytes for p in prof.params) // 4:,} parameters, "
        f"{s['grad_bytes']:,} bytes of fp32 gradients per step ({s['grad_bytes'] / MIB:.1f} MiB)"
    )
    print(
        f"step on this machine (batch {batch}): {fmt_time(s['iteration_s'])} = forward "
        f"{fmt_time(s['forward_s'])} + backward {fmt_time(s['backward_s'])} + optimizer "
        f"{fmt_time(s['optimizer_s'])}"
    )
    print(
        f"DDP buckets (observed, default 25 MiB cap): {len(buckets)}; sizes in MiB: first "
        f"{sizes[0]:.2f}, median {statistics.median(sizes):.2f}, largest {max(sizes):.2f}, "
        f"last {sizes[-1]:.2f}"
    )

    # 2. What-if: the same step on n workers at three link rates, fp32 vs 1-bit.
    add = AddCost.from_json(prof.meta["add_cost"])
    # The 1-bit compute per byte, on a buffer large enough that per-call overheads fade.
    sample = max(4 * args.workers, min(64 * MIB, s["grad_bytes"]))
    codec = measure_codec_cost(nbytes=sample, world_size=args.workers)
    # 1-bit LAMB sends ONE fused buffer, after the backward pass (it is the optimizer's).
    fused = [Bucket(tuple(p.index for p in prof.ready), prof.grad_bytes, prof.backward_end_s)]
    print(
        f"\npredicted on {args.workers} workers (latency {args.alpha_us:g} us per message, "
        f"additions priced on this machine, 1-bit compute {codec * 1e9:.1f} ns/byte):"
    )
    head = ("link", "fp32 wire", "1-bit wire", "SF fp32", "SF 1-bit", "+compute", "c for 0.9")
    print(" ".join(f"{h:>11s}" for h in head))
    for gbps in (1.0, 10.0, 100.0):
        net = dict(workers=args.workers, bandwidth_gbps=gbps, alpha_s=args.alpha_us * 1e-6)
        ring = NetworkConfig(**net)  # DDP: fp32 ring allreduce of each bucket, overlapped
        onebit = NetworkConfig(**net, scheme="onebit", overlap=False)
        r = simulate(prof, buckets, ring, add)
        o = simulate(prof, fused, onebit, add)  # compression free, as in the paper's model
        oc = simulate(prof, fused, replace(onebit, codec_s_per_byte=codec), add)
        need = required_compression(prof, buckets, ring, 0.9, add)
        cells = (
            f"{gbps:g} Gb/s",
            fmt_time(r.breakdown()["network_s"]),
            fmt_time(o.breakdown()["network_s"]),
            f"{r.scaling_factor:.3f}",
            f"{o.scaling_factor:.3f}",
            f"{oc.scaling_factor:.3f}",
            f"{need:.2f}x" if need is not None else "none",
        )
        print(" ".join(f"{c:>11s}" for c in cells))
    print(
        f"bytes each worker sends per step: fp32 ring {r.wire_bytes:,.0f}, 1-bit "
        f"{o.wire_bytes:,.0f} ({r.wire_bytes / o.wire_bytes:.1f}x fewer)"
    )
    print(
        "SF = one worker's step / predicted step. fp32 wire / 1-bit wire: link time of one "
        "step's bytes. +compute: 1-bit with its compress/decompress measured here. "
        "c for 0.9: the compression an fp32 ring would need for SF 0.9."
    )


if __name__ == "__main__":
    main()
