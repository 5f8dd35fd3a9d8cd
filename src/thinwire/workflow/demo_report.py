"""Step 3 of ``thinwire demo``: the two runs side by side, as a table and a figure.

Each row is one run's summary with the demo's additions (predicted and measured step
after the freeze, NIC bytes); the table puts LAMB and 1-bit LAMB in two columns with
their ratio; the figure is the comparison's own
(:func:`thinwire.train.compare_report.plot_comparison`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LABELS", "side_by_side"]

LABELS = {"lamb": "LAMB", "onebit-lamb": "1-bit LAMB"}
"""How the demo names its two algorithms."""


def side_by_side(rows: list[dict[str, Any]]) -> str:
    """A table with one column per algorithm and the 1-bit/fp32 ratio."""
    a, b = rows[0], rows[1]

    def ratio(x: float | None, y: float | None) -> str:
        return f"{y / x:.2f}x" if x and y else "-"

    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / 2**20:,.2f} MiB"

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    def secs(key: str) -> tuple[str, str, str]:
        x, y = a.get(key), b.get(key)
        return sec(x), sec(y), ratio(x, y)

    lines = [
        ("", LABELS[a["algo"]], LABELS[b["algo"]], "1-bit / fp32"),
        (
            "final validation loss",
            num(a["final_val_loss"], ".4f"),
            num(b["final_val_loss"], ".4f"),
            ratio(a["final_val_loss"], b["final_val_loss"]),
        ),
        (
            "samples/s, whole run",
            num(a["samples_per_s"], ".1f"),
            num(b["samples_per_s"], ".1f"),
            ratio(a["samples_per_s"], b["samples_per_s"]),
        ),
        (
            "samples/s, after freeze",
            num(a["compression_samples_per_s"], ".1f"),
            num(b["compression_samples_per_s"], ".1f"),
            ratio(a["compression_samples_per_s"], b["compression_samples_per_s"]),
        ),
        ("step after freeze, predicted", *secs("predicted_step_s")),
        ("step after freeze, measured", *secs("measured_step_s")),
        (
            "training time",
            f"{a['train_time_s']:.1f} s",
            f"{b['train_time_s']:.1f} s",
            ratio(a["train_time_s"], b["train_time_s"]),
        ),
        (
            "bytes sent per worker",
            mib(a["comm_bytes"]),
            mib(b["comm_bytes"]),
            ratio(a["comm_bytes"], b["comm_bytes"]),
        ),
        (
            "bytes on each host's NIC",
            mib(a["nic_bytes"]),
            mib(b["nic_bytes"]),
            ratio(a["nic_bytes"], b["nic_bytes"]),
        ),
    ]
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    return "\n".join(
        "  "
        + row[0].ljust(widths[0])
        + "  "
        + "  ".join(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))
        for row in lines
    )
