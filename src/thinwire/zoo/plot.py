"""The zoo at a glance: one cell per model and piece, coloured by its verdict."""

from __future__ import annotations

from pathlib import Path

from thinwire.plotting import pyplot, save_figure
from thinwire.zoo.compare import TOLERANCE, Verdict

__all__ = ["plot_verdicts"]

_COLOURS = {"ok": "#b7e1b0", "exception": "#f6d58e", "FAILED": "#f2a1a1"}


def plot_verdicts(items: list[Verdict], path: Path) -> Path | None:
    """A grid, models down and pieces across: how much worse than its baseline each
    piece ended (accuracy or loss, in %), and how many times fewer bytes it sent.
    Green within the tolerance, amber a documented exception, red a failure. None
    without matplotlib."""
    plt = pyplot()
    if plt is None or not items:
        return None
    models = list(dict.fromkeys(v.model for v in items))
    pieces = list(dict.fromkeys(v.piece for v in items))
    cell = {(v.model, v.piece): v for v in items}
    fig, ax = plt.subplots(figsize=(1.6 + 1.55 * len(pieces), 0.9 + 0.62 * len(models)))
    for i, model in enumerate(models):
        for j, piece in enumerate(pieces):
            v = cell.get((model, piece))
            if v is None:
                continue
            state = "ok" if v.passed else ("exception" if v.excused else "FAILED")
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=_COLOURS[state], ec="white"))
            text = f"{v.gap:+.1%}\n{v.bytes_ratio:.1f}x fewer B"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(pieces))
    ax.set_ylim(len(models), 0)
    ax.set_xticks([j + 0.5 for j in range(len(pieces))], pieces, rotation=20, ha="right")
    ax.set_yticks([i + 0.5 for i in range(len(models))], models)
    ax.set_title(
        f"worse than the uncompressed baseline (accuracy or loss; tolerance {TOLERANCE:.0%})",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, path)
