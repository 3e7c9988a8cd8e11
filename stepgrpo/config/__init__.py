"""The one validated configuration of a stepgrpo run.

A run is described by one `Config` with a sub-config per concern (model, sampler, completion,
reward, credit, optim, calibration, run). Every field has a comment; every model forbids unknown
fields; names of kernels, completions, credit schemes and rewards are checked against their
registries, so a typo fails here with an error that names the field and the allowed values,
never half-way through a run.

`STAGE_FIELDS` says which fields each pipeline stage reads: the cache key of a stage is built
from exactly these (docs/PIPELINE.md, "Caching and restart"), so changing the reward never invalidates
a rollout and changing the credit scheme never invalidates a score.

The sections live in modules by concern (`sampling`: model, sampler, completion, reward, credit;
`training`: optim and its presets, update, calibration; `running`: run, curriculum, storage, scale,
tracking); `whole` joins them into `Config` and holds the stage keys' fields; `files` builds a config
from YAML and overrides. Everything a caller needs is importable from `stepgrpo.config`.
"""

from stepgrpo.config._section import CODE_SALT, DEFAULT_MODEL, MAX_STEPS, MAX_TRAJECTORIES, ConfigError
from stepgrpo.config.files import (
    BASE_KEY,
    PLUGIN_SECTIONS,
    START_HERE,
    allow_plugins,
    apply_overrides,
    config_file,
    config_from,
    format_errors,
    load_config,
    load_yaml,
    shipped_recipes,
    user_set,
    validate_config,
)
from stepgrpo.config.running import CurriculumConfig, RunConfig, ScaleConfig, StorageConfig, TrackingConfig
from stepgrpo.config.sampling import CompletionConfig, CreditConfig, ModelConfig, RewardConfig, SamplerConfig
from stepgrpo.config.training import OPTIMIZER_PRESETS, CalibrationConfig, OptimConfig, UpdateConfig, expand_preset
from stepgrpo.config.whole import KEY_NEUTRAL, STAGE_FIELDS, Config, describe, digest_of, stage_fields

__all__ = [
    "BASE_KEY",
    "CODE_SALT",
    "DEFAULT_MODEL",
    "KEY_NEUTRAL",
    "MAX_STEPS",
    "MAX_TRAJECTORIES",
    "OPTIMIZER_PRESETS",
    "PLUGIN_SECTIONS",
    "STAGE_FIELDS",
    "START_HERE",
    "CalibrationConfig",
    "CompletionConfig",
    "Config",
    "ConfigError",
    "CreditConfig",
    "CurriculumConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RunConfig",
    "SamplerConfig",
    "ScaleConfig",
    "StorageConfig",
    "TrackingConfig",
    "UpdateConfig",
    "allow_plugins",
    "apply_overrides",
    "config_file",
    "config_from",
    "describe",
    "digest_of",
    "expand_preset",
    "format_errors",
    "load_config",
    "load_yaml",
    "shipped_recipes",
    "stage_fields",
    "user_set",
    "validate_config",
]
