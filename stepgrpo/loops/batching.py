"""What the update reads and how its rows are shared out: an iteration's stored trajectories
(`Batch`), their micro-batches (`micro_batches`), one rank's share and the sums across ranks of a
data-parallel update (`DataParallel`), and the velocity the update differentiates
(`update_velocity`). Used by the loop (`stepgrpo.loops.training`) and the objectives' rows
(`stepgrpo.loops.rows`), which import this and not each other's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stepgrpo.policy.shards import local_shard

if TYPE_CHECKING:
    from stepgrpo.policy import Policy


def micro_batches(halves: Sequence[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """The micro-batches of one trained step, per half of the part: each half's rows in runs of `size`."""
    return [[c for c in h.split(size) if len(c)] for h in halves]


def _balanced_owners(sizes: Sequence[int], world: int) -> list[int] | None:
    """A rank for each micro-batch of `sizes` rows such that every rank gets the same number of
    rows (the largest first, each to the least loaded rank, ties to the lowest), or None when
    whole micro-batches cannot share out so."""
    total = sum(sizes)
    if total % world or len(sizes) < world:
        return None
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda r: load[r])
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner if max(load) == total // world else None


class DataParallel:
    """One rank of a data-parallel update over a `torch.distributed` process group (gloo on CPU,
    NCCL on GPUs): which rows are this rank's, and the sums across ranks."""

    def __init__(self, rank: int, world: int, device: str | torch.device = "cpu") -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's share of `rows`: every `world`-th, from its rank."""
        return rows[self.rank :: self.world]

    def micro_batches(self, halves: Sequence[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
        """This rank's micro-batches of one trained step, per half of the part (`micro_batches`):
        whole micro-batches where they share out evenly over the ranks (every rank the same number of
        rows), else every `world`-th row of each half, in micro-batches. A forward pass on a micro-batch of
        `size` rows costs less than two on `size / 2`, so whole ones are taken where they balance."""
        chunks = micro_batches(halves, size)
        sizes = [len(c) for cs in chunks for c in cs]
        owner = _balanced_owners(sizes, self.world)
        if owner is None:
            return micro_batches([self.mine(h) for h in halves], size)  # a rank may have no row of a half
        mine, i = [], 0
        for cs in chunks:
            mine.append([c for j, c in enumerate(cs) if owner[i + j] == self.rank])
            i += len(cs)
        return mine

    def whole(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's share of `chunks` taken whole (micro-batches of whole groups): every rank the
        same number of rows where they share out so, else chunk i to rank i mod world."""
        owner = _balanced_owners([len(c) for c in chunks], self.world)
        owner = owner or [i % self.world for i in range(len(chunks))]
        return [c for c, r in zip(chunks, owner) if r == self.rank]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks (a new tensor)."""
        import torch.distributed as dist

        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace every parameter's gradient by its sum over the ranks: one all-reduce of the
        flattened gradients (a rank with no rows in a part contributes zeros)."""
        total = self.sum(flat_params(params, grad=True))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def even(self, cells: list[Any], filler: Any) -> list[Any]:
        """`cells` as they are: the ranks' passes need not match (only the sharded update's do)."""
        return cells

    def total(self, value: float) -> float:
        """A sum over the whole weights, from this rank's part of it: every rank holds them whole."""
        return value

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> float:
        """The dot product of two vectors every rank holds whole (in float64)."""
        return float(a.double() @ b.double())

    def gradient(self, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """This rank's gradient as one fp32 vector (summed across ranks by `across`)."""
        return flat_params(params, grad=True)

    def across(self, vectors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of the ranks' vectors (e.g. half-gradients) summed across the ranks: one all-reduce."""
        return list(self.sum(torch.stack(vectors)))

    def extreme(self, value: float, which: str) -> float:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if which == "min" else dist.ReduceOp.MAX)
        return float(t)


@dataclass(frozen=True)
class Batch:
    """An iteration's stored trajectories, as the update reads them.

    states: `[B, T+1, C, H, W]`; old_log_probs: `[B, T]` (NaN: not trainable); advantages: `[B, T]`
    (NaN: no credit); group_ids: `[B]`; cond: conditioning pytree with leading dim `B`;
    sigmas: `[T+1]`; kernel, noise: the rollout's kernel and its noise (a float or the psi table).
    """

    states: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    cond: Any
    sigmas: torch.Tensor
    kernel: str
    noise: float | torch.Tensor


def update_velocity(pol: Policy, detach_uncond: bool):
    """The policy's velocity, with CFG's unconditional branch detached when asked (Flow-GRPO)."""
    if not detach_uncond or not hasattr(pol, "detached_uncond"):
        return pol.velocity

    def velocity(x, sigma, cond):
        with pol.detached_uncond():
            return pol.velocity(x, sigma, cond)

    return velocity


def flat_params(params: Sequence[torch.nn.Parameter], grad: bool) -> torch.Tensor:
    """The parameters (or their gradients; zeros where none) as one fp32 vector: of a sharded
    update (`stepgrpo.loops.sharding`), this rank's shards of them."""
    parts = []
    for p in params:
        t = p.grad if grad else p.detach()
        if t is None:
            t = torch.zeros(local_shard(p).numel(), device=local_shard(p).device)
        parts.append(local_shard(t).detach().reshape(-1).float())
    return torch.cat(parts) if parts else torch.zeros(0)
