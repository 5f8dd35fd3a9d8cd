"""Shared test settings: small models, the repository root, the shared data folder."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from thinwire.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]

# Measured machine prices (thinwire.analysis.costs.machine_costs) are cached per test
# session, never in the home directory of the machine that runs the tests. Ranks that a
# test spawns import this file too: they share the session's folder (inherited with the
# environment), and only the process that made it removes it.
if "THINWIRE_CACHE_DIR" not in os.environ:
    os.environ["THINWIRE_CACHE_DIR"] = tempfile.mkdtemp(prefix="thinwire-test-cache-")
    atexit.register(shutil.rmtree, os.environ["THINWIRE_CACHE_DIR"], ignore_errors=True)

TINY_FLAGS = ["--seq-len", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "32"]
"""``thinwire train`` flags of the tiny model every CLI test trains (about 21K parameters)."""


class WarningLines(logging.Handler):
    """The messages logged at WARNING and above, in order: for ranks a test spawns, whose
    log records pytest's ``caplog`` does not see."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def tiny_config(tmp_path: Path, **overrides: object) -> TrainConfig:
    """A model and run small enough that a few ranks train tens of steps in seconds."""
    cfg = TrainConfig(
        model="tiny",
        seq_len=16,
        n_layer=1,
        n_head=2,
        n_embd=32,
        batch_size=4,
        steps=12,
        eval_interval=6,
        eval_sequences=8,
        log_interval=2,
        checkpoint_interval=6,
        warmup_steps=2,
        out_dir=str(tmp_path / "run"),
        progress=False,
    )
    for k, v in overrides.items():
        if not hasattr(cfg, k):  # setattr would add it, and the run would never read it
            raise TypeError(f"TrainConfig has no field {k!r}")
        setattr(cfg, k, v)
    return cfg


def tiny_async_config(out_dir: Path, **overrides: object) -> TrainConfig:
    """An ``async-diloco`` run of the same tiny model (rank 0 serves, ranks 1.. train),
    checkpointed into ``out_dir``; ``overrides`` are TrainConfig fields."""
    base: dict[str, object] = dict(
        algo="async-diloco",
        model="tiny",
        n_layer=1,
        n_embd=32,
        n_head=2,
        seq_len=16,
        steps=12,
        local_steps=2,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        eval_interval=6,
        eval_sequences=8,
        checkpoint_interval=4,
        out_dir=str(out_dir),
        progress=False,
        device="cpu",
    )
    return TrainConfig(**(base | overrides))  # type: ignore[arg-type]


def own_clusters() -> set[str]:
    """The testbed clusters this test process made and still has: other test processes
    (``pytest -n``) may have clusters of their own up at the same time."""
    from thinwire.testbed import list_clusters

    return {c.cluster_id for c in list_clusters() if c.owner_pid == os.getpid()}


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running the ``thinwire`` command in a subprocess."""
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _in_env(
    env: dict[str, str], cwd: str, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


def process(target: Callable[..., Any], *args: Any) -> Any:
    """A process (not started) that runs ``target(*args)``: a fork of thinwire's warm fork
    server (:mod:`thinwire.comm.start_method`), as a spawned rank is, with this process's
    environment and directory as they are now (the server's are from when it started).
    Events and queues for it come from :func:`thinwire.comm.start_method.context`."""
    from thinwire.comm.start_method import context

    return context().Process(target=_in_env, args=(dict(os.environ), os.getcwd(), target, args))


def interruptible() -> None:
    """``preexec_fn`` for children a test interrupts with SIGINT: a child inherits an
    ignored SIGINT when the suite runs from a background shell job (``cmd &``), and
    Python then never raises KeyboardInterrupt in it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


FAST_LANE_LIMIT_S = 30
"""The fast lane (``make check``, ``pytest --lane fast``) keeps a test whose declared
``timeout`` is at most this, and every test marked ``smoke``: the unit tests and one
end-to-end smoke per pillar, in a few minutes on 2 cores. ``make test`` runs everything."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=("full", "fast"),
        default="full",
        help="fast: unit tests and one smoke per pillar (make check); full: every test",
    )


def _declared_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    return float(value) if value is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--lane") != "fast":
        return
    keep, drop = [], []
    for item in items:
        timeout = _declared_timeout(item)
        slow = item.get_closest_marker("slow") is not None or item.get_closest_marker("root")
        long = slow or (timeout is not None and timeout > FAST_LANE_LIMIT_S)
        (drop if long and item.get_closest_marker("smoke") is None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
