"""How :func:`thinwire.comm.launch.spawn` starts its ranks: from a warm fork server.

A fresh interpreter per rank (multiprocessing's ``spawn``) imports torch again in every
rank: about 2 s of CPU each, so 4 ranks on a 2-core machine wait 5-10 s before their
first collective, on every launch. The ``forkserver`` start method pays that import
once: the first launch starts a small server process that imports torch and thinwire's
launcher, and every rank after that is a fork of it (a tenth of a second for 4 ranks).

It keeps what made ``spawn`` the safe choice: the server forks before any torch thread
pool, CUDA context or process group exists (it imports and never computes), so a rank
inherits no half-initialised runtime. What a fork server would otherwise get wrong is
put right by the launcher: each rank gets the launcher's environment as it is at launch
(the server's is from when it started), and its working directory and ``sys.path``
(multiprocessing sends those). A rank's parent is the server, not the launcher, so the
lifeline watches the launcher's pid (:mod:`thinwire.comm.lifeline`).

``THINWIRE_START_METHOD=spawn`` brings back one fresh interpreter per rank (e.g. to rule
the server out when debugging); where the platform has no fork server, ``spawn`` is used.
"""

from __future__ import annotations

import os
from typing import Any

import torch.multiprocessing as mp

from thinwire.errors import ConfigError
from thinwire.prestart import ENV, PRELOAD

__all__ = ["ENV", "PRELOAD", "context", "start_method"]

# ENV and PRELOAD live where a command can start the server before it imports torch.

_METHODS = ("forkserver", "spawn")


def start_method() -> str:
    """The start method launches use: ``THINWIRE_START_METHOD`` if set, else the fork
    server where the platform has one.

    Raises:
        ConfigError: the variable names another method (one line).
    """
    asked = os.environ.get(ENV, "").strip()
    if asked and asked not in _METHODS:
        raise ConfigError(
            f"{ENV}={asked!r} is not a start method thinwire uses; choose one of {_METHODS}"
        )
    available = mp.get_all_start_methods()
    if asked:
        return asked if asked in available else "spawn"
    return "forkserver" if "forkserver" in available else "spawn"


def context() -> Any:
    """The multiprocessing context to start ranks from (see :func:`start_method`). The
    fork server's preload is set before it first starts; a server already started (by
    the user's own code) is used as it is, only without the head start."""
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx
