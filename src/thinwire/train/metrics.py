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
from thinwire.io import atomic_write_text

__all__ = ["MetricsWriter", "Progress", "plain", "read_metrics"]


def plain(key: str, value: Any) -> bool | int | float | str | None:
    """``value`` as a plain JSON scalar: one-element tensors and numpy scalars become Python
    numbers, so a metric computed from optimizer state can never break the writer (or put
    a tensor's repr in the file). Anything else raises a TypeError naming the key."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic) or (torch.is_tensor(value) and value.numel() == 1):
        return value.item()
    raise TypeError(f"metric {key!r} is a {type(value).__name__}, not a number or a string")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
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
            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

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
