"""The policy adapters, side by side (`SD3Policy`, `FluxPolicy`, chosen by `policy_class` from a
model's model_index.json; both build on `TransformerPolicy`), the `Policy` protocol the loops
use, and the LoRA shape (`LoraSpec`)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from stepgrpo.policy.base import Cond, ImageDecoder, TransformerPolicy
from stepgrpo.policy.flux import FluxPolicy
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy

__all__ = ["FluxPolicy", "LoraSpec", "Policy", "SD3Policy", "TransformerPolicy", "policy_class"]


@runtime_checkable
class Policy(Protocol):
    """What sampling, scoring, training and the stages use of a policy: the velocity of a state at a
    noise level under a prompt's conditioning, its sigma grid and initial noise, the decoder, the
    trained weights and the KL reference. `nfe` counts velocity rows (a guided row once)."""

    nfe: int
    dtype: torch.dtype
    device: torch.device
    max_batch: int
    latent_shape: tuple[int, int, int]
    decoder: ImageDecoder
    transformer: Any  # the diffusers transformer (peft-wrapped when a LoRA is attached)
    lora: LoraSpec | None
    full: bool

    @property
    def do_cfg(self) -> bool: ...

    def encode(self, prompts: Sequence[str]) -> Cond: ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def decode_uint8(self, latents: torch.Tensor) -> torch.Tensor: ...

    def sigmas(self, num_steps: int) -> torch.Tensor: ...

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor: ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    def reference(self) -> AbstractContextManager[Policy]: ...

    def set_reference(self, weights: dict[str, torch.Tensor]) -> None: ...

    def detached_uncond(self, enabled: bool = True) -> AbstractContextManager[Policy]: ...

    def save_lora(self, directory: str | Path) -> Path: ...

    def load_lora(self, directory: str | Path) -> None: ...


POLICIES: dict[str, type[TransformerPolicy]] = {"StableDiffusion3Pipeline": SD3Policy, "FluxPipeline": FluxPolicy}


def policy_class(source: str) -> type[TransformerPolicy]:
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
