"""The credit stage: advantages `[B, T]` from one reward version's stored rows; no model at all.

The scheme (`credit.scheme`, `stepgrpo_core.credit`) turns the rewards of every state into step
advantages; a scheme that reads only the final reward (`step_rewards=False`) also works on runs
scored on final samples only. Appended once per (scheme, options, reward version).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.results import CreditResult, ScoreResult
from stepgrpo_core.credit import SCHEMES, assign
from storage.publish import options_digest
from storage.run import Run
from tasks.base import stage_task


@stage_task("credit")
def credit(run: Run, cfg: Config, iteration: int, rewards: ScoreResult) -> CreditResult:
    """Advantages under `cfg.credit` from the rows that `rewards` names."""
    return execute(run, cfg, iteration, rewards.reward_name, rewards.reward_version)


def stored_options(cfg: Config, reward_name: str, reward_version: str) -> dict[str, Any]:
    """What the advantages are stored under: the scheme's options and the reward they came from."""
    return {"options": dict(cfg.credit.options), "reward": reward_name, "reward_version": reward_version}


def execute(run: Run, cfg: Config, iteration: int, reward_name: str, reward_version: str) -> CreditResult:
    t0 = time.perf_counter()
    scheme = cfg.credit.scheme
    options = stored_options(cfg, reward_name, reward_version)
    digest = options_digest(options)
    rewards = run.reward_grid(iteration, reward_name, reward_version).float()
    if not bool(torch.isfinite(rewards[:, -1]).all()):
        raise StageError(
            f"iteration {iteration}: reward {reward_name!r} has no final-sample score for some trajectories"
        )
    if not bool(torch.isfinite(rewards).all()):
        if SCHEMES.facts(scheme)["step_rewards"]:
            raise StageError(
                f"credit scheme {scheme!r} needs a reward for every state; iteration {iteration} was scored on final "
                "samples only"
            )
        rewards = rewards[:, -1:].expand_as(rewards).clone()  # the scheme reads R_T only
    group_ids = torch.from_numpy(run.read_array(iteration, "rollout", "group_ids")).long()
    result = assign(scheme, rewards, group_ids, **cfg.credit.options)
    if run.read_advantages(iteration, scheme, digest).num_rows == 0:
        B, T = result.advantages.shape
        run.append_advantages(
            iteration,
            scheme,
            options,
            np.repeat(np.arange(B), T),
            np.tile(np.arange(T), B),
            result.advantages.double().reshape(-1).numpy(),
        )
    adv = result.advantages
    return CreditResult(
        digest=run.advantages_digest(iteration, scheme, digest),
        iteration=iteration,
        scheme=scheme,
        options_digest=digest,
        seconds=time.perf_counter() - t0,
        adv_mean=float(adv.mean()),
        adv_std=float(adv.std(unbiased=False)),
        adv_abs_max=float(adv.abs().max()),
        zero_std_ratio=float(result.zero_std_ratio),
        turning_points=int(result.turning_mask.sum()),
        gain_mean=result.gains.mean(0).tolist(),
    )
