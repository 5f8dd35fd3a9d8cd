"""The ranks' fork server, started before a command imports torch.

:func:`thinwire.comm.launch.spawn` forks its ranks from a warm fork server
(:mod:`thinwire.comm.start_method`) that imports :data:`PRELOAD` once: about 5 s of CPU
on a 2-core machine. Started at the first launch, as multiprocessing does, that import
only begins after the command's own (torch, about 2 s). ``thinwire train`` and
``thinwire compare`` start it first thing instead (:func:`warm_up`), so the two imports
overlap: the ranks start about 2 s sooner on every run. This module imports nothing but
the standard library, so that calling it costs nothing before torch is loaded.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "PRELOAD", "warm_up"]

ENV = "THINWIRE_START_METHOD"
"""Environment variable that picks the start method: ``forkserver`` (default) or ``spawn``."""

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "thinwire.comm.launch",
    "thinwire.train.trainer",
]
"""Imported once by the fork server, so that no rank imports them again. Not ``__main__``
(multiprocessing's default): the server must not run the user's script. ``torch._dynamo``
because every ``torch.optim.Optimizer`` imports it on construction: about 2.4 s of CPU on
this kind of machine, in every rank that builds an optimizer; thinwire's trainer, 0.3 s
more. Neither import starts a thread or computes."""


def warm_up() -> None:
    """Start the fork server now, importing :data:`PRELOAD` in the background; a later
    launch forks from it. Does nothing where ranks are not forked from a fork server
    (``THINWIRE_START_METHOD=spawn``, or no fork server on this platform)."""
    import multiprocessing
    from multiprocessing import forkserver

    if os.environ.get(ENV, "").strip() not in ("", "forkserver"):
        return
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
