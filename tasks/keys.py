"""Cache keys of the stage tasks (DESIGN.md, "Caching and restart: the contract").

A stage's key is the digest of exactly: the stage name, the run directory, the config fields the
stage reads (`stepgrpo.config.STAGE_FIELDS`), the content digests of its inputs (upstream
references), the model's identity (a digest of its files), the reward's name / version / options
for the stages that score, the iteration, and `CODE_SALT`. Nothing else: changing the reward
changes the keys of score and what follows it, never of rollout or complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stepgrpo.config import CODE_SALT, digest_of, stage_fields, validate_config

# Stages whose numbers depend on the reward model itself (not only on stored reward rows).
REWARD_STAGES = frozenset({"score", "evaluate", "calibrate"})


def stage_key(stage: str, run_dir: str, config: Mapping[str, Any], iteration: int, inputs: Mapping[str, Any]) -> str:
    from stepgrpo import workspace

    cfg = validate_config(config)
    parts: dict[str, Any] = {
        "stage": stage,
        "run_dir": run_dir,
        "iteration": iteration,
        "fields": stage_fields(cfg, stage),
        "inputs": dict(inputs),
        "salt": CODE_SALT,
    }
    if stage not in ("prompts", "credit"):
        parts["model"] = workspace.model_identity(cfg.model.path)
    if stage in REWARD_STAGES:
        parts["reward"] = workspace.reward_identity(cfg.reward)
    return digest_of(parts)


def cache_key(stage: str) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect `cache_key_fn` for a stage task `(run_dir, config, iteration, inputs)`."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str:
        return stage_key(stage, parameters["run_dir"], parameters["config"], parameters["iteration"], parameters["inputs"])

    key_fn.__name__ = f"{stage}_cache_key"
    return key_fn
