"""The figure of an end-to-end testbed comparison.

Drawn from the rows of :func:`thinwire.testbed.experiments.compare_on_testbed` and the
runs' ``metrics.jsonl``; needs matplotlib (``pip install 'thinwire[plot]'``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.plotting import pyplot, save_figure

__all__ = ["plot_comparison"]


def _curve(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    return [statistics.fmean(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def plot_comparison(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Three panels: step time per stage (per rate and algorithm), and, at the first
    rate, training loss (5-step mean, round 0) against samples and against seconds.

    Raises :class:`ConfigError` when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        raise ConfigError("plots need matplotlib: pip install 'thinwire[plot]'")

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ax = axes[0]
    width = 0.8 / len(algos)
    for k, algo in enumerate(algos):
        for stage, hatch in (("warmup_step_s", "//"), ("compression_step_s", "")):
            ys = [
                statistics.fmean(
                    [r[stage] for r in rows if r["rate"] == rate and r["algo"] == algo]
                )
                for rate in rates
            ]
            xs = [i + k * width + (0 if hatch else width / 2) for i in range(len(rates))]
            ax.bar(
                xs,
                ys,
                width / 2,
                color=f"C{k}",
                hatch=hatch,
                label=f"{algo} ({'warmup' if hatch else 'compression'})",
            )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rates))], rates)
    ax.set_ylabel("seconds per step")
    ax.set_title("step time by stage (hatched: warmup)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # room for the legend above the bars
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    first = [r for r in rows if r["rate"] == rates[0] and r["repeat"] == 0]
    for k, r in enumerate(first):
        curve = _curve(r["out_dir"])
        loss = _smooth([c["loss"] for c in curve])
        axes[1].plot([c["samples"] for c in curve], loss, color=f"C{k}", label=r["algo"])
        axes[2].plot([c["time_s"] for c in curve], loss, color=f"C{k}", label=r["algo"])
    axes[1].set_xlabel("samples")
    axes[2].set_xlabel("training seconds")
    for a in axes[1:]:
        a.set_ylabel("training loss (5-step mean)")
        a.set_title(f"loss at {rates[0]}")
        a.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=100)
