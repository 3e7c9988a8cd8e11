"""Cache keys of the stage tasks (DESIGN.md, "Caching and restart: the contract"), derived here only.

A stage's key is the digest of exactly: the stage name, the run directory, the config fields the
stage reads (`stepgrpo.config.STAGE_FIELDS`), what it records of its upstream results
(`StageResult.key_inputs`: their content digests and the names they carry), the model's identity
(the fingerprint recorded in the run's manifest) except for the stages that read no model, the
reward's declared name / version / options for the stages that score, the iteration, and
`CODE_SALT`. Nothing else, and computing it loads nothing: changing the reward changes the keys of
score and what follows it, never of rollout or complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stepgrpo.config import CODE_SALT, Config, digest_of, stage_fields
from stepgrpo.results import StageResult
from stepgrpo.runs import MODEL_FACT
from storage.run import Run

# Stages whose numbers depend on the reward model itself (not only on stored reward rows).
REWARD_STAGES = frozenset({"score", "evaluate", "calibrate"})
# Stages that read no model at all.
MODEL_FREE_STAGES = frozenset({"prompts", "credit"})
# What the key records for an absent upstream: the base model's weights, no calibrated table.
ABSENT = {"checkpoint": "init", "psi": None}
# The layout of the task results Prefect keeps; bumped when a result type changes shape, so a
# record of another shape is never returned (the stage then re-reads its published output).
RESULT_FORMAT = "typed-1"
ARGUMENTS = ("run", "cfg", "iteration")  # a stage task's parameters that are not upstream results

Upstream = StageResult | str | None


def key_inputs(upstream: Mapping[str, Upstream]) -> dict[str, Any]:
    """What a key records of a stage's upstream results (a `str` is a digest given as is)."""
    out: dict[str, Any] = {}
    for name, value in upstream.items():
        if value is None:
            out[name] = ABSENT[name]
        elif isinstance(value, str):
            out[name] = value
        else:
            out.update(value.key_inputs(name))
    return out


def model_identity(run: Run, cfg: Config) -> str:
    """The fingerprint of `cfg.model`: the one recorded in the run's manifest when it is the run's
    model; a model named by an override is fingerprinted here (once per process)."""
    recorded = run.fact(MODEL_FACT)
    if recorded is not None and run.config.get("model", {}).get("path") == cfg.model.path:
        return recorded
    from stepgrpo import workspace

    return workspace.model_identity(cfg.model.path)


def stage_key(stage: str, run: Run, cfg: Config, iteration: int, upstream: Mapping[str, Upstream]) -> str:
    from stepgrpo import workspace

    parts: dict[str, Any] = {
        "stage": stage,
        "run_dir": str(Path(run.path).resolve()),
        "iteration": iteration,
        "fields": stage_fields(cfg, stage),
        "inputs": key_inputs(upstream),
        "salt": CODE_SALT,
    }
    if stage not in MODEL_FREE_STAGES:
        parts["model"] = model_identity(run, cfg)
    if stage in REWARD_STAGES:
        parts["reward"] = workspace.reward_identity(cfg.reward)
    return digest_of(parts)


def task_key(stage: str, parameters: Mapping[str, Any]) -> str:
    """The key of a stage task's call from its parameters (`run, cfg[, iteration], *upstream`)."""
    upstream = {k: v for k, v in parameters.items() if k not in ARGUMENTS}
    return stage_key(stage, parameters["run"], parameters["cfg"], parameters.get("iteration", 0), upstream)


def cache_key(stage: str) -> Callable[[Any, dict[str, Any]], str]:
    """A Prefect `cache_key_fn`: the stage key and the result format."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str:
        return f"{stage}-{task_key(stage, parameters)}-{RESULT_FORMAT}"

    key_fn.__name__ = f"{stage}_cache_key"
    return key_fn
