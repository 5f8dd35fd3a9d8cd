"""A comparison of :func:`thinwire.train.compare.compare` as a table and as one figure.

Both read only the result dict (``comparison.json``), so a comparison can be redrawn
later, or on another machine, without its run directories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from thinwire.plotting import pyplot, save_figure

__all__ = ["format_comparison", "plot_comparison"]


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_comparison(result: dict[str, Any]) -> str:
    """One line per run: final validation loss, bytes per worker, throughput, and the
    ratios to the reference run (NIC bytes per host too when the runs were on a testbed)."""
    runs = result["runs"]
    nic = any("testbed" in r for r in runs.values())
    head = ["run", "final val loss", "loss / ref", "MiB per worker", "bytes reduction"]
    head += ["samples/s", "speed-up", "speed-up after freeze"] + (["NIC MB/host"] if nic else [])
    rows = [tuple(head)]
    for label, r in runs.items():
        row = [
            label + (" (ref)" if label == result["reference"] else ""),
            f"{r['final_val_loss']:.4f}",
            f"{r['loss_ratio']:.4f}",
            f"{r['comm_bytes'] / 2**20:,.2f}",
            "-" if r["bytes_reduction"] is None else f"{r['bytes_reduction']:.2f}x",
            f"{r['samples_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            _num(r.get("compression_speedup"), ".2f")
            + ("x" if r.get("compression_speedup") else ""),
        ]
        if nic:
            tx = r.get("testbed", {}).get("nic_tx_bytes") or []
            row.append(f"{sum(tx) / len(tx) / 1e6:,.1f}" if tx else "-")
        rows.append(tuple(row))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) for c, w in zip(row, widths, strict=True)]
        cells[0] = row[0].ljust(widths[0])  # labels left, numbers right
        lines.append("  ".join(cells))
    within = result.get("base", {}).get("shard_within", 1)
    if within > 1:
        islands = result["workers"] // within
        lines.append(
            f"(FSDP2 inside {islands} islands of {within} ranks: bytes are those across the "
            "islands; FSDP2's inside an island are not counted)"
        )
    return "\n".join(lines)


def _zoom(ax: Any, curves: list[list[list[float]]]) -> None:
    """Zoom on where the methods differ: the first evaluation (the untrained model)
    would flatten everything else."""
    finals = [y for c in curves for _, y in c[1:]]
    if finals:
        lo, hi = min(finals), max(finals)
        pad = 0.05 * (hi - lo + 1e-9)
        ax.set_ylim(lo - pad, hi + pad)


def plot_comparison(
    result: dict[str, Any], path: str | Path, title: str | None = None
) -> Path | None:
    """The comparison in four panels: validation loss against samples and against
    training seconds, cumulative MiB per worker against samples (dotted: a 1-bit run's
    freeze), and samples/s over the whole run and after the freeze.

    Returns the path, or None when matplotlib is not installed (``pip install
    'thinwire[plot]'``).
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax_loss, ax_time, ax_bytes, ax_speed = axes.flat
    runs = result["runs"]
    for k, (label, r) in enumerate(runs.items()):
        color, style = f"C{k}", "--" if "onebit" in r["algo"] else "-"
        for ax, key in ((ax_loss, "val"), (ax_time, "val_time")):
            if r[key]:
                xs, ys = zip(*r[key], strict=True)
                ax.plot(xs, ys, style, marker=".", color=color, label=label)
        if r["comm"]:
            xs, bs = zip(*r["comm"], strict=True)
            ax_bytes.plot(xs, [b / 2**20 for b in bs], style, color=color, label=label)
        if r.get("freeze_step"):
            ax_bytes.axvline(r["freeze_step"] * r["samples_per_step"], color=color, lw=0.6, ls=":")
        after = r.get("stages", {}).get("compression", {}).get("samples_per_s")
        ax_speed.bar(k - 0.2, r["samples_per_s"], 0.4, color=color, alpha=0.5)
        ax_speed.bar(k + 0.2, after or 0.0, 0.4, color=color)
    for ax, key in ((ax_loss, "val"), (ax_time, "val_time")):
        _zoom(ax, [r[key] for r in runs.values()])
    labels = (
        (ax_loss, "training samples (sequences)", "validation loss (nats/byte)"),
        (ax_time, "training time (s)", "validation loss (nats/byte)"),
        (ax_bytes, "training samples (sequences)", "MiB sent per worker (cumulative)"),
        (ax_speed, "", "samples/s (light: whole run; dark: after the freeze)"),
    )
    for ax, xl, yl in labels:
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    for ax in (ax_loss, ax_time, ax_bytes):
        if ax.get_legend_handles_labels()[0]:  # asynchronous runs log no bytes curve
            ax.legend(fontsize=8)
    ax_speed.set_xticks(range(len(runs)), list(runs), fontsize=8, rotation=15)
    where = result.get("where", {})
    place = (
        f"{where['hosts']} testbed hosts at {where['rate']}"
        if where.get("kind") == "testbed"
        else f"{result['workers']} local workers"
    )
    fig.suptitle(
        title or f"{result['base']['model']} model, {place}, {result['date']}", fontsize=10
    )
    fig.tight_layout()
    return save_figure(fig, path)
