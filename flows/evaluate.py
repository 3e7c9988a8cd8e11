"""Evaluate a run: ODE sampling of held-out prompts, reward, and an image grid."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo import stages
from tasks.stages import bind


@flow(name="evaluate", log_prints=True)
def evaluate(run: str, iteration: int | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Held-out reward of the policy after `iteration` (default: the latest checkpoint; -1: the base model).

    `overrides` (`key=value`) may change evaluation settings such as `run.eval_prompts` or `reward.name`.
    """
    path, stored = stages.run_path(run, overrides)
    conf, where, t = stored.model_dump(mode="json"), str(path), bind(path)
    prompts = t.prompts(where, conf, 0, {})
    if iteration is None:
        iteration = stages.latest_checkpoint(path)
    checkpoint = "init" if iteration < 0 else stages.checkpoint_digest(path, iteration)
    result = t.evaluate(where, conf, iteration, {"prompts": prompts["digest"], "checkpoint": checkpoint})
    print(f"held-out {result['reward_name']} after {result['label']}: {result['reward_mean']:.4f}; grid {result['grid']}")
    return result
