"""A spawned rank's tie to its launcher: named for ``ps``, and gone when the launcher is.

:func:`thinwire.comm.launch.spawn` calls :func:`tie_to_launcher` first thing in every
rank it starts. Without it, a launcher killed with SIGKILL (which it cannot catch) leaves
its ranks training unattended: they keep writing checkpoints and race with the user's
``--resume``. Two mechanisms, so that one failing does not matter:

* **Parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel sends the rank
  SIGTERM the moment its parent exits, however it exits. The parent is the launcher, or
  the fork server the rank was forked from (:mod:`thinwire.comm.start_method`), which
  exits when the launcher does.
* **Watching the launcher**: a daemon thread waits for the launcher's pid to exit (a
  Linux pidfd, which cannot be fooled by a reused pid; elsewhere it polls every
  ``poll_s`` whether the parent changed, or whether the launcher's pid is gone). It then
  sends the rank SIGTERM, and if the rank is still alive ``grace_s`` later (its main
  thread stuck in a C++ collective that never returns), ends it with ``os._exit``.

SIGTERM raises :class:`SystemExit` in the rank's main thread, so ``finally`` blocks run
and a checkpoint being written is abandoned whole (its temporary file removed, the
previous checkpoint left as the latest).

The name: ``prctl(PR_SET_NAME)`` sets the process name that ``ps -e``, ``ps -o comm``,
``top`` and ``pgrep`` show (at most 15 characters: ``thinwire-rank0`` ..
``thinwire-rank99`` fit). ``ps aux`` and ``ps -f`` print the command line instead,
which stays the Python interpreter's; changing that needs a third-party package.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from thinwire.runlock import pid_alive

__all__ = ["process_name", "set_process_name", "tie_to_launcher"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_GET_NAME = 16
_NAME_MAX = 15  # the kernel keeps 16 bytes, NUL included


def _prctl() -> object | None:
    """libc's prctl, or None off Linux (or without a C library to ask)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "prctl", None)


def set_process_name(name: str) -> bool:
    """Set the name ``ps -e``/``top``/``pgrep`` show (truncated to 15 bytes); True if set."""
    prctl = _prctl()
    if prctl is None:
        return False
    raw = name.encode()[:_NAME_MAX]
    return prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0  # type: ignore[operator]


def process_name() -> str | None:
    """This process's name as the kernel reports it (None off Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _launcher_watch(launcher_pid: int, poll_s: float) -> Callable[[], None] | None:
    """A function that returns once the launcher has exited; None if it already has."""
    if os.getppid() == launcher_pid:  # a fresh interpreter: the launcher is the parent

        def parent_changes() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(poll_s)

        return parent_changes
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            fd = pidfd_open(launcher_pid)
        except ProcessLookupError:
            return None
        except OSError:
            fd = None  # a kernel without pidfds (before Linux 5.3): poll below
        if fd is not None:
            return lambda: select.select([fd], [], [])  # readable once the pid has exited
    if not pid_alive(launcher_pid):
        return None

    def pid_goes() -> None:
        while pid_alive(launcher_pid):
            time.sleep(poll_s)

    return pid_goes


def tie_to_launcher(launcher_pid: int, poll_s: float = 0.5, grace_s: float = 10.0) -> None:
    """End this process when ``launcher_pid`` exits; see the module docstring.

    Call it in the main thread of the child, as early as possible. If the launcher is
    already gone when it is called, the process exits at once.
    """
    signal.signal(signal.SIGTERM, _terminate)
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # type: ignore[operator]
    wait = _launcher_watch(launcher_pid, poll_s)
    if wait is None:  # died before the signal was armed
        os._exit(128 + signal.SIGTERM)

    def watch() -> None:
        wait()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)  # the main thread did not get to its handler

    threading.Thread(target=watch, daemon=True, name="thinwire-lifeline").start()
