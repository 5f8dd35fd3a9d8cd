"""Parameters sharded by FSDP2: what thinwire's optimizers need to know of them.

``fully_shard`` turns a model's parameters into DTensors: each rank holds a shard (its
rows of every tensor), and FSDP2 reduces the gradients itself, reduce-scattering them
over the mesh's shard dimension and, under HSDP, all-reducing them over its replicate
dimension. An optimizer that reads a whole layer, like LAMB's trust ratio
``||w|| / ||u||``, must then reduce the norms of the shards: a DTensor's ``norm()`` is a
partial sum, and read as a float on its own it is this rank's shard's norm, a different
trust ratio on every rank and no error anywhere.

Two layouts are supported (:func:`check_layout`):

* **FSDP2 owns every rank** (a 1-D mesh over all ranks, or an HSDP mesh
  ``("replicate", "shard")``): leave ``process_group`` unset. FSDP2 averages the
  gradients; the optimizer only reduces whole-layer norms over the shard dimension.
* **FSDP2 inside an island, thinwire across islands**: a mesh over the ranks of one
  island, and ``process_group`` the ranks that hold the same shard in every island (the
  replicas). The optimizer averages each shard's gradient over the replicas itself, in
  one fused allreduce per step, which is where a compressed exchange goes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "check_layout",
    "full_norm",
    "gather_layer",
    "is_sharded",
    "island_group",
    "island_norms",
    "layer_norm",
    "local",
    "local_norms",
    "local_state",
    "reduce_norms",
    "replica_groups",
    "reshard_optimizer_state",
    "sum_over",
]


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter, gradient or state under FSDP2)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` as a plain tensor (``t`` itself when not sharded)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_norm(t: torch.Tensor, island: dist.ProcessGroup | None = None) -> float:
    """The 2-norm of the whole tensor, whether this rank holds all of it or a shard (the
    shards' partial norms reduced over the mesh: one allreduce of one number). ``t`` is
    a DTensor, or this rank's plain shard of a layer split over ``island``."""
    return float(layer_norm(t, island))


def layer_norm(t: torch.Tensor, island: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`full_norm` as a 0-dim fp32 tensor on ``t``'s device (no host sync when
    nothing is sharded)."""
    if isinstance(t, DTensor):
        return t.float().norm().full_tensor()
    n = torch.linalg.vector_norm(t.float())
    if island is None:
        return n
    sq = n.square().reshape(1)
    dist.all_reduce(sq, group=island)
    return sq.sqrt().reshape(())


def local_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norms of this rank's shards of ``tensors`` (the whole tensors without
    FSDP2), stacked in one fp32 tensor: pass them to :func:`reduce_norms`."""
    return torch.stack([torch.linalg.vector_norm(local(t).float()) for t in tensors])


def reduce_norms(norms: torch.Tensor, island: dist.ProcessGroup | None) -> torch.Tensor:
    """Whole-layer norms from the shards' :func:`local_norms`, in ONE allreduce for all
    layers (under FSDP2 a reduction per layer is a round trip per layer); unchanged when
    nothing is split (``island`` None)."""
    if island is None:
        return norms
    sq = norms.square()
    dist.all_reduce(sq, group=island)
    return sq.sqrt()


def island_norms(tensors: list[torch.Tensor], island: dist.ProcessGroup) -> list[float]:
    """:func:`full_norm` of each of ``tensors`` (this rank's shards, plain or DTensor, of
    layers split over ``island``), reduced together."""
    return reduce_norms(local_norms(tensors), island).tolist() if tensors else []


def sum_over(
    values: list[float], island: dist.ProcessGroup | None, device: torch.device | None = None
) -> list[float]:
    """Per-shard sums (or counts) of a layer, summed over the ``island``'s shards (one
    allreduce of ``len(values)`` numbers, on ``device``: NCCL takes device tensors only);
    unchanged when nothing is sharded."""
    if island is None:
        return values
    box = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(box, group=island)
    return box.tolist()


def gather_layer(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole layer from this rank's plain ``shard`` of it, laid out like the DTensor
    ``like`` (an allgather over its mesh; uneven shards included). Meant for once-a-run
    statistics such as the floor's median, not for every step."""
    whole = DTensor.from_local(
        shard, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
    return whole.full_tensor()


def island_group(params: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The ranks a sharded layer is split over (FSDP2's 1-D mesh inside an island), or
    None when nothing is sharded."""
    for p in params:
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def replica_groups(p: torch.Tensor) -> list[dist.ProcessGroup]:
    """The mesh dimensions over which ``p`` is replicated, as process groups (HSDP's
    replicate dimension; none for plain FSDP2)."""
    if not isinstance(p, DTensor):
        return []
    mesh = p.device_mesh
    return [mesh.get_group(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)]


def _mesh_key(p: DTensor) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    mesh = p.device_mesh
    return mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())


def check_layout(
    params: list[torch.Tensor], process_group: Any, name: str, island_only: bool = False
) -> bool:
    """Check that sharded ``params`` are in a layout the optimizer supports; returns
    whether FSDP2 averages the gradients (no ``process_group`` given). A one-line
    ValueError otherwise. ``island_only``: the optimizer needs the second layout (the
    1-bit optimizers compress the exchange across islands, so FSDP2 must not make it)."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return False
    # One mesh by its ranks: fully_shard per block, each with mesh["shard"], gives
    # every block its own DeviceMesh object over the same ranks.
    meshes = {_mesh_key(p): p.device_mesh for p in sharded}
    if len(meshes) > 1:
        raise ValueError(
            f"{name}: the parameters are sharded over {len(meshes)} device meshes; one is supported"
        )
    if len(sharded) != len(params):
        raise ValueError(
            f"{name}: {len(params) - len(sharded)} of {len(params)} parameters are not sharded "
            "by FSDP2: apply fully_shard to the whole model (the root module too)"
        )
    mesh = next(iter(meshes.values()))
    world = dist.get_world_size()
    if island_only and (process_group is None or mesh.ndim != 1):
        raise ValueError(
            f"{name} compresses the exchange across islands, so FSDP2 must shard inside "
            "an island only: fully_shard(model, mesh=mesh['shard']) and "
            "process_group=mesh.get_group('replicate')"
        )
    if process_group is None:
        if mesh.size() != world:
            raise ValueError(
                f"{name}: FSDP2's mesh holds {mesh.size()} of the {world} ranks; pass "
                "process_group= the ranks that hold the same shard in every island (the "
                "replicas the optimizer averages over)"
            )
        return True
    replicas = dist.get_world_size(process_group)
    if mesh.size() * replicas != world:
        raise ValueError(
            f"{name}: FSDP2's mesh holds {mesh.size()} ranks and process_group {replicas}, "
            f"but there are {world}: process_group must hold one rank of every island "
            "(mesh size x replicas = world size)"
        )
    shared = set(dist.get_process_group_ranks(process_group)) & set(mesh.mesh.flatten().tolist())
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"{name}: process_group holds ranks {sorted(shared)} of FSDP2's own mesh; it must "
            "hold one rank of every island, this one alone of its own (the replicas, e.g. "
            "mesh.get_group('replicate'))"
        )
    return False


def local_state(value: Any) -> Any:
    """``value`` (an optimizer state dict, or any nesting of dicts and lists) with every
    DTensor replaced by this rank's shard, a plain tensor: what a rank's file holds."""
    if is_sharded(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(local_state(v) for v in value)
    return value


def reshard_optimizer_state(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The inverse of :func:`local_state` for ``optimizer.state_dict()``: each parameter's
    state tensors of its shard's shape become DTensors laid out as the parameter is.
    Parameters that are not sharded, and scalars (``step``), are left as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, per_param in saved.get("state", {}).items():
        p = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if p is None or not is_sharded(p):
            state[index] = per_param
            continue
        shard_shape = p.to_local().shape
        state[index] = {
            key: DTensor.from_local(
                v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == shard_shape
            else v
            for key, v in per_param.items()
        }
    return {**saved, "state": state}
