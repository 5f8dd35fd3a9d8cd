"""Figures of a simulation study (matplotlib, optional: ``pip install thinwire[plot]``).

:func:`write_plots` draws four PNGs from a study (:func:`thinwire.analysis.study.run_study`):

* ``sf_vs_bandwidth.png``: scaling factor vs link rate, one line per worker count;
* ``sf_vs_compression.png``: scaling factor vs compression ratio, one line per link
  rate, with the target as a dashed line;
* ``sf_heatmap.png``: scaling factor over (link rate, compression ratio);
* ``gantt.png``: the simulated step of the configured network: backward compute with
  the moments buckets become ready, and the allreduce of each bucket on the channel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError

__all__ = ["write_plots"]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "plots need matplotlib: pip install 'thinwire[plot]' (or skip --plots)"
        ) from None
    return plt


def _lines_to_plot(values: list[float], base: float, most: int = 6) -> list[int]:
    # A readable subset: the configured value plus evenly spaced others.
    idx = list(range(len(values)))
    if len(idx) <= most:
        return idx
    step = max(1, len(idx) // (most - 1))
    pick = set(idx[::step]) | {values.index(base)}
    return sorted(pick)


def write_plots(study: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the four figures into ``out_dir``; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{study['profile']['model']}"
    figures = (
        ("sf_vs_bandwidth.png", _sf_vs_bandwidth),
        ("sf_vs_compression.png", _sf_vs_compression),
        ("sf_heatmap.png", _sf_heatmap),
        ("gantt.png", _gantt),
    )
    paths = []
    for name, draw in figures:
        fig = draw(plt, study, title)
        paths.append(out / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _sf_vs_bandwidth(plt: Any, study: dict[str, Any], title: str) -> Any:
    """Scaling factor vs link rate, one line per worker count."""
    sw, target, cfg = study["sweeps"], study["target"], study["result"]["config"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n, row in zip(sw["workers"], sw["sf_by_workers_gbps"], strict=True):
        ax.plot(
            sw["gbps"],
            row,
            marker="o",
            ms=3,
            label=f"{n} workers",
            lw=2.2 if n == cfg["workers"] else 1.2,
        )
    ax.axhline(target, ls="--", c="gray", lw=1, label=f"target {target:.0%}")
    ax.set(
        xscale="log",
        xlabel="link rate per worker (Gbit/s)",
        ylabel="scaling factor",
        ylim=(0, 1.02),
        title=f"{title}: scaling factor vs bandwidth",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _sf_vs_compression(plt: Any, study: dict[str, Any], title: str) -> Any:
    """Scaling factor vs compression ratio, one line per link rate, and the target."""
    sw, target, cfg = study["sweeps"], study["target"], study["result"]["config"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    grid = sw["sf_by_gbps_ratio"]
    for i in _lines_to_plot(sw["gbps"], cfg["bandwidth_gbps"]):
        b = sw["gbps"][i]
        ax.plot(
            sw["ratios"],
            grid[i],
            marker="o",
            ms=3,
            label=f"{b:g} Gbit/s",
            lw=2.2 if b == cfg["bandwidth_gbps"] else 1.2,
        )
    ax.axhline(target, ls="--", c="gray", lw=1, label=f"target {target:.0%}")
    ax.set(
        xscale="log",
        xlabel="compression ratio",
        ylabel="scaling factor",
        ylim=(0, 1.02),
        title=f"{title}: {cfg['workers']} workers, scaling factor vs compression",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _sf_heatmap(plt: Any, study: dict[str, Any], title: str) -> Any:
    """Scaling factor over (link rate, compression ratio)."""
    sw, cfg = study["sweeps"], study["result"]["config"]
    grid = sw["sf_by_gbps_ratio"]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    im = ax.imshow(grid, origin="lower", aspect="auto", vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(sw["ratios"])), [f"{r:g}" for r in sw["ratios"]], fontsize=7)
    ax.set_yticks(range(len(sw["gbps"])), [f"{b:g}" for b in sw["gbps"]], fontsize=7)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(
                j,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=5,
                color="white" if v < 0.6 else "black",
            )
    ax.set(
        xlabel="compression ratio",
        ylabel="link rate (Gbit/s)",
        title=f"{title}: scaling factor, {cfg['workers']} workers",
    )
    fig.colorbar(im, ax=ax, label="scaling factor")
    return fig


def _gantt(plt: Any, study: dict[str, Any], title: str) -> Any:
    """The simulated step: backward compute with the moments buckets become ready, and
    the allreduce of each bucket on the channel."""
    res = study["result"]
    cfg = res["config"]
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    ms = 1e3
    bk = res["backward_s"] * ms
    ax.broken_barh([(0, bk)], (1.6, 0.8), color="#4c72b0", alpha=0.6)
    for ev in res.get("events", []):
        ax.plot([ev["ready_s"] * ms] * 2, [1.6, 2.4], c="k", lw=0.8)
    colors = ("#dd8452", "#c44e52")
    for k, ev in enumerate(res.get("events", [])):
        ax.broken_barh(
            [(ev["start_s"] * ms, (ev["end_s"] - ev["start_s"]) * ms)],
            (0.6, 0.8),
            color=colors[k % 2],
            alpha=0.85,
        )
    if res["exposed_s"] > 0:
        h = cfg["local_steps"] if cfg["scheme"] == "localsgd" else 1
        ax.axvspan(
            bk,
            bk + res["exposed_s"] * h * ms,
            color="red",
            alpha=0.08,
            label="exposed communication",
        )
        ax.legend(fontsize=8, loc="lower right")
    ax.axvline(bk, c="gray", ls=":", lw=1)
    ax.set_yticks([1, 2], ["allreduce", "backward\n(| bucket ready)"])
    ax.set(
        xlabel="ms since backward start",
        ylim=(0.3, 2.7),
        title=f"{title}: {cfg['workers']} workers at {cfg['bandwidth_gbps']:g} Gbit/s, "
        f"{cfg['scheme']}",
    )
    return fig
