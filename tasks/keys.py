"""Cache keys of the stage tasks (docs/PIPELINE.md, "Caching and restart"), derived here only.

A stage's key is the digest of exactly: the stage name, the config fields the
stage reads (`stepgrpo.config.STAGE_FIELDS`), what it records of its upstream results
(`StageResult.key_inputs`: their content digests and the names they carry), the model's identity
(the fingerprint recorded in the run's manifest) except for the stages that read no model, the
reward's declared name / version / options for the stages that score, the iteration, and
`CODE_SALT`. Nothing else, and computing it loads nothing: changing the reward changes the keys of
score and what follows it, never of rollout or complete. No path is part of a key, so a copied,
moved or remounted run resumes.

A published stage records its key in its manifest; the stage counts as done for a key only if the
recorded key is that key (`Key.accepts`) and its data verify against its manifest (`stepgrpo.tasks.base`).
Runs made before keys were relocatable recorded the key with the run's absolute path in it: that
key is accepted too, for a run that has not moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from stepgrpo.config import CODE_SALT, Config, digest_of, stage_fields
from stepgrpo.results import StageResult
from stepgrpo.runs import MODEL_FACT
from stepgrpo.storage.run import Run

# Stages whose numbers depend on the reward model itself (not only on stored reward rows).
REWARD_STAGES = frozenset({"score", "evaluate", "calibrate"})
# Stages that read no model at all.
MODEL_FREE_STAGES = frozenset({"prompts", "credit", "draw"})
# What the key records for an absent upstream: the base model's weights, no calibrated table.
ABSENT = {"checkpoint": "init", "psi": None}
Upstream = StageResult | str | None


class Key(NamedTuple):
    """A stage's key (`value`, recorded when the stage publishes) and the key a run made before
    keys were relocatable recorded for the same inputs (`legacy`)."""

    value: str
    legacy: str

    def accepts(self, recorded: str | None) -> bool:
        return recorded is None or recorded in (self.value, self.legacy)


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
    stored = run.config.get("model", {})
    if recorded is not None and (stored.get("path"), stored.get("init_lora")) == (cfg.model.path, cfg.model.init_lora):
        return recorded
    from stepgrpo.loops import workspace

    return workspace.policy_identity(cfg.model)


def code_facts(stage: str, cfg: Config) -> dict[str, Any]:
    """What changed in a stage's computation after runs were stored, for the configs it changed:
    part of the key only there, so every other stored stage keeps its key."""
    from stepgrpo_core.completions import Method
    from stepgrpo_core.kernels import KERNELS

    start, end = cfg.sampler.window()
    facts: dict[str, Any] = {}
    if stage in ("rollout", "calibrate") and KERNELS.facts(cfg.sampler.kernel)["version"] != "1":
        facts["kernel_version"] = KERNELS.facts(cfg.sampler.kernel)["version"]
    method = cfg.completion.method
    if stage == "complete" and method is not None and end < cfg.sampler.steps:
        if not Method.parse(method).facts["exact_tail"]:
            facts["completes_window_end"] = True  # stepgrpo_core.completions.completed_through
    if stage == "calibrate" and (start, end) != (0, cfg.sampler.steps):
        facts["calibrates_in_window"] = True
    if stage == "update":  # the one update loop's round: what the objectives' authors do
        u = cfg.update.resolved
        if u["keep_zero"]:
            facts["keeps_zero_advantage"] = True  # every earlier update dropped those samples
        if u["companion"] is not None and u["companion_moves"] != "step":
            facts["companion_moves"] = u["companion_moves"]  # it moved after every optimizer step
        if u["version"] != "1":
            facts["objective_version"] = u["version"]
    return facts


def stage_key(stage: str, run: Run, cfg: Config, iteration: int, upstream: Mapping[str, Upstream]) -> Key:
    from stepgrpo.loops import workspace

    parts: dict[str, Any] = {
        "stage": stage,
        "iteration": iteration,
        "fields": stage_fields(cfg, stage),
        "inputs": key_inputs(upstream),
        "salt": CODE_SALT,
        **code_facts(stage, cfg),
    }
    if stage not in MODEL_FREE_STAGES:
        parts["model"] = model_identity(run, cfg)
    if stage in REWARD_STAGES:
        parts["reward"] = workspace.reward_identity(cfg.reward)
    legacy = {**parts, "run_dir": str(Path(run.path).resolve())}
    return Key(digest_of(parts), digest_of(legacy))
