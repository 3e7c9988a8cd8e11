"""A policy's weights when the update shards them (`stepgrpo.loops.sharding`: FSDP2 turns each
parameter into a `DTensor` of which a rank holds one shard): this rank's part of a tensor, and a
whole tensor cut to, or copied into, a parameter's shard. On a
policy that is not sharded each of these is the plain operation."""

from __future__ import annotations

import torch


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a sharded tensor's local shard; any other tensor itself)."""
    return t.to_local() if is_sharded(t) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor `full` that this rank holds of the sharded `like` (no
    communication: every rank cuts its own part); `full` itself when `like` is not sharded."""
    from torch.distributed.tensor import distribute_tensor

    if not is_sharded(like):
        return full
    part = distribute_tensor(
        full.to(local_shard(like).device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )
    return part.to_local()


def copy_into(p: torch.Tensor, w: torch.Tensor) -> None:
    """Copy `w` (whole, or already `p`'s local shard) into the parameter `p`, without gradient."""
    target = local_shard(p)
    src = w if w.shape == target.shape else shard_like(w, p)
    with torch.no_grad():
        target.copy_(src.to(target.device, target.dtype))
