"""The SD3 policy adapter (`SD3Policy`) and its LoRA shape (`LoraSpec`)."""

from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy

__all__ = ["LoraSpec", "SD3Policy"]
