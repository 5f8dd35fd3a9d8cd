"""``--shard-within K``: FSDP2 inside islands of K ranks, thinwire's algorithm across them.

The layout of a job that has outgrown one device, or whose machines come in groups
joined by a fast network: ranks ``[i*K, (i+1)*K)`` form island ``i``. Inside an island
FSDP2's ``fully_shard`` splits every parameter over the K ranks (each transformer block
is its own unit, as in torchtitan); its all-gathers and reduce-scatters stay inside the
island, uncompressed. Across islands the optimizer (``lamb``, ``onebit-lamb`` or
``onebit-adam``, given the mesh's ``"replicate"`` group as ``process_group``) averages
each rank's shard with the ranks that hold the same shard in the other islands: in fp32
every step for LAMB, in bf16 through the 1-bit optimizers' warmup, then at ~1 bit per
element with error feedback (:mod:`thinwire.optim.sharded`). That is HSDP with thinwire
on the slow tier.

What it changes, against ``--shard-within 1`` (a replica per rank under DDP):

* **Bytes**: ``comm_bytes`` counts the cross-island exchange only, per rank (a rank
  sends its shard's share, so an island sends what one replica would). FSDP2's
  traffic inside an island is not counted: on the two-tier testbed
  (``thinwire testbed run --islands``) the uplinks' own counters measure what crossed.
* **Arithmetic**: the same global batch and the same averages as under DDP, summed in
  another order; LAMB's trust ratios reduce the shards' norms inside the island, so
  they are the whole layer's. 1-bit compression scales each shard's blocks on its own,
  so 1-bit runs differ from their DDP versions by more than rounding. Measured on 2
  islands of 2 (docs/results/testbed.md): 1-bit LAMB within 0.2-1.2% of LAMB on 300-step
  runs of both corpora; from a trained model, 3,000 steps, 2.0% above LAMB with 21.5x
  fewer bytes across islands (0.9% under DDP on that seed; with ``--exchange int8``
  2.1% sharded and 1.7% under DDP: the spread of the frozen-variance rule's tail on that
  seed, not a cost of sharding).
* **Checkpoints**: ``model.pt`` holds the whole model (gathered from the shards, as under
  DDP, so ``--init-from`` and ``analyze`` read it alike); each ``rank{r}.pt`` holds that
  rank's shard of the optimizer state, so a resume needs the same ``--workers`` and
  ``--shard-within`` (both are checked).

The trainer builds the whole model on every rank and then shards it (its presets fit
one device; a start file or a pretraining runs on the whole model first). A loop of your
own with a model that fits no device builds it on the ``meta`` device and shards it
before it materialises, as in torchtitan; the optimizers take the shards either way.
``diloco`` (and Streaming DiLoCo) under ``--shard-within``: an island is one worker
(its ranks average their gradients every inner step through FSDP2), and the outer sync
averages each rank's shard of the pseudo-gradient across the islands every H steps.

The gradients travel across islands as ``--grad-dtype`` says, as under DDP: bf16 in
the 1-bit optimizers' warmup by default, fp32 for LAMB. Choose K as the ranks one fast
network joins (a node's GPUs); more islands means more replicas on the slow link.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire.errors import ConfigError
from thinwire.train.config import TrainConfig

__all__ = [
    "SHARDED_ALGOS",
    "check_sharding",
    "full_state_dict",
    "shard_model",
]

SHARDED_ALGOS = ("lamb", "onebit-lamb", "onebit-adam", "diloco", "async-diloco")
"""The algorithms ``--shard-within`` runs: the optimizers that take a ``process_group``
and read whole-layer norms of FSDP2 shards, (Streaming) DiLoCo, whose outer sync
averages each rank's shard across the islands, and asynchronous Local-SGD, whose
workers are islands (:mod:`thinwire.localsgd.runtime.island`)."""


def check_sharding(cfg: TrainConfig, world: int) -> None:
    """One-line errors for a ``--shard-within`` the run cannot use, before any process starts."""
    k = cfg.shard_within
    if k == 1:
        return
    if cfg.algo not in SHARDED_ALGOS:
        raise ConfigError(
            f"--shard-within {k}: {cfg.algo} keeps a whole replica per rank; sharded runs "
            f"take {', '.join(SHARDED_ALGOS)}"
        )
    if cfg.algo == "async-diloco":  # rank 0 serves; the others make the islands
        if (world - 1) % k:
            raise ConfigError(
                f"--shard-within {k} must divide the {world - 1} training ranks (all but "
                f"the server) into islands of {k}: run 1 + W * {k} workers"
            )
    elif world % k:
        raise ConfigError(
            f"--shard-within {k} must divide the {world} ranks into islands of {k} ranks"
        )


def shard_model(model: nn.Module, k: int, device: torch.device) -> dist.ProcessGroup:
    """Shard ``model`` (every rank holding the same weights) over islands of ``k`` ranks
    with FSDP2, each block of ``model.blocks`` its own unit; returns the group of the
    ranks that hold the same shard in every island (the optimizer's ``process_group``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // k, k), mesh_dim_names=("replicate", "shard"))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh.get_group("replicate")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights as whole tensors on every rank: FSDP2 shards are gathered (a
    collective inside each island: every rank calls it, in the same order)."""
    return {
        name: t.full_tensor() if _is_dtensor(t) else t for name, t in model.state_dict().items()
    }
