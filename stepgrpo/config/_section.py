"""What every section of the config shares: the frozen, documented pydantic base, the absolute
bounds, and the registries its name fields are checked against."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from stepgrpo.paths import SHIPPED_MODEL

# Bumped whenever code changes what a stage computes from the same inputs: it is part of every
# cache key, so results written by older code are never reused by newer code.
CODE_SALT = "stepgrpo-stages-3"  # 2: rewards see 8-bit images; 3: flow eps_t at s = 1, ODE reference, Flow-GRPO KL

DEFAULT_MODEL = SHIPPED_MODEL


class ConfigError(ValueError):
    """A configuration that does not validate; the message names each bad field."""


def _run_form(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema as the Prefect run form shows it: a field that takes no null is marked
    required (the form shows the deployment's value and refuses an empty one, which would silently
    become the code's default rather than the recipe's), and each field's description ends with its
    default. A null-able field (e.g. `model.resolution`: null means the model's own) stays optional."""
    props = schema.get("properties", {})
    for name, prop in props.items():
        field = cls.model_fields[name]
        default = field.default_factory() if field.default_factory is not None else field.default
        if not isinstance(default, BaseModel):  # a section's defaults are shown on its own fields
            note = f"Default: `{json.dumps(default)}`."
            prop["description"] = f"{prop['description'].rstrip()}\n\n{note}" if prop.get("description") else note
    nullable = {n for n, p in props.items() if any(o.get("type") == "null" for o in p.get("anyOf", []))}
    schema["required"] = [n for n in props if n not in nullable]


# Absolute bounds, checked before anything is allocated: far beyond any recipe (Flow-GRPO samples
# 10 steps and evaluates 40; its batch is 48 x 24), small enough that a typo fails at once instead of
# allocating gigabytes mid-run.
MAX_STEPS = 1000
MAX_TRAJECTORIES = 1 << 20  # run.prompts_per_iteration x run.group_size


class Section(BaseModel):
    # The docstring under each field is its description: `stepgrpo config show` prints it, and the
    # JSON schema (the Prefect run form) shows it beside the field, with its default (`_run_form`).
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        json_schema_extra=_run_form,
    )


def registered(registry: str) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` listing a registry's names as the field's choices, read when the schema
    is made (so names that plugins register show too)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["enum"] = _registry(registry).names()

    return extra


def _registry(name: str) -> Any:
    if name == "kernels":
        from stepgrpo_core.kernels import KERNELS

        return KERNELS
    if name == "schemes":
        from stepgrpo_core.credit import SCHEMES

        return SCHEMES
    if name == "objectives":
        from stepgrpo_core.objectives import OBJECTIVES

        return OBJECTIVES
    from stepgrpo.rewards import REWARDS

    return REWARDS


def completion_choices(schema: dict[str, Any]) -> None:
    """The completion field accepts what the registry's entries declare (`pattern`: a name, or
    `name:N` with N a positive count)."""
    from stepgrpo_core.completions import COMPLETIONS

    patterns = [COMPLETIONS.describe(n)["pattern"] for n in COMPLETIONS.names()]
    regex = "|".join(p.replace(":N", ":[1-9][0-9]*") for p in patterns)
    schema["anyOf"] = [{"type": "string", "pattern": f"^({regex})$", "examples": patterns}, {"type": "null"}]
