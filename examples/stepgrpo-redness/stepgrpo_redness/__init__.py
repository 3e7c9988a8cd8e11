"""An example stepgrpo plug-in package: one reward, one credit scheme (docs/EXTENDING.md).

`Redness` scores how red an image is, from its pixels alone (no model to load), so it runs
anywhere, offline, in milliseconds. `group_rank` credits every step of a trajectory with its
reward's rank within its group, centred and scaled to unit variance (GRPO's advantages made
robust to reward outliers).
"""

from __future__ import annotations

import torch

from stepgrpo.plugins import reward, scheme
from stepgrpo.rewards.base import RewardOutput


@reward(version="1")
class Redness:
    """Mean over pixels of `R - (G + B) / 2`, in [-1, 1]; `sharpness` > 1 rewards pure red more."""

    name = "redness"

    def __init__(self, sharpness: float = 1.0) -> None:
        if sharpness <= 0:
            raise ValueError(f"redness: sharpness must be > 0, got {sharpness}")
        self.sharpness = sharpness

    def __call__(self, images, prompts, metadata) -> RewardOutput:
        r, g, b = images.float().unbind(dim=1)  # [N, H, W] each, in [0, 1]
        red = (r - (g + b) / 2).clamp(min=0) ** self.sharpness - (r - (g + b) / 2).clamp(max=0).abs()
        return RewardOutput(scores=red.mean(dim=(1, 2)), sub={"red": r.mean(dim=(1, 2))})


@scheme(version="1", step_rewards=False)
def group_rank(rewards, gains, groups, ties: str = "average"):
    """Every step gets its trajectory's rank of `R_T` within the group, centred, unit variance."""
    final = rewards[:, -1]
    index = groups.index
    ranks = torch.zeros_like(final)
    for g in range(groups.count):
        rows = (index == g).nonzero().reshape(-1)
        values = final[rows]
        below = (values[:, None] > values[None, :]).sum(1).float()
        equal = (values[:, None] == values[None, :]).sum(1).float()
        ranks[rows] = below + (equal - 1) / 2 if ties == "average" else below
    centred = ranks - (groups.sum(ranks[:, None]) / groups.sizes[:, None])[index, 0]
    std = centred.std(correction=0)
    advantages = centred / std if std > 0 else centred
    return advantages[:, None].expand_as(gains).clone()
