"""The policy adapters (`SD3Policy`, `FluxPolicy`, chosen by `policy_class` from a model's
model_index.json) and the LoRA shape (`LoraSpec`)."""

from stepgrpo.policy.flux import FluxPolicy
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy

__all__ = ["FluxPolicy", "LoraSpec", "SD3Policy", "policy_class"]


POLICIES: dict[str, type[SD3Policy]] = {"StableDiffusion3Pipeline": SD3Policy, "FluxPipeline": FluxPolicy}


def policy_class(source: str) -> type[SD3Policy]:
    """The policy adapter of the pipeline `source` (a directory or hub id) names in its `model_index.json`."""
    from diffusers import DiffusionPipeline

    try:
        name = DiffusionPipeline.load_config(source).get("_class_name")
    except (OSError, ValueError) as err:
        raise ValueError(f"model {source!r}: its model_index.json cannot be read ({err})") from None
    if name not in POLICIES:
        raise ValueError(
            f"model {source!r} is a {name}; stepgrpo trains {', '.join(sorted(POLICIES))} pipelines "
            "(model_index.json's _class_name)"
        )
    return POLICIES[name]
