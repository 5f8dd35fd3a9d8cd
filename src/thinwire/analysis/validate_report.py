"""A validation's outputs: ``validation.json``, its markdown table and its plot.

:func:`write_result` writes all three for a result of
:func:`thinwire.analysis.validate.run_validation` (or
:func:`~thinwire.analysis.validate.repredict`) and :func:`read_result` reads one back,
so a table or plot can be redrawn without measuring again
(``python -m thinwire.analysis.validate --from-json``).

Reading the table: ``error`` is the co-located-profile prediction against the measured
mean (negative: predicted too fast); the alone-profile and nominal-link columns show how
much of that accuracy the co-located profile and the fitted link each bring.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from thinwire.analysis.formats import read_json
from thinwire.analysis.validate_compare import SCHEMES, summarize
from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text

__all__ = ["format_table", "plot_validation", "read_result", "write_result"]


def read_result(path: Path) -> dict[str, Any]:
    """A ``validation.json`` written by :func:`write_result`.

    Raises:
        ConfigError: the file cannot be read or is not a thinwire validation.
    """
    result = read_json(path, "validation")
    if not isinstance(result, dict) or result.get("format") != "thinwire.validation/1":
        raise ConfigError(f"{path}: not a thinwire validation")
    return result


def write_result(result: dict[str, Any], out_dir: Path, plot: Path | None) -> None:
    """Add the error summary to ``result``; write ``validation.json`` and ``validation.md``
    to ``out_dir``, and the plot to ``plot`` when given and there are rows to draw."""
    rows = [r for rate in result["rates"] for r in rate["rows"]]
    result["summary"] = {
        k: summarize(rows, k)
        for k in ("err_pct", "err_alone_pct", "err_nominal_pct", "err_recorded_pct")
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "validation.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out_dir / "validation.md", format_table(result) + "\n")
    if plot is not None and rows:
        plot_validation(result, plot)


_NAMES = {
    "ddp": "fp32 DDP (adamw)",
    "ddp@warmup": "1-bit warmup (fp32 DDP)",
    "fp32-fused": "1-bit warmup (fp32 fused)",
    "onebit": "1-bit (compression stage)",
    "diloco": "DiLoCo (per step, whole rounds)",
}


def format_table(result: dict[str, Any]) -> str:
    """Markdown: per rate and scheme the measured and predicted step, and the errors."""
    lines = [
        "| link | scheme | measured step (mean +- sd, median) | predicted | error "
        "| predicted compute + exposed | alone-profile prediction (error) "
        "| nominal-link prediction (error) | from the DDP run's record (error) | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in result["rates"]:
        ld = rate["load_avg_1min"]
        load = f"{min(ld.values()):.1f}-{max(ld.values()):.1f}" if ld else "-"
        for r in rate["rows"]:
            m, p = r["measured"], r["predicted"]
            lines.append(
                f"| {r['rate']} | {_NAMES.get(r['scheme'], r['scheme'])} "
                f"| {m['mean_s']:.3f} +- {m['stdev_s']:.3f}, {m['median_s']:.3f} s "
                f"| {p['step_s']:.3f} s | {r['err_pct']:+.1f}% "
                f"| {p['compute_s']:.3f} + {p['exposed_s']:.3f} s "
                f"| {r['predicted_alone']['step_s']:.3f} s ({r['err_alone_pct']:+.1f}%) "
                f"| {r['predicted_nominal']['step_s']:.3f} s ({r['err_nominal_pct']:+.1f}%) "
                f"| {_recorded_cell(r)} | {load} |"
            )
    for key, what in (("err_pct", ""), ("err_recorded_pct", " from the DDP run's record")):
        s = result.get("summary", {}).get(key)
        if s and s["rows"]:
            lines.append("")
            lines.append(
                f"Within {s['goal_pct']:.0f}%{what}: {s['within_goal']} of {s['rows']} cases "
                f"(worst {s['worst_abs_pct']:.1f}%, mean |error| {s['mean_abs_pct']:.1f}%)."
            )
    return "\n".join(lines)


def _recorded_cell(row: dict[str, Any]) -> str:
    pred = row.get("predicted_recorded")  # absent from validations before records
    if pred is None:
        return "-"
    return f"{pred['step_s']:.3f} s ({row['err_recorded_pct']:+.1f}%)"


def plot_validation(result: dict[str, Any], path: Path) -> Path:
    """Left: measured vs predicted step per rate and scheme (prediction split into compute
    and exposed communication). Right: predicted against measured, with the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for rate in result["rates"] for r in rate["rows"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["measured"]["mean_s"] for r in rows],
        0.4,
        yerr=[r["measured"]["stdev_s"] for r in rows],
        color="0.55",
        label="measured (mean, sd)",
    )
    comp = [r["predicted"]["compute_s"] for r in rows]
    ax.bar([x + 0.2 for x in xs], comp, 0.4, color="C0", label="predicted: compute")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["predicted"]["exposed_s"] for r in rows],
        0.4,
        bottom=comp,
        color="C1",
        label="predicted: exposed communication",
    )
    ax.scatter(
        [x + 0.2 for x in xs],
        [r["predicted_alone"]["step_s"] for r in rows],
        marker="_",
        s=300,
        color="k",
        zorder=3,
        label="prediction from the alone profile",
    )
    ax.set_xticks(list(xs), [f"{r['rate']}\n{r['scheme']}" for r in rows], fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title("step time on the emulated network: measured vs predicted")
    ax.legend(fontsize=7)
    lim = max(max(r["measured"]["mean_s"], r["predicted"]["step_s"]) for r in rows) * 1.1
    grid = [0, lim]
    bx.fill_between(grid, [0, lim * 0.85], [0, lim * 1.15], color="C2", alpha=0.2, label="+-15%")
    bx.plot(grid, grid, color="C2")
    for k, scheme in enumerate(SCHEMES):
        sel = [r for r in rows if r["scheme"] == scheme]
        bx.scatter(
            [r["measured"]["mean_s"] for r in sel],
            [r["predicted"]["step_s"] for r in sel],
            color=f"C{k + 3}",
            label=_NAMES[scheme],
        )
    bx.set_xlim(0, lim)
    bx.set_ylim(0, lim)
    bx.set_xlabel("measured s/step")
    bx.set_ylabel("predicted s/step (co-located profile)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
