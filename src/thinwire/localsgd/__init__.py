"""Communicating less often: synchronous DiLoCo and asynchronous Local-SGD, on your model.

* :class:`DiLoCo` (``diloco.py``): H local steps, then one averaged outer Nesterov step;
  a context manager around the user's model and inner optimizer.
* Asynchronous Local-SGD on the user's pieces: a :class:`Task` (model factory,
  inner-optimizer factory, batch sources per shard, loss, optional evaluation) and one
  :class:`AsyncConfig` (every knob, each field's docstring its tuning guide).

  - :func:`run_async` (``async_runtime.py``): call it on every rank, under torchrun or
    :func:`thinwire.comm.launch.spawn`; rank 0 serves, ranks 1.. train.
  - :func:`load_trained` (``trained.py``): the trained model back, from rank 0's summary
    or the run's checkpoint directory.
  - :func:`rejoin_async` (``rejoin.py``): a killed worker process comes back.
  - :func:`simulate` (``virtual_clock.py``): the same server on a virtual clock, with a
    :class:`SimClock` (:data:`HETEROGENEITY` holds the paper's four speed levels).
  - :func:`for_method` (``methods.py``) sets a config up as one of the paper's
    :data:`METHODS` (sync, naive, poly, polythres, buffer, dn, dn-dylu), each with its
    tuned outer lr and momentum (:data:`TUNED`).
  - :func:`run_sweep` / :func:`summarize_sweep` (``sweep.py``): tune every method on one
    budget and the same seeds.

* The algorithm, free of transport: :class:`DelayedNesterov`, :class:`Nesterov`,
  :class:`AsyncBuffer` (``outer.py``), :class:`SpeedTracker`, :func:`dylu_steps`
  (``dylu.py``, Dynamic Local Updates), :class:`ServerCore` (``server.py``, the parameter
  server's logic: the sync barrier, the budget, who gets which round; theta, the outer
  step and the staleness rules in ``global_model.py``, the workers' liveness in
  ``roster.py``), :class:`PushGuard`
  (``push_guard.py``, the checks every push passes), :class:`LocalWorker`
  (``worker.py``), shards (``shards.py``: least-progress or the paper's sampling), the
  inner-state rule (:class:`InnerStateRule`, ``inner_state.py``), compressed pushes and
  pulls (``compression.py``).
* The wire: ``messages.py`` (every message, by name), ``transport.py`` (links and the
  store), ``server_loop.py`` (with ``server_loop_state.py``, its state and settings, and ``server_links.py``, admitting and dropping links) / ``worker_loop.py`` (the two loops), ``server_run.py``
  (rank 0's run and checkpoint); admission: ``auth.py`` (the run's token and the seal on
  every message), ``keyshare.py`` (the run key to the launched workers).

See ``docs/localsgd.md`` for the user guide.
"""

from thinwire.localsgd.async_runtime import run_async
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.diloco import DiLoCo
from thinwire.localsgd.dylu import SpeedTracker, dylu_steps
from thinwire.localsgd.inner_state import InnerStateRule
from thinwire.localsgd.methods import METHODS, TUNED, for_method, method_of
from thinwire.localsgd.outer import AsyncBuffer, DelayedNesterov, Nesterov
from thinwire.localsgd.pretrain import Start
from thinwire.localsgd.push_guard import PushGuard
from thinwire.localsgd.rejoin import rejoin_async
from thinwire.localsgd.server import ServerCore, Work
from thinwire.localsgd.server_run import IncompleteRunError
from thinwire.localsgd.sweep import run_sweep, summarize_sweep
from thinwire.localsgd.task import BatchSource, Task
from thinwire.localsgd.trained import load_trained
from thinwire.localsgd.virtual_clock import HETEROGENEITY, SimClock, simulate
from thinwire.localsgd.worker import LocalWorker

__all__ = [
    "HETEROGENEITY",
    "METHODS",
    "TUNED",
    "AsyncBuffer",
    "AsyncConfig",
    "BatchSource",
    "DelayedNesterov",
    "DiLoCo",
    "IncompleteRunError",
    "InnerStateRule",
    "LocalWorker",
    "Nesterov",
    "PushGuard",
    "ServerCore",
    "SimClock",
    "SpeedTracker",
    "Start",
    "Task",
    "Work",
    "dylu_steps",
    "for_method",
    "load_trained",
    "method_of",
    "rejoin_async",
    "run_async",
    "run_sweep",
    "simulate",
    "summarize_sweep",
]
