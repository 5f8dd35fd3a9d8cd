"""theta in and the pseudo-gradient out of a model sharded by FSDP2 over an island of ranks.

An island's leader holds theta whole (it pulls it from the server) and must end the
round with the whole pseudo-gradient (it pushes it). The other ranks hold only their
shards. FSDP2 lays every parameter out by rows, as ``torch.chunk`` along dimension 0
cuts it: over K ranks each takes ``ceil(rows / K)`` rows in turn, the last ones fewer or
none. So every rank knows every rank's share from the parameters' shapes alone, and
each transfer is one collective of one flat buffer per rank:

* :func:`scatter_theta_`: the leader cuts theta into each rank's shards and scatters
  them (each rank receives 1/K of theta, not all of it);
* :func:`gather_difference`: each rank sends its shards to the leader, which writes
  ``theta - parameters`` whole, in theta's layout, straight from what it received.

A parameter laid out otherwise (FSDP2's ``shard_placement_fn`` on another dimension)
is refused in one line rather than loaded into the wrong rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from thinwire.errors import ConfigError

__all__ = ["gather_difference", "row_share", "scatter_theta_"]


def row_share(shape: torch.Size, parts: int, part: int) -> int:
    """Elements of a parameter of ``shape`` that part ``part`` of ``parts`` holds."""
    if not shape:
        return 1 if part == 0 else 0
    rows = shape[0]
    per = math.ceil(rows / parts) if rows else 0
    mine = max(0, min(per, rows - part * per))
    return mine * math.prod(shape[1:])


def _local(p: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """This rank's shard of ``p``, checked to be its rows as FSDP2 lays them out."""
    local = p.to_local() if hasattr(p, "to_local") else p  # type: ignore[operator]
    placements = getattr(p, "placements", None)
    by_rows = placements is None or (len(placements) == 1 and placements[0] == Shard(0))
    whole_rows = local.shape[1:] == p.shape[1:]
    if not (by_rows and whole_rows) or local.numel() != row_share(p.shape, parts, part):
        raise ConfigError(
            f"a parameter of shape {tuple(p.shape)} holds {local.numel()} elements on rank "
            f"{part} of its island, not its rows as FSDP2 shards them by default: shard "
            "every parameter along dimension 0 (no shard_placement_fn)"
        )
    return local


def _layout(params: list[torch.Tensor], parts: int) -> tuple[list[list[int]], int]:
    """Each part's elements of each parameter, and the longest part's total (every
    rank's buffer is that long, so the scatter and gather move equal sizes)."""
    shares = [[row_share(p.shape, parts, r) for p in params] for r in range(parts)]
    return shares, max(sum(s) for s in shares)


@torch.no_grad()
def scatter_theta_(
    params: list[torch.Tensor],
    theta: torch.Tensor | None,
    group: dist.ProcessGroup,
    part: int,
    parts: int,
) -> None:
    """Load each rank's shards of ``theta`` (flat fp32, the leader's; None elsewhere)
    into ``params``: one scatter from the leader (group rank 0)."""
    _, size = _layout(params, parts)
    device = _local(params[0], parts, part).device
    out = torch.empty(size, dtype=torch.float32, device=device)
    chunks = None
    if theta is not None:
        pieces: list[list[torch.Tensor]] = [[] for _ in range(parts)]
        offset = 0
        for p in params:
            whole = theta[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            rows = torch.chunk(whole, parts, dim=0) if whole.dim() else (whole,)
            for r in range(parts):
                pieces[r].append(rows[r].reshape(-1) if r < len(rows) else whole[:0].reshape(-1))
        chunks = [_padded(piece, size, device) for piece in pieces]
    dist.scatter(out, chunks, group_src=0, group=group)
    offset = 0
    for p in params:
        local = _local(p, parts, part)
        n = local.numel()
        local.copy_(out[offset : offset + n].view_as(local))
        offset += n


@torch.no_grad()
def gather_difference(
    params: list[torch.Tensor],
    theta: torch.Tensor | None,
    group: dist.ProcessGroup,
    part: int,
    parts: int,
) -> torch.Tensor | None:
    """``theta - parameters`` (flat fp32, theta's layout) on the leader (group rank 0,
    the one passing ``theta``), None elsewhere: one gather of every rank's shards. The
    leader holds theta, what it received (about one more copy) and the difference; no
    whole parameter vector besides."""
    shares, size = _layout(params, parts)
    locals_ = [_local(p, parts, part) for p in params]
    device = locals_[0].device
    mine = _padded([t.reshape(-1).float() for t in locals_], size, device)
    received = torch.empty(parts * size, dtype=torch.float32, device=device) if part == 0 else None
    everyone = list(received.view(parts, size)) if received is not None else None
    dist.gather(mine, everyone, group_dst=0, group=group)
    if everyone is None or theta is None:
        return None
    out = torch.empty_like(theta)
    offsets, at = [0] * parts, 0
    for i in range(len(params)):
        for r in range(parts):  # the rows in order make the whole parameter, flattened
            n = shares[r][i]
            torch.sub(
                theta[at : at + n], everyone[r][offsets[r] : offsets[r] + n], out=out[at : at + n]
            )
            offsets[r] += n
            at += n
    return out


def _padded(pieces: list[torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.float32, device=device)
    if pieces:
        flat = torch.cat([p.to(device, torch.float32) for p in pieces])
        out[: flat.numel()] = flat
    return out
