"""The policy adapters (`SD3Policy`, `FluxPolicy`, chosen by `policy_class` from a model's
model_index.json) and the LoRA shape (`LoraSpec`)."""

from stepgrpo.policy.flux import FluxPolicy, policy_class
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy

__all__ = ["FluxPolicy", "LoraSpec", "SD3Policy", "policy_class"]
