"""Checkpoints inside one simulated run, so that a run of hours survives being stopped.

A long-tier run (a larger model, thousands of inner steps per worker, from a trained
start) takes one to two hours of a CPU core; a sweep of them takes days. Hand
:func:`~thinwire.localsgd.algorithm.virtual_clock.simulate` a :class:`SimCheckpoint` and
it saves the whole run every ``every_s`` seconds of wall time; started again with the
same checkpoint, the run goes on from the last save and ends with the very numbers an
uninterrupted run gives (bit for bit: what is saved is everything the run reads: theta
and the outer optimizer, the server's roster, shards, speeds and push guard, every
worker's inner optimizer, the codecs' residuals and views, the rounds in flight, the
random generators and the curve so far)::

    ckpt = SimCheckpoint(Path("runs/dn-dylu.partial.pt"), every_s=600, tag=my_fingerprint)
    run = simulate(task, cfg, clock, checkpoint=ckpt)   # again after a kill: resumes
    ckpt.discard()                                       # once the result is kept

``tag`` names the run the file belongs to (the sweep uses the run's fingerprint: config,
clock, seed and task): a file with another tag is not resumed from, and the run starts
over and replaces it, as a cached result of other settings is replaced. A file that
cannot be read is said so in one line and the run starts over.

Costs: a save writes the model about ``6 + 3 W`` times over (theta, the outer state,
each worker's Adam moments and pulled view, the rounds in flight; about 150 MB for the
1.8M-parameter ``mini`` GPT and 4 workers) and takes well under a second; every 10
minutes (the CLI's default) is noise against the run. Files are written then renamed,
so a kill mid-save leaves the previous save whole. ``every_s=0`` saves after every
arrival (tests; a run whose every round is precious).

Both kinds of simulated run keep one: the server methods' (every asynchronous method and
plain sync DiLoCo) and Streaming DiLoCo's (the ``sync`` method with fragments or a
quantizer), which saves between two of its stretches of inner steps.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import ConfigError
from thinwire.io import atomic_save
from thinwire.safeload import safe_load

__all__ = ["SimCheckpoint", "check_same_run"]

log = logging.getLogger(__name__)


@dataclass
class SimCheckpoint:
    """Where and how often one simulated run keeps its state (see the module docstring).

    Args:
        path: the file (written then renamed; its folder is made if missing).
        every_s: wall seconds between saves; 0 saves after every arrival.
        tag: what the run is; a file with another tag is not resumed from.
    """

    path: Path
    every_s: float = 600.0
    tag: str = ""
    resumed_at: int | None = field(default=None, init=False)
    """Inner steps the run had applied when it was resumed from the file (None: it
    started from its start); set by the simulator."""
    _last: float = field(default_factory=time.monotonic, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not (self.every_s >= 0 and math.isfinite(self.every_s)):
            raise ConfigError(f"checkpoint interval must be >= 0 seconds, got {self.every_s}")

    def load(self) -> dict[str, Any] | None:
        """The saved state of this run, or None (no file, another run's, unreadable)."""
        if not self.path.exists():
            return None
        try:
            blob = safe_load(self.path, "simulation checkpoint")
        except ConfigError as exc:
            log.warning("%s; the run starts from its start", exc)
            return None
        if not isinstance(blob, dict) or blob.get("tag") != self.tag or "state" not in blob:
            return None  # another run's (other settings): replaced at the first save
        self._last = time.monotonic()
        return blob["state"]

    def due(self) -> bool:
        """Whether ``every_s`` has passed since the last save (or the start)."""
        return time.monotonic() - self._last >= self.every_s

    def save(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (plain values and tensors), replacing the last save whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_save({"tag": self.tag, "state": state}, self.path)
        self._last = time.monotonic()

    def discard(self) -> None:
        """Remove the file (the run's result is kept elsewhere)."""
        self.path.unlink(missing_ok=True)


def check_same_run(saved: tuple[int, int], run: tuple[int, int]) -> None:
    """Refuse a saved state of another shape of run: ``(parameters, workers)`` each."""
    if saved != run:
        raise ConfigError(
            f"the simulation checkpoint holds {saved[0]} parameters and {saved[1]} workers, "
            f"this run has {run[0]} and {run[1]}: it is another run's (delete it, or give "
            "another path)"
        )
