"""Weighted sums of several rewards (e.g. `"shapes:1.0,jpeg_compressibility:0.1"`).

    score = sum_i w_i * score_i

`strict` is the logical AND of the parts that report one (None if none do). `sub` holds every
part's own score under its name and its sub-scores as `"<part>/<key>"`, so a run can still plot
each term. The name lists the parts with their weights and the version lists the parts' versions,
so changing a weight or a part's scorer changes the stored name or version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stepgrpo.rewards.base import Reward, RewardOutput, checked


class WeightedSum:
    """`parts`: (reward, weight) pairs with distinct reward names."""

    def __init__(self, parts: Sequence[tuple[Reward, float]]) -> None:
        if not parts:
            raise ValueError("a weighted reward needs at least one part")
        names = [r.name for r, _ in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"a weighted reward lists a reward twice: {names}; merge their weights")
        self.parts = [(r, float(w)) for r, w in parts]
        self.name = ",".join(f"{r.name}:{w:g}" for r, w in self.parts)
        self.version = ",".join(f"{r.name}={r.version}" for r, _ in self.parts)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        stricts = []
        sub: dict[str, torch.Tensor] = {}
        for reward, weight in self.parts:
            out = checked(reward(images, prompts, metadata), images.shape[0], reward.name)
            scores = out.scores.float().cpu()
            total = total + weight * scores
            sub[reward.name] = scores
            sub.update({f"{reward.name}/{k}": v for k, v in out.sub.items()})
            if out.strict is not None:
                stricts.append(out.strict.float().cpu())
        strict = torch.stack(stricts).amin(0) if stricts else None
        return RewardOutput(scores=total, strict=strict, sub=sub)
