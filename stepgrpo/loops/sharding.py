"""The update sharded over its ranks (`scale.update_sharding: fsdp`): PyTorch's FSDP2
(`torch.distributed.fsdp.fully_shard`) per transformer block, then the root, so each rank holds
1 / world of every weight, gradient and AdamW moment, and gathers a block's weights only while the
block runs.

What changes against the all-reduce update (`stepgrpo.loops.batching.DataParallel`), and nothing else:
- the gradients are summed across ranks by FSDP's reduce-scatter after every backward (its divide
  factor set to 1: a sum, as the loop's weights expect), so there is no all-reduce a step;
- every FSDP forward and backward is a collective, so every rank must run the same number of them:
  where a rank has fewer cells in a half than another, it runs the difference as filler cells of
  weight 0 (a forward and a backward that add nothing; `Sharded.even`);
- what the loop keeps beside the weights (the EMA, the companion adapter, the initial weights, the
  signal check's half-gradients and running sums) is each rank's local shards of it; norms and dot
  products are sums over the ranks' shards (`Sharded.total`, `Sharded.dot`), and the signal check's
  sums are made whole, in the parameters' order, only for the checkpoint (`whole_vector`);
- a checkpoint holds whole tensors, gathered from the shards before rank 0 writes them
  (`gathered`), the same safetensors an unsharded run writes: a run resumes under any sharding and
  any number of ranks (the shards are cut again from the whole tensors), and loads into diffusers.

On a GPU the blocks compute in bf16 from fp32 shards and reduce gradients in fp32 (FSDP's
`MixedPrecisionPolicy`) where the model's dtype is float32; on CPU everything stays in the model's
dtype. `scale.update_offload` keeps the shards (and so AdamW's step) in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stepgrpo.loops.batching import DataParallel, flat_params
from stepgrpo.policy.shards import is_sharded, local_shard, shard_like

if TYPE_CHECKING:
    from stepgrpo.config import Config
    from stepgrpo.policy import Policy


def shards(weights: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (whole tensors by parameter name, or already this rank's shards) as this rank's
    shards of `params`."""
    out = {}
    for n, w in weights.items():
        p = params[n]
        out[n] = shard_like(w, p).clone() if is_sharded(p) and w.shape != local_shard(p).shape else w
    return out


def gathered(weights: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local shards `weights` of `params` made whole again (a collective: every rank calls it, in
    the same order), on the CPU."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, w in weights.items():
        p = params[n]
        if is_sharded(p):
            t = DTensor.from_local(
                w.to(local_shard(p).device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            out[n] = t.full_tensor().cpu()
        else:
            out[n] = w
    return out


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks: every member of its `ModuleList` children (SD3's
    `transformer_blocks`; Flux's `transformer_blocks` and `single_transformer_blocks`)."""
    return [b for child in module.children() if isinstance(child, nn.ModuleList) for b in child]


def shard_policy(pol: Policy, cfg: Config, world: int) -> None:
    """Shard the policy's transformer (and a full fine-tune's reference copy) over the group's
    `world` ranks: each block, then the root. Idempotent (a kept rank shards once)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if any(is_sharded(p) for p in pol.transformer.parameters()):
        return
    gpu = str(pol.device).startswith("cuda")
    mesh = init_device_mesh("cuda" if gpu else "cpu", (world,))
    mp = MixedPrecisionPolicy()
    if gpu:
        fp32 = pol.dtype == torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if fp32 else None, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cfg.scale.update_offload else OffloadPolicy()
    modules = [pol.transformer]
    if getattr(pol, "_reference", None) is not None:  # full fine-tuning's frozen reference copy
        modules.append(pol._reference)
    for module in modules:
        for block in _blocks(module):
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for m in pol.transformer.modules():  # a sum across ranks, not FSDP's mean: the loop's weights are the part's
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


class Sharded(DataParallel):
    """One rank of the sharded update (module doc): the data-parallel share of the rows, with the
    gradient sums done by FSDP, filler cells to keep the ranks' passes equal, and norms over shards."""

    def sum_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Nothing to do: FSDP's reduce-scatter has summed each backward's gradient into the shards."""

    def even(self, cells: list[Any], filler: Any) -> list[Any]:
        """`cells` with filler cells (`filler()`: weight 0) appended up to the most any rank has."""
        most = int(self.extreme(float(len(cells)), "max"))
        return cells + [filler() for _ in range(most - len(cells))]

    def total(self, value: float) -> float:
        """A sum over the whole weights from each rank's sum over its shards: their sum."""
        return float(self.sum(torch.tensor([value], dtype=torch.float64)))

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> float:
        """The dot product of two vectors whose shards the ranks hold (`a`, `b`: this rank's)."""
        return float(self.sum((a.double() @ b.double()).reshape(1)))

    def gradient(self, params: Sequence[nn.Parameter]) -> torch.Tensor:
        """This rank's shards of the gradient, already summed over the ranks, as one fp32 vector."""
        return flat_params(params, grad=True)

    def across(self, vectors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The half-gradients' shards, already summed (`gradient`)."""
        return vectors


def local_vector(v: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A flat vector over whole `params` (in their order: the signal check's sums) as this rank's
    flat vector over its shards of them."""
    parts, at = [], 0
    for p in params:
        n = p.numel()
        parts.append(shard_like(v[at : at + n].reshape(p.shape), p).reshape(-1).float())
        at += n
    return torch.cat(parts) if parts else v


def whole_vector(v: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's flat vector over its shards of `params` made whole again, in the parameters'
    order (a collective: every rank calls it), on the CPU."""
    from torch.distributed.tensor import DTensor

    parts, at = [], 0
    for p in params:
        mine = local_shard(p)
        n = mine.numel()
        piece = v[at : at + n].reshape(mine.shape).to(mine.device)
        at += n
        if is_sharded(p):
            piece = DTensor.from_local(
                piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
        parts.append(piece.reshape(-1).float().cpu())
    return torch.cat(parts) if parts else v
