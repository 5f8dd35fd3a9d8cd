"""Metrics: JSON lines on rank 0, optional TensorBoard, a progress bar on long runs.

``metrics.jsonl`` holds one JSON object per line. Training records carry ``step``,
``samples``, ``loss``, ``lr``, ``time_s`` (training seconds so far, excluding evaluation
and checkpointing), ``step_s``, ``comm_bytes`` (bytes this rank put on the wire so far,
analytical, see :mod:`thinwire.comm.accounting`) and ``comm_bytes_per_step`` (averaged
since the previous record); evaluation
records carry ``step``, ``samples``, ``val_loss`` and ``val_ppl``. Units are in the key
names: seconds (``_s``), bytes (``_bytes``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.errors import ConfigError
from thinwire.io import atomic_write_text, read_input_bytes

__all__ = ["METRICS_LIMIT", "MetricsWriter", "Progress", "plain", "read_metrics", "read_records"]


def plain(key: str, value: Any) -> bool | int | float | str | None:
    """``value`` as a plain JSON scalar: one-element tensors and numpy scalars become Python
    numbers, so a metric computed from optimizer state can never break the writer (or put
    a tensor's repr in the file). Anything else raises a TypeError naming the key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic) or (torch.is_tensor(value) and value.numel() == 1):
        return value.item()
    raise TypeError(f"metric {key!r} is a {type(value).__name__}, not a number or a string")


METRICS_LIMIT = 1 << 30
"""The most bytes :func:`read_metrics` reads: a million records of a long run are about
250 MB; past this the file is not a record thinwire wrote."""


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], list[tuple[int, bytes]]]:
    """The records of a ``metrics.jsonl`` file, and the lines that are not records.

    A line is a record if it is UTF-8 JSON of an object whose ``step``, if any, is a
    whole number. Anything else (the half line a crash leaves at the end, a line edited
    by hand, stray bytes) comes back as ``(line number, bytes)`` instead of stopping the
    reader: a run must never be unrecoverable because of its log.

    Raises:
        ConfigError: ``path`` is missing, not a regular file or larger than
            :data:`METRICS_LIMIT` (one line).
    """
    records: list[dict[str, Any]] = []
    bad: list[tuple[int, bytes]] = []
    data = read_input_bytes(path, "metrics file", METRICS_LIMIT)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            record = None
        step = record.get("step", 0) if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            bad.append((number, raw))
        else:
            records.append(record)
    return records, bad


def _skipped(path: str | Path, bad: list[tuple[int, bytes]]) -> str:
    lines = "line" if len(bad) == 1 else "lines"
    return f"{path}: {len(bad)} unreadable {lines} (the first is line {bad[0][0]})"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file; lines that are not records are skipped
    and counted in one warning line on stderr (see :func:`read_records`)."""
    records, bad = read_records(path)
    if bad:
        print(f"thinwire: warning: {_skipped(path, bad)} skipped", file=sys.stderr)
    return records


class MetricsWriter:
    """Appends records to ``out_dir/metrics.jsonl`` (and TensorBoard); a no-op off rank 0.

    On resume from step ``resume_step``, records after that step (written by the
    interrupted run after its last checkpoint) are dropped first, so the file reads as
    one uninterrupted run. A new run (``resume_step`` None) refuses an existing file: it
    belongs to another run, and is never deleted.
    """

    def __init__(
        self,
        out_dir: Path,
        enabled: bool,
        resume_step: int | None = None,
        tensorboard: bool = False,
    ) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._tb: Any = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            records, bad = read_records(self.path)
            if bad:
                self._set_aside(bad)
            kept = [r for r in records if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.exists():
            # Never delete another run's record (the trainer refuses such a directory
            # before it gets here; this guards every other caller).
            raise ConfigError(
                f"{self.path} already holds another run's metrics; pass --resume to "
                "continue that run, or choose another --out"
            )
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the whole run
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "--tensorboard needs the tensorboard package: pip install 'thinwire[tensorboard]'"
                ) from None
            # A resumed run logs its steps after the checkpoint again: TensorBoard drops
            # the stopped run's events from there on when it reads the directory.
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=purge)

    def _set_aside(self, bad: list[tuple[int, bytes]]) -> None:
        """Append the lines that are not records to ``metrics.jsonl.unreadable`` (so that
        nothing the run wrote is lost) and say so in one line."""
        aside = self.path.with_name(self.path.name + ".unreadable")
        with open(aside, "ab") as f:
            f.write(b"".join(raw + b"\n" for _, raw in bad))
        print(
            f"thinwire: warning: {_skipped(self.path, bad)} set aside in {aside.name}; "
            "the run resumes without them",
            file=sys.stderr,
        )

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {key: plain(key, value) for key, value in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A tqdm bar on rank 0 when stderr is a terminal (and tqdm is installed); else silent."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str) -> None:
        self._bar: Any = None
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, n: int, **postfix: str) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
