"""The gain-variance curriculum: draw training prompts by how much their groups' step gains vary.

A group whose members all get the same rewards has zero advantages: GRPO drops it, and its
rollout is spent for nothing. The curriculum (METHODS.md, "Gain-variance curriculum") measures,
for every group of the recent iterations, the variance of its step gains, and draws the next
iteration's prompts with weights that follow it, so prompts whose groups had no spread are drawn
less (never not at all: a prompt's spread changes as the policy learns).

- `group_spread`: per group, the mean over steps of the within-group variance of `g_k`. Where only
  the final samples are scored it is the variance of `R_T` (the one gain the trajectory has,
  `R_T - R_0`: its members share `x_0`, so `R_0` is a constant of the group).
- `prompt_weights`: per prompt, `floor + (1 - floor) * v_p / mean(v)` from the mean spread `v_p`
  of its groups in the window; a prompt with no group there gets 1, the weight of an average one.
- `draw`: `n` distinct prompts with probabilities proportional to the weights.
"""

from __future__ import annotations

import numpy as np
import torch

from .credit import Groups


def group_spread(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(first row of each group [n], spread [n])` of the rewards `[B, T+1]` of one iteration (NaN
    where a state has no reward: then only `R_T` is read)."""
    rewards = rewards.double()
    if not bool(torch.isfinite(rewards[:, -1]).all()):
        raise ValueError("group_spread: some trajectories have no final reward")
    gains = rewards.diff(dim=1) if bool(torch.isfinite(rewards).all()) else rewards[:, -1:]
    groups = Groups(group_ids)
    variance = groups.std(gains) ** 2  # [n, T'] population variance within the group
    return groups.first, variance.mean(dim=1)


def prompt_weights(
    n_prompts: int, prompt_of_group: np.ndarray, spread: np.ndarray, floor: float
) -> tuple[np.ndarray, np.ndarray]:
    """`(weights [n_prompts], seen [n_prompts] bool)` from the spreads of the window's groups
    (`prompt_of_group[j]` is the prompt index of group `j`). Every weight is in `[floor, inf)`;
    the seen prompts' weights average 1 (unless none spread at all: then they are all `floor`)."""
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    total = np.bincount(prompt_of_group, weights=spread, minlength=n_prompts)
    count = np.bincount(prompt_of_group, minlength=n_prompts)
    seen = count > 0
    weights = np.ones(n_prompts)
    if seen.any():
        mean_spread = total[seen] / count[seen]
        scale = mean_spread.mean()
        relative = mean_spread / scale if scale > 0 else np.zeros_like(mean_spread)
        weights[seen] = floor + (1.0 - floor) * relative
    return weights, seen


def draw(weights: np.ndarray, n: int, generator: torch.Generator) -> np.ndarray:
    """`n` indices drawn with probabilities proportional to `weights`, without replacement while
    they last (more than `len(weights)`: a second pass continues, as the uniform draw repeats)."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    if not bool((w >= 0).all()) or not bool(w.sum() > 0):
        raise ValueError("draw: weights must be >= 0 with a positive sum")
    picks = []
    while len(picks) < n:
        k = min(n - len(picks), int((w > 0).sum()))
        picks += torch.multinomial(w, k, replacement=False, generator=generator).tolist()
    return np.array(picks, np.int64)
