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
from stepgrpo.loops import judging, training
from stepgrpo.results import CreditResult, ScoreResult
from stepgrpo.storage.publish import options_digest
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import repair_table, stage_task
from stepgrpo_core.credit import SCHEMES, assign, reads_branch, reads_trained


@stage_task("credit")
def credit(run: Run, cfg: Config, iteration: int, rewards: ScoreResult) -> CreditResult:
    """Advantages under `cfg.credit` from the rows that `rewards` names."""
    return execute(run, cfg, iteration, rewards.reward_name, rewards.reward_version)


def stored_options(cfg: Config, reward_name: str, reward_version: str) -> dict[str, Any]:
    """What the advantages are stored under: the scheme's options, the reward they came from and,
    from its second version on, the scheme's version (so version 1's rows keep their digest)."""
    stored = {"options": dict(cfg.credit.options), "reward": reward_name, "reward_version": reward_version}
    version = SCHEMES.facts(cfg.credit.scheme)["version"]
    if version != "1":
        stored["scheme_version"] = version
    if reads_trained(cfg.credit.scheme):
        stored["trained_steps"] = cfg.trained_steps()
    return stored


def execute(run: Run, cfg: Config, iteration: int, reward_name: str, reward_version: str) -> CreditResult:
    repair_table(run, "advantages")
    t0 = time.perf_counter()
    result = _assign(run, cfg, iteration, reward_name, reward_version)  # cheap: the summary needs it in any case
    digest = options_digest(stored_options(cfg, reward_name, reward_version))
    if run.tables.read_advantages(iteration, cfg.credit.scheme, digest).num_rows == 0:
        compute(run, cfg, iteration, reward_name, reward_version, result, t0)
    adv = result.advantages  # equal to the stored rows (float32 values stored as float64)
    rows = run.tables.advantages_digest(iteration, cfg.credit.scheme, digest)
    return CreditResult(
        digest=rows,
        iteration=iteration,
        scheme=cfg.credit.scheme,
        options_digest=digest,
        seconds=run.tables.rows_info("advantages", rows).get("seconds", 0.0),
        adv_mean=float(adv.mean()),
        adv_std=float(adv.std(unbiased=False)),
        adv_abs_max=float(adv.abs().max()),
        zero_std_ratio=float(result.zero_std_ratio),
        turning_points=int(result.turning_mask.sum()),
        gain_mean=result.gains.mean(0).tolist(),
    )


def compute(
    run: Run, cfg: Config, iteration: int, reward_name: str, reward_version: str, result: Any, t0: float
) -> None:
    """Append the advantages `result` (`_assign`, begun at `t0`) of one reward version's rows."""
    B, T = result.advantages.shape
    run.tables.append_advantages(
        iteration,
        cfg.credit.scheme,
        stored_options(cfg, reward_name, reward_version),
        np.repeat(np.arange(B), T),
        np.tile(np.arange(T), B),
        result.advantages.double().reshape(-1).numpy(),
        info={"seconds": time.perf_counter() - t0},
    )


def _assign(run: Run, cfg: Config, iteration: int, reward_name: str, reward_version: str) -> Any:
    """`stepgrpo_core.credit.assign` on the stored rewards (a scheme that reads only R_T also works
    on rewards of the final samples only)."""
    scheme = cfg.credit.scheme
    rewards = run.tables.reward_grid(iteration, reward_name, reward_version).float()
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
    group_ids = torch.from_numpy(run.stages.read_array(iteration, "rollout", "group_ids")).long()
    branch = None
    if reads_branch(scheme) and cfg.sampler.branches():  # each trajectory's one step with a density
        try:
            steps = judging.branch_steps(cfg, run.stages.read_array(iteration, "rollout", "log_probs"))
        except StageError as err:
            raise StageError(f"iteration {iteration}: {err}") from None
        branch = torch.from_numpy(steps) if steps is not None else None
    trained, tree = training.trained_mask(cfg), cfg.sampler.tree()
    return assign(scheme, rewards, group_ids, trained, tree, branch, **cfg.credit.options)
