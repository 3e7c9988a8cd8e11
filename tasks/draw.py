"""The draw stage: the training prompts of an iteration under the gain-variance curriculum.

Runs only with `curriculum.draw: gain_variance` (a uniform run draws from `(run.seed, iteration)`
alone, `stepgrpo.loops.sampling.iteration_plan`, and has no draw stage). It reads the stored rewards of
the last `curriculum.window` iterations under the run's reward and the prompt and group of each
of their trajectories, weighs every training prompt by the spread of its groups
(`stepgrpo_core.curriculum`), draws `run.prompts_per_iteration` of them, and publishes the draw
as `iter_<i>/draw/draw.json`; the rollout reads it, and its cache key names the draw's digest.
No model is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import generator, uniform_prompts
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import DrawResult, PromptsResult
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import manifest, reuse, stage_task
from stepgrpo.tasks.keys import stage_key
from stepgrpo_core import curriculum

UNIFORM = "uniform"


@stage_task("draw")
def draw(run: Run, cfg: Config, iteration: int, prompts: PromptsResult) -> DrawResult:
    """Draw iteration `iteration`'s prompts by the gain variance of the recent iterations."""
    return execute(run, cfg, iteration, prompts)


def window(cfg: Config, iteration: int) -> range:
    """The iterations whose rewards the draw of `iteration` reads."""
    return range(max(0, iteration - cfg.curriculum.window), iteration)


def execute(run: Run, cfg: Config, iteration: int, prompts: PromptsResult) -> DrawResult:
    reward = workspace.reward_identity(cfg.reward)
    grids, history = run.tables.reward_grids(window(cfg, iteration), reward["name"], reward["version"])
    key = stage_key("draw", run, cfg, iteration, {"prompts": prompts, "history": history})
    if not reuse(run, iteration, "draw", key, f"iteration {iteration} draw"):
        run.save_draw(iteration, compute(run, cfg, iteration, grids), inputs={"key": key.value})
    return stored(run, iteration)


def compute(run: Run, cfg: Config, iteration: int, grids: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """The draw record from the window's reward grids (`Run.tables.reward_grids`): the drawn prompt ids
    and the weights and spreads they were drawn by."""
    splits = stored_prompts(run).splits
    train_ids = np.array([p for p, s in enumerate(splits) if s == "train"], np.int64)
    position = {int(p): n for n, p in enumerate(train_ids)}
    group_prompt, spreads = [], []
    for j, rewards in grids.items():
        group_ids = torch.from_numpy(run.stages.read_array(j, "rollout", "group_ids")).long()
        prompt_ids = run.stages.read_array(j, "rollout", "prompt_ids")
        first, spread = curriculum.group_spread(rewards, group_ids)
        group_prompt += [position[int(p)] for p in prompt_ids[first.numpy()]]
        spreads += spread.tolist()
    group_prompt_a, spread_a = np.array(group_prompt, np.int64), np.array(spreads, np.float64)
    weights, seen = curriculum.prompt_weights(len(train_ids), group_prompt_a, spread_a, cfg.curriculum.floor)
    if seen.any():
        picks = curriculum.draw(weights, cfg.run.prompts_per_iteration, generator(cfg.run.seed, "prompts", iteration))
        chosen = train_ids[picks]
    else:  # no history (the first iteration): every weight is 1, and the draw is the uniform one
        chosen = uniform_prompts(cfg, train_ids, iteration)
    spread_sum = np.bincount(group_prompt_a, weights=spread_a, minlength=len(train_ids))
    return {
        "prompt_ids": chosen.tolist(),
        "train_ids": train_ids.tolist(),
        "weights": weights.tolist(),
        "window": [window(cfg, iteration).start, iteration],
        "seen": int(seen.sum()),
        "zero_spread": int((seen & (spread_sum == 0)).sum()),
    }


def stored(run: Run, iteration: int) -> DrawResult:
    """The published draw of `iteration`."""
    m = manifest(run, iteration, "draw", f"iteration {iteration} draw")
    record = run.read_draw(iteration)
    return DrawResult(
        digest=m["digest"],
        iteration=iteration,
        prompt_ids=record["prompt_ids"],
        seen=record["seen"],
        zero_spread=record["zero_spread"],
        weight_max=max(record["weights"]),
    )


def drawn_prompts(run: Run, cfg: Config, iteration: int) -> np.ndarray | None:
    """The prompt ids iteration `iteration` samples (one per group) when the curriculum drew them,
    else None (the uniform draw of `stepgrpo.loops.sampling.iteration_plan`)."""
    if cfg.curriculum.draw == UNIFORM:
        return None
    return np.array(run.read_draw(iteration)["prompt_ids"], np.int64)
