"""A worker that is an island of ranks: FSDP2 inside it, asynchronous Local-SGD across.

With ``AsyncConfig.shard_within = K`` each of the W workers is K ranks that one fast
network joins (a node's GPUs). Their inner model is sharded over them by FSDP2: its
all-gathers and reduce-scatters stay inside the island, and each rank trains on its
part of the worker's batch, so an island computes what one worker with the whole model
would (the same batch, gradients averaged over its parts), in about 1/K of the memory
per rank for parameters, gradients and the inner optimizer's state (the leader holds
theta whole besides, below).

The server sees W workers as before. An island's first rank, its **leader**, is the
only one that talks to it: it pulls theta, tells the other ranks of its island what to
run, and pushes the island's pseudo-gradient. So nothing but the pushes and pulls of W
workers crosses the slow network, whatever K is. Ranks are laid out so that the server
needs no change: rank 0 serves, ranks ``1..W`` are the leaders, and the
``W * (K - 1)`` ranks after them follow, ``K - 1`` per island in turn
(:func:`island_ranks`). Launch ``1 + W * K`` ranks.

Per round, on the island's own process group (the launch's backend; NCCL on GPUs):

1. the leader broadcasts the order (the round's shard, steps, lr clock, theta's version)
   and scatters theta, each rank getting its own shards of each parameter
   (:func:`~thinwire.localsgd.algorithm.island_params.scatter_theta_`);
2. every rank runs the round's inner steps on its part of each batch; FSDP2 averages the
   gradients over the island;
3. every rank's shards are gathered to the leader, which pushes the whole
   pseudo-gradient with the run's codec and error feedback, and the round's loss is
   averaged.

What it does not do (each said here, and checked where a user could ask for it):

* **A failed round ends the island.** A worker of one rank rebuilds its inner optimizer
  and joins again; an island's ranks may have stopped at different collectives, so its
  ranks raise instead, and the server carries on with the other workers (as when a
  worker dies). The island's collectives time out after ``3 * link_timeout_s`` (a
  rank's wait for its next order spans the leader's push, its wait and its pull), so a
  rank whose partner died does not wait for ever.
* **No rejoin**: :func:`~thinwire.localsgd.rejoin_async` brings back one process, and
  an island is K.
* The leader holds theta whole (fp32), as the server does, and at a round's end also
  what it gathered (about one more copy) and the pseudo-gradient it pushes: three fp32
  copies for a moment. The other ranks hold only their shards.

Each rank keeps its own inner state across a stop (``checkpoint_dir``), its shard of
the inner optimizer's state as plain tensors, so a stopped and resumed ``sync`` run
continues as if it had never stopped, as with unsharded workers. An island restores
its state on all its ranks or on none (a file missing on one host makes every rank of
that island start fresh).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.errors import ConfigError
from thinwire.localsgd.messages import Work

__all__ = ["Island", "island_ranks", "join_island", "shard_worker_model", "workers_of"]

_ROUND, _STOP, _ABORT = 0, 1, 2
"""What an order tells the island's other ranks: run a round; stop after keeping the
inner state (the server's stop); stop at once (the leader is leaving)."""


def island_ranks(workers: int, k: int) -> list[list[int]]:
    """The global ranks of each of ``workers`` islands of ``k`` ranks, leader first: the
    leaders are ranks ``1..W`` (the server's workers), the rest follow after them."""
    return [[1 + i] + [1 + workers + i * (k - 1) + j for j in range(k - 1)] for i in range(workers)]


def workers_of(world: int, k: int) -> int:
    """W for a launch of ``world`` ranks in islands of ``k``.

    Raises:
        ConfigError: ``k`` < 1, or the ``world - 1`` training ranks do not split into
            islands of ``k``.
    """
    if k < 1:
        raise ConfigError(f"shard_within must be >= 1, got {k}")
    if (world - 1) % k:
        raise ConfigError(
            f"shard_within={k}: the {world - 1} training ranks (all but the server, rank 0) "
            f"must split into islands of {k}; launch 1 + W * {k} ranks"
        )
    return (world - 1) // k


@dataclass
class Island:
    """This rank's island: its ranks (leader first) and their process group."""

    ranks: list[int]
    group: dist.ProcessGroup
    rank: int
    device: torch.device
    ordered: bool = False
    """The leader has sent an order whose round is not over yet."""
    closed: bool = False
    """A stop has been sent (leader) or received (the others)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def position(self) -> int:
        """This rank's place in the island; 0 is the leader."""
        return self.ranks.index(self.rank)

    @property
    def leader(self) -> bool:
        return self.position == 0

    def mesh(self) -> Any:
        """The island's 1-D device mesh, for FSDP2."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.group, self.device.type, mesh_dim_names=("shard",))

    # --- the leader's side -----------------------------------------------------------
    def order(self, work: Work) -> None:
        """Tell the island to run ``work`` (the leader, each round; theta follows, each
        rank's shards scattered as the round loads it)."""
        self._send(_ROUND, work)
        self.ordered = True

    def round_done(self) -> None:
        """The leader's round returned: every rank of the island has left its collectives."""
        self.ordered = False

    def stop(self, version: int) -> None:
        """The server's stop: the island keeps its inner state, tagged ``version``."""
        self._send(_STOP, Work(epoch=0, version=version, stop=True))
        self.closed = True

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank of the island (all call it together)."""
        votes = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.group)
        return bool(votes.item())

    def abort(self) -> None:
        """The leader leaves without a stop (refused, its link failed): the others stop
        too, keeping nothing. Only between rounds: mid-round they wait in a collective
        that no order can reach, and the island's timeout frees them."""
        if self.closed or self.ordered:
            return
        with contextlib.suppress(RuntimeError):  # a partner already gone: nothing to tell
            self._send(_ABORT, Work(epoch=0, version=-1, stop=True))
        self.closed = True

    def _send(self, what: int, work: Work) -> None:
        fields = [what, work.version, work.shard, work.steps, work.lr_clock, work.planned]
        dist.broadcast(_order_tensor(fields, self.device), self.ranks[0], group=self.group)

    # --- the other ranks' side -------------------------------------------------------
    def next_order(self) -> Work:
        """The leader's next order; an abort comes back as a stop at version -1."""
        buf = _order_tensor([0] * 6, self.device)
        dist.broadcast(buf, self.ranks[0], group=self.group)
        what, version, shard, steps, lr_clock, planned = (int(v) for v in buf.tolist())
        if what != _ROUND:
            self.closed = True
            return Work(epoch=0, version=version if what == _STOP else -1, stop=True)
        return Work(0, version, shard=shard, steps=steps, lr_clock=lr_clock, planned=planned)


def _order_tensor(fields: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(fields, dtype=torch.int64, device=device)


def join_island(
    workers: int, k: int, timeout_s: float, device: torch.device | None = None
) -> Island | None:
    """Make every island's process group (every rank of the launch calls this, in the
    same order, as ``new_group`` asks) and return this rank's island (None on the
    server, and when ``k`` is 1: a worker of one rank needs no island). ``device``: where
    the island's orders travel (the CPU unless given; the worker's model's device once
    it is built)."""
    if k == 1:
        return None
    rank = dist.get_rank()
    mine = None
    for ranks in island_ranks(workers, k):
        # A rank that is not the leader waits for its next order through the leader's
        # push, its wait for the server and its pull, each allowed timeout_s.
        group = dist.new_group(ranks, timeout=timedelta(seconds=3 * timeout_s))
        if rank in ranks:
            mine = Island(ranks, group, rank, device or torch.device("cpu"))
    return mine


def shard_worker_model(model: torch.nn.Module, island: Island, units: Any = None) -> None:
    """Shard ``model`` (every rank of the island holding the same weights) over the
    island with FSDP2: ``units(model, mesh)`` wraps its inner units first (the task's
    ``shard``), then the root becomes a unit of its own."""
    from torch.distributed.fsdp import fully_shard

    mesh = island.mesh()
    if units is not None:
        units(model, mesh)
    fully_shard(model, mesh=mesh)
