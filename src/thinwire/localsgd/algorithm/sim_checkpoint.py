"""Checkpoints inside one simulated run, so that a run of hours survives being stopped.

A long-tier run (a larger model, thousands of inner steps per worker, from a trained
start) takes one to two hours of a CPU core; a sweep of them takes days. Hand
:func:`~thinwire.localsgd.algorithm.virtual_clock.simulate` a :class:`SimCheckpoint` and
it saves the whole run every ``every_s`` seconds of wall time; started again with the
same checkpoint and the same config and clock, the run goes on from the last save and
ends with the very numbers an uninterrupted run gives::

    ckpt = SimCheckpoint(Path("runs/dn-dylu.partial.pt"), every_s=600, tag="dn-dylu seed 1")
    run = simulate(task, cfg, clock, checkpoint=ckpt)   # again after a kill: resumes
    ckpt.discard()                                       # once the result is kept

What is saved is everything the run reads: theta and the outer optimizer, the server's
roster, shards, speeds and push guard, every worker's inner optimizer, the codecs'
residuals and views, the rounds in flight, the curve so far, the clock's jitter and the
shard sampler's generators, and the process-wide generators a task of yours may draw
from (:func:`generator_states`): torch's CPU one (dropout), CUDA's, Python's ``random``
and NumPy's global one (``np.random.rand``, a data order shuffled with it). So bit for
bit holds for thinwire's tasks and for such a task; one that draws from generator
objects of its own (``np.random.default_rng()``, a ``torch.Generator``), or whose model
has buffers the training changes, resumes close but not identical. The same torch
build and thread count (``--threads``) are assumed: another may round differently.

Which run a file belongs to: the simulator stores a digest of the config and the clock,
and ``tag`` is yours (the sweep passes its run fingerprint, which adds the task: model,
data, ...). A file of other settings or another tag is not resumed from; the run starts
over and replaces it at its first save, as a cached result of other settings is
replaced. A file that cannot be read, or one of another thinwire version, is said so
in one line and the run starts over; one that fits the settings but not the model is
refused in one line and left alone.

Costs: a save holds the model ``3 + 3 W`` times over with uncompressed pulls (theta,
Delayed Nesterov's two buffers, each worker's two AdamW moments and its round in
flight), ``W`` more with 1-bit pushes (the residuals) and ``2 W`` more with compressed
pulls (both sides' views): 110.7 MB for the 1.84M-parameter ``mini`` GPT and 4 workers,
about 0.2 s to write (``tools/sim_checkpoint_cost.py``); every 10 minutes (the CLI's
default) that is noise. Files are written then renamed, so a kill mid-save leaves the
previous save whole; a save that fails (a full disk) is said in one line and the run
goes on. ``every_s=0`` saves after every arrival (tests; a run whose every round is
precious), ``every_s=math.inf`` never saves but still resumes from a file left earlier.

Both kinds of simulated run keep one: the server methods' (every asynchronous method and
plain sync DiLoCo; saved between two arrivals) and Streaming DiLoCo's (the ``sync``
method with fragments or a quantizer; saved between two stretches of inner steps). So
does a pretraining (:func:`~thinwire.localsgd.algorithm.pretrain.pretrain`; saved
between two steps).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.errors import ConfigError, first_line
from thinwire.io import atomic_save
from thinwire.safeload import safe_load

__all__ = [
    "SimCheckpoint",
    "check_same_run",
    "generator_states",
    "restore_generators",
    "seed_generators",
]

log = logging.getLogger(__name__)

_FORMAT = 1  # the layout of a saved file; another is not resumed from


@dataclass
class SimCheckpoint:
    """Where and how often one simulated run keeps its state (see the module docstring).

    Args:
        path: the file (written then renamed; its folder is made if missing).
        every_s: wall seconds between saves; 0 saves after every arrival, ``math.inf``
            never (a file left earlier is still resumed from).
        tag: what the run is, in your words; a file with another tag is not resumed from.
    """

    path: Path
    every_s: float = 600.0
    tag: str = ""
    resumed_at: int | None = field(default=None, init=False)
    """Inner steps the run had applied when it was resumed from the file (None: it
    started from its start); set by the simulator."""
    _run: str = field(default="", init=False, repr=False)
    _last: float = field(default_factory=time.monotonic, init=False, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not self.every_s >= 0:  # nan too
            raise ConfigError(f"checkpoint interval must be >= 0 seconds, got {self.every_s}")

    def resume(self, settings: tuple[Any, ...], restore: Callable[[dict[str, Any]], None]) -> bool:
        """Start the run of ``settings`` (dataclasses: its config and clock):
        ``restore(state)`` from the file if it holds this run, and True; else False (no
        file, another run's, unreadable: the run starts from its start)."""
        self._run = _digest(settings)
        self.resumed_at, self._last = None, time.monotonic()
        state = self.peek(settings)
        if state is None:
            return False
        try:
            restore(state)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, AssertionError) as exc:
            raise ConfigError(
                f"simulation checkpoint {self.path} does not fit this run "
                f"({type(exc).__name__}: {first_line(exc)}): "
                "delete it, or give another path"
            ) from None
        return True

    def peek(self, settings: tuple[Any, ...]) -> dict[str, Any] | None:
        """The state the file holds for the run of ``settings``, without starting it
        (None: no file, another run's, or one that cannot be read, said in one line;
        a ConfigError: one of this run's that holds no state)."""
        if not self.path.exists():
            return None
        try:
            blob = safe_load(self.path, "simulation checkpoint")
        except ConfigError as exc:
            log.warning("%s; the run starts from its start", exc)
            return None
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            log.warning(
                "simulation checkpoint %s is of another thinwire version; the run starts "
                "from its start",
                self.path,
            )
            return None
        if (blob.get("tag"), blob.get("run")) != (self.tag, _digest(settings)):
            return None  # another run's (other settings): replaced at the first save
        state = blob.get("state")
        if not isinstance(state, dict):
            raise ConfigError(
                f"simulation checkpoint {self.path} holds no run state: delete it, or give "
                "another path"
            )
        return state

    def due(self) -> bool:
        """Whether ``every_s`` has passed since the last save (or the start)."""
        return time.monotonic() - self._last >= self.every_s

    def save(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (plain values and tensors), replacing the last save whole; a
        failed write is said in one line and the run goes on."""
        blob = {"format": _FORMAT, "tag": self.tag, "run": self._run, "state": state}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(blob, self.path)
        except OSError as exc:
            log.warning(
                "could not save the simulation to %s (%s); the run goes on, and a stop now "
                "resumes from the save before",
                self.path,
                exc.strerror or exc,
            )
        self._last = time.monotonic()

    def discard(self) -> None:
        """Remove the file (the run's result is kept elsewhere)."""
        self.path.unlink(missing_ok=True)


def _digest(settings: tuple[Any, ...]) -> str:
    """Which run ``settings`` describe, as the file stores it."""
    text = json.dumps([asdict(x) for x in settings], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_same_run(saved: tuple[int, int], run: tuple[int, int]) -> None:
    """Refuse a saved state of another shape of run: ``(parameters, workers)`` each."""
    if saved != run:
        raise ConfigError(
            f"the simulation checkpoint holds {saved[0]} parameters and {saved[1]} workers, "
            f"this run has {run[0]} and {run[1]}: it is another run's (delete it, or give "
            "another path)"
        )


def generator_states() -> dict[str, Any]:
    """The process-wide random generators a task may draw from, as plain data: torch's
    CPU generator, CUDA's (when CUDA is in use), Python's ``random`` and NumPy's global
    generator (when it is NumPy's default kind). :func:`restore_generators` puts them
    back."""
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, tuple):
        kind, keys, pos, has_gauss, gauss = numpy_state
        numpy_saved = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    else:  # np.random.set_bit_generator(...) swapped the kind: said at the restore
        numpy_saved = None
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": (version, list(internal), gauss_next),
        "numpy": numpy_saved,
    }


def restore_generators(states: dict[str, Any]) -> None:
    """Put back :func:`generator_states`; a generator that could not be saved or put
    back (CUDA's on a machine with another number of devices, NumPy's of another kind)
    is said in one line, and the run goes on drawing from it as it is."""
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.init()  # else a seed queued for CUDA's start would overwrite it
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("the save's CUDA generators (%d devices) are not put back here", len(cuda))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if states.get("numpy") is None:
        log.warning("NumPy's global generator was not saved (not NumPy's default kind)")
        return
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def seed_generators(seed: int) -> None:
    """Seed the generators of :func:`generator_states` (CUDA's through torch's) from
    ``seed``: a sweep does this before each run and pretraining, so that what a run
    draws does not depend on what ran before it in the process."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
