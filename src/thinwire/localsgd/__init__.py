"""Communicating less often: synchronous DiLoCo and asynchronous Local-SGD, on your model.

The package has two halves and four modules both use. ``algorithm/`` holds the math
and the rules (what a run computes and decides); ``runtime/`` holds the processes and
the wire that run them over the network. Nothing in ``algorithm/`` imports ``runtime/``.
Shared: ``settings.py`` (:class:`LocalSGDSettings` and :class:`AsyncSettings`, every
Local-SGD knob defined once), ``config.py`` (:class:`AsyncConfig`: those settings plus a
run's budget and checkpoints), ``task.py`` (:class:`Task`, what the user hands a run) and
``messages.py`` (what the server and its workers say, by name).

* :class:`DiLoCo` (``algorithm/diloco.py``): H local steps, then one averaged outer
  Nesterov step; a context manager around the user's model and inner optimizer.
* :class:`StreamingDiLoCo` (``algorithm/streaming.py``, its schedule in
  ``streaming_fragments.py``): DiLoCo with the model's fragments synced in turn,
  overlapped with training, and quantized (int8, fp8, int4, 1-bit) with error feedback.
* Asynchronous Local-SGD on the user's pieces: a :class:`Task` (model factory,
  inner-optimizer factory, batch sources per shard, loss, optional evaluation) and one
  :class:`AsyncConfig` (every knob, each field's docstring its tuning guide).

  - :func:`run_async` (``runtime/launch.py``): call it on every rank, under torchrun or
    :func:`thinwire.comm.launch.spawn`; rank 0 serves, ranks 1.. train.
  - :func:`load_trained` (``runtime/trained.py``): the trained model back, from rank 0's
    summary or the run's checkpoint directory.
  - :func:`rejoin_async` (``runtime/rejoin.py``): a killed worker process comes back.
  - :func:`simulate` (``algorithm/virtual_clock.py``): the same server on a virtual
    clock, with a :class:`SimClock` (:data:`HETEROGENEITY` holds the paper's four speed
    levels) and, for runs of hours, a :class:`SimCheckpoint` (stopped, a run goes on
    from its last save).
  - :func:`for_method` (``algorithm/methods.py``) sets a config up as one of the paper's
    :data:`METHODS` (sync, naive, poly, polythres, buffer, dn, dn-dylu), each with its
    tuned outer lr and momentum (:data:`TUNED`).
  - :func:`run_sweep` / :func:`summarize_sweep` (``algorithm/sweep.py``): tune every
    method on one budget and the same seeds.

* The algorithm (``algorithm/``): :class:`DelayedNesterov`, :class:`Nesterov`,
  :class:`AsyncBuffer` (``outer.py``), :class:`SpeedTracker`, :func:`dylu_steps`
  (``dylu.py``, Dynamic Local Updates), :class:`ServerCore` (``server_core.py``, the
  parameter server's logic: the sync barrier, the budget, who gets which round; theta,
  the outer step and the staleness rules in ``global_model.py``, the workers' liveness
  in ``roster.py``), :class:`PushGuard` (``push_guard.py``, the checks every push
  passes), :class:`LocalWorker` (``worker_core.py``, a worker's rounds of training),
  shards (``shards.py``: least-progress or the paper's sampling), the inner-state rule
  (:class:`InnerStateRule`, ``inner_state.py``), compressed pushes and pulls
  (``compression.py``), where a run starts (:class:`Start`, ``pretrain.py``).
* The runtime (``runtime/``): ``launch.py`` (what every launched rank runs),
  ``server_process.py`` (rank 0's process: its run, checkpoint and summary), the two
  loops ``server_loop.py`` (with ``server_loop_state.py``, its settings and state, and
  ``server_links.py``, admitting and dropping links) and ``worker_loop.py``,
  ``transport.py`` (links and the store, with ``link_io.py`` and ``run_store.py``);
  admission: ``auth.py`` (the run's token and the seal on every message),
  ``keyshare.py`` (the run key to the launched workers).

See ``docs/localsgd.md`` for the user guide and ``docs/architecture.md`` for the file map.
"""

from thinwire.localsgd.algorithm.diloco import DiLoCo
from thinwire.localsgd.algorithm.dylu import SpeedTracker, dylu_steps
from thinwire.localsgd.algorithm.inner_state import InnerStateRule
from thinwire.localsgd.algorithm.methods import METHODS, TUNED, TUNED_TRAINED, for_method, method_of
from thinwire.localsgd.algorithm.outer import AsyncBuffer, DelayedNesterov, Nesterov
from thinwire.localsgd.algorithm.pretrain import Start
from thinwire.localsgd.algorithm.push_guard import PushGuard
from thinwire.localsgd.algorithm.server_core import ServerCore, Work
from thinwire.localsgd.algorithm.streaming import StreamingDiLoCo
from thinwire.localsgd.algorithm.sweep import run_sweep, summarize_sweep
from thinwire.localsgd.algorithm.virtual_clock import (
    HETEROGENEITY,
    SimCheckpoint,
    SimClock,
    simulate,
)
from thinwire.localsgd.algorithm.worker_core import LocalWorker
from thinwire.localsgd.config import AsyncConfig
from thinwire.localsgd.runtime.launch import run_async
from thinwire.localsgd.runtime.rejoin import rejoin_async
from thinwire.localsgd.runtime.server_process import IncompleteRunError
from thinwire.localsgd.runtime.trained import load_trained
from thinwire.localsgd.settings import AsyncSettings, LocalSGDSettings
from thinwire.localsgd.task import BatchSource, Task

__all__ = [
    "HETEROGENEITY",
    "METHODS",
    "TUNED",
    "TUNED_TRAINED",
    "AsyncBuffer",
    "AsyncConfig",
    "AsyncSettings",
    "BatchSource",
    "DelayedNesterov",
    "DiLoCo",
    "IncompleteRunError",
    "InnerStateRule",
    "LocalSGDSettings",
    "LocalWorker",
    "Nesterov",
    "PushGuard",
    "ServerCore",
    "SimCheckpoint",
    "SimClock",
    "SpeedTracker",
    "Start",
    "StreamingDiLoCo",
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
