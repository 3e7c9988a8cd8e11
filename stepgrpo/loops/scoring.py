"""Rewards of clean latents: decoding to 8-bit images, scoring in chunks, a training batch's summary.

Every stage that scores (score, evaluate, calibrate) and the reference loop go through
`score_images`; a reward always sees the 8-bit images a user would see (`stepgrpo.images`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from stepgrpo.images import dequantize
from stepgrpo.reporting.report import track
from stepgrpo.rewards.base import RewardOutput, checked


def reward_images(decoder: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean latents -> (uint8 images on the CPU, the fp32 images in [0, 1] a reward is given)."""
    u8 = decoder.decode_uint8(latents)
    return u8, dequantize(u8.to(decoder.device))


def distinct_rows(rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The first index of each distinct row of `rows [N, ...]` and, per row, which distinct row it
    is (`inverse [N]`). Rows are matched by a digest of their bytes: cheap at any latent size,
    unlike sorting them."""
    seen: dict[bytes, int] = {}
    first, inverse = [], np.empty(len(rows), np.int64)
    for i, row in enumerate(rows):
        index = seen.setdefault(hashlib.blake2b(row.tobytes(), digest_size=16).digest(), len(first))
        if index == len(first):
            first.append(i)
        inverse[i] = index
    return first, inverse


def decode_distinct(decoder: Any, latents: np.ndarray, chunk: int, progress: str = "decode") -> np.ndarray:
    """`latents [N, C, H, W]` -> uint8 images `[N, 3, Y, X]`, decoding each distinct latent once
    (a group's ODE sample of x_0, or the states after the SDE window, repeat)."""
    first, inverse = distinct_rows(latents)
    unique = latents[first]
    parts = [
        reward_images(decoder, torch.from_numpy(unique[c0 : c0 + chunk]))[0]
        for c0 in track(range(0, len(unique), chunk), progress)
    ]
    return torch.cat(parts)[torch.from_numpy(inverse.reshape(-1))].numpy()


def cat_outputs(outputs: Sequence[RewardOutput]) -> RewardOutput:
    """One `RewardOutput` of several chunks' (strict only when every chunk has it)."""
    strict = [o.strict for o in outputs]
    names = outputs[0].sub.keys() if outputs else ()
    return RewardOutput(
        scores=torch.cat([o.scores.float().cpu() for o in outputs]),
        strict=torch.cat([s.float().cpu() for s in strict]) if strict and all(s is not None for s in strict) else None,
        sub={n: torch.cat([o.sub[n].float().cpu() for o in outputs]) for n in names},
    )


def output_json(out: RewardOutput) -> dict[str, Any]:
    """A `RewardOutput` as plain JSON (a shard's record; `output_of_json` reads it back exactly)."""
    return {
        "scores": out.scores.tolist(),
        "strict": None if out.strict is None else out.strict.tolist(),
        "sub": {n: v.tolist() for n, v in out.sub.items()},
    }


def output_of_json(records: Sequence[Mapping[str, Any]]) -> RewardOutput:
    """One `RewardOutput` (float32) of the `output_json` records of consecutive shards."""
    return RewardOutput(
        scores=torch.tensor([v for r in records for v in r["scores"]], dtype=torch.float32),
        strict=None
        if records[0]["strict"] is None
        else torch.tensor([v for r in records for v in r["strict"]], dtype=torch.float32),
        sub={
            n: torch.tensor([v for r in records for v in r["sub"][n]], dtype=torch.float32) for n in records[0]["sub"]
        },
    )


def score_images(
    reward: Any,
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    chunk: int,
    device: str | torch.device = "cpu",
    progress: str = "score",
) -> RewardOutput:
    """`reward` of uint8 `images [N, 3, Y, X]`, `chunk` images a call (on `device`)."""
    outputs = []
    for c0 in track(range(0, len(images), chunk), progress):
        rows = slice(c0, c0 + chunk)
        out = reward(dequantize(images[rows].to(device)), list(prompts[rows]), list(metadata[rows]))
        outputs.append(checked(out, len(images[rows]), str(getattr(reward, "name", reward))))
    return cat_outputs(outputs)


def reward_summary(
    grid: torch.Tensor, strict: torch.Tensor, group_ids: torch.Tensor, r0_is_ode: bool = True
) -> dict[str, Any]:
    """The training reward of an iteration: `grid, strict [B, T+1]` (NaN where not scored), `group_ids [B]`.

    `reward_*`: the SDE samples `x_T`; `ode_reward_*`: `R_0`, the ODE sample of the same prompt
    and initial noise (with a completion method, the completion of `x_0`: exact for `remaining`;
    `r0_is_ode` False for a method whose `R_0` is not the ODE sample, e.g. `tweedie`, `rollout`:
    then no ODE reward is reported rather than a one-step estimate from pure noise).
    `group_reward_std`: the mean within-group std of `R_T` (what GRPO's advantages are made of);
    `zero_std_groups`: the fraction of groups whose rewards are all equal (no signal).
    """
    from stepgrpo_core.credit import Groups

    final = grid[:, -1]
    out: dict[str, Any] = {"reward_mean": float(final.mean()), "reward_std": float(final.std(unbiased=False))}
    if bool(torch.isfinite(strict[:, -1]).all()):
        out["reward_strict"] = float(strict[:, -1].mean())
    if r0_is_ode and bool(torch.isfinite(grid[:, 0]).all()):
        out["ode_reward_mean"] = float(grid[:, 0].mean())
        if bool(torch.isfinite(strict[:, 0]).all()):
            out["ode_reward_strict"] = float(strict[:, 0].mean())
    per_group = Groups(group_ids).std(final.double())  # [groups]
    out["group_reward_std"] = float(per_group.mean())
    out["zero_std_groups"] = float((per_group == 0).float().mean())
    if bool(torch.isfinite(grid).all()):
        out["reward_per_state"] = grid.mean(0).tolist()
    return out
