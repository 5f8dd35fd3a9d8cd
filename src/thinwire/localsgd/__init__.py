"""Communicating less often: synchronous DiLoCo and asynchronous Local-SGD.

* :class:`DiLoCo` (``diloco.py``): H local steps, then one averaged outer Nesterov step;
  a context manager around the user's model and inner optimizer.
* :class:`DelayedNesterov`, :class:`Nesterov` (``outer.py``): outer optimizers for
  asynchronous arrivals.
* :class:`SpeedTracker`, :func:`dylu_steps` (``dylu.py``): Dynamic Local Updates.
* :class:`ServerCore` (``server.py``): the parameter server's logic, transport-free.
* ``async_runtime.run`` (``--algo async-diloco``): the server and workers on
  torch.distributed, with rank 0's run wiring in ``server_run.py`` and
  ``rejoin.rejoin`` (``--rejoin RANK``) for a worker process that was killed;
  ``simulator.simulate``: the same server on a virtual clock.

See ``docs/localsgd.md`` for the user guide.
"""

from thinwire.localsgd.diloco import DiLoCo
from thinwire.localsgd.dylu import SpeedTracker, dylu_steps
from thinwire.localsgd.outer import DelayedNesterov, Nesterov
from thinwire.localsgd.server import ServerCore, Work

__all__ = [
    "DelayedNesterov",
    "DiLoCo",
    "Nesterov",
    "ServerCore",
    "SpeedTracker",
    "Work",
    "dylu_steps",
]
