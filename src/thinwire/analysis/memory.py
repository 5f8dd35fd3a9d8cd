"""Refuse a measurement that cannot fit in memory, before it starts.

``thinwire analyze profile --batch-size 100000`` would otherwise allocate until the
kernel's out-of-memory killer ends it (no message, exit status 137), and ``analyze
bench`` with a message size above memory fails deep inside an allocation. These
estimates are deliberately simple and err a little high; a job is refused only when its
estimate exceeds the memory the kernel reports as available (``MemAvailable``).

The GPT estimate, per sequence of ``T`` tokens in fp32: for each of ``L`` layers the
activations autograd keeps (about ``14 C`` values per token: layer-norm inputs, q/k/v,
the attention output, the MLP's ``4 C`` hidden values before and after GELU) plus
``2 H T`` per token for attention scores, and ``3 V`` per token for the logits, their
softmax and its gradient. Parameters cost 16 bytes each (weights, gradients, AdamW's two
moments). Measured on the tiny preset (2 layers, C=128, T=64) the peak grows by 1.39 MiB
per sequence; the formula gives 1.44 MiB.
"""

from __future__ import annotations

import os

from thinwire.errors import ConfigError

__all__ = [
    "available_memory_bytes",
    "check_bench_memory",
    "check_profile_memory",
    "gpt_training_bytes",
]

_GIB = 2**30


def available_memory_bytes() -> int | None:
    """Memory the kernel could give this process now, or None if it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gpt_training_bytes(preset: str, batch_size: int) -> int:
    """Estimated peak bytes of one training step of thinwire's GPT ``preset`` (see above)."""
    from thinwire.train.model import GPT, PRESETS

    if preset not in PRESETS:
        raise ConfigError(f"unknown model {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    c, t, h, v = cfg.n_embd, cfg.seq_len, cfg.n_head, cfg.vocab_size
    per_token = cfg.n_layer * (14 * c + 2 * h * t) + 3 * v + 4 * c
    params = GPT(cfg).num_parameters()
    return 4 * batch_size * t * per_token + 16 * params


def _refuse_if_over(needed: int, what: str, advice: str) -> None:
    have = available_memory_bytes()
    if have is not None and needed > have:
        raise ConfigError(
            f"{what} needs about {needed / _GIB:,.1f} GiB of memory, more than the "
            f"{have / _GIB:,.1f} GiB available here; {advice}"
        )


def check_profile_memory(preset: str, batch_size: int) -> None:
    """Refuse ``analyze profile`` of ``preset`` at ``batch_size`` if it cannot fit."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    _refuse_if_over(
        gpt_training_bytes(preset, batch_size),
        f"profiling the {preset} model at --batch-size {batch_size}",
        "use a smaller --batch-size",
    )


def check_bench_memory(max_bytes: int, workers: int) -> None:
    """Refuse an allreduce benchmark whose largest message cannot fit on every rank:
    each local rank holds the message, its random source and the transfer buffers."""
    _refuse_if_over(
        3 * max_bytes * max(workers, 1),
        f"an allreduce of {max_bytes:,} bytes on {workers} local ranks",
        "use a smaller --max-bytes",
    )
