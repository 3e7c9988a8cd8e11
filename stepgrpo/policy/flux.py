"""A Flux-shaped policy: `FluxPipeline` components behind the same `velocity(x, sigma, cond)`.

What differs from SD3, and is kept inside this adapter so that every kernel, completion, scheme
and stage works unchanged:

- latents: the core sees unpacked latents `[B, C, H, W]` (C = the transformer's `in_channels / 4`);
  `velocity` packs them into Flux's `2 x 2` patch tokens `[B, H/2 * W/2, 4C]` with their position
  ids and unpacks the prediction, as `FluxPipeline` does;
- guidance: FLUX.1-dev is guidance-distilled. `model.guidance_scale` is the value of its guidance
  embedding (3.5 for dev); there is no classifier-free pass (one transformer row per velocity row);
- conditioning: CLIP's pooled embedding and T5's token embeddings (`FluxPipeline.encode_prompt`),
  T5 to `max_sequence_length` tokens (Flow-GRPO's Flux recipe: 128);
- the grid: the scheduler's sigmas for `linspace(1, 1/T, T)` shifted by the image's token count
  (`mu`, dynamic shifting), exactly as `FluxPipeline` calls `set_timesteps`; the transformer takes
  `timestep = sigma` (the pipeline's `t / 1000`).

The LoRA is saved in `FluxPipeline`'s format (`FluxPipeline.load_lora_weights` reads it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stepgrpo.policy.base import Cond, TransformerPolicy, _one_truncation_warning

FLUX_MAX_SEQUENCE_LENGTH = 128  # T5 tokens (FluxPipeline's default is 512; Flow-GRPO trains with 128)
# Flow-GRPO's and diffusers' Flux LoRA targets: the attention projections of both streams and the
# feed-forward layers of the double-stream blocks (`to_q` / `to_k` / `to_v` also match the single-stream blocks)
FLUX_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


def pack(x: torch.Tensor) -> torch.Tensor:
    """`[B, C, H, W]` -> `[B, (H/2)(W/2), 4C]` (FluxPipeline's `_pack_latents`)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """`[B, (H/2)(W/2), 4C]` -> `[B, C, H, W]` (the inverse of `pack`; the pipeline's `_unpack_latents`)."""
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


class FluxPolicy(TransformerPolicy):
    """The policy interface over a `FluxPipeline` (module doc), beside `SD3Policy`."""

    PIPELINE = "FluxPipeline"
    KIND = "Flux"
    HUB_EXAMPLE = "black-forest-labs/FLUX.1-dev"

    @staticmethod
    def _default_sequence_length(pipe: Any) -> int:
        return FLUX_MAX_SEQUENCE_LENGTH

    def _latent_layout(self, resolution: int | None) -> tuple[int, int, int]:
        side = (
            resolution
            if resolution is not None
            else getattr(self.pipe, "default_sample_size", 128) * self.vae_scale_factor
        )
        if side % (self.vae_scale_factor * 2):
            raise ValueError(
                f"resolution {side} must be a multiple of vae scale x 2 = {self.vae_scale_factor * 2} "
                "(Flux packs 2 x 2 latents)"
            )
        latent = side // self.vae_scale_factor
        return (self.transformer.config.in_channels // 4, latent, latent)

    def _image_tokens(self) -> int:
        _, h, w = self.latent_shape
        return (h // 2) * (w // 2)

    @property
    def do_cfg(self) -> bool:
        return False  # the guidance is an input of the distilled transformer, not a second pass

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> Cond:
        """`B` prompts -> `{"prompt_embeds" [B, L, D] (T5), "pooled_prompt_embeds" [B, P] (CLIP)}`."""
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode needs a non-empty list of prompt strings")
        with _one_truncation_warning():
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    def _velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        _, h, w = self.latent_shape
        x = x.to(self.device, self.dtype)
        embeds = cond["prompt_embeds"].to(self.device, self.dtype)
        # the pipeline's timestep: sigma * num_train_timesteps in the latents' dtype, then / 1000
        timestep = (sigma.to(self.device, torch.float32) * self.num_train_timesteps).to(self.dtype) / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((x.shape[0],), self.guidance_scale, device=self.device, dtype=torch.float32)
        v = self.transformer(
            hidden_states=pack(x),
            timestep=timestep,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(self.device, self.dtype),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=self._image_ids(h, w),
            return_dict=False,
        )[0]
        return unpack(v, h, w)

    def _image_ids(self, h: int, w: int) -> torch.Tensor:
        """Flux's `(0, row, column)` position ids of the `(h/2)(w/2)` packed tokens."""
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        return ids.reshape(-1, 3).to(self.device, self.dtype)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """`[T+1]` fp32: the grid `FluxPipeline` samples on with `num_inference_steps=T` at this resolution."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if num_steps not in self._sigmas:
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            c = self._scheduler.config
            mu = calculate_shift(
                self._image_tokens(),
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.15),
            )
            scheduler = copy.deepcopy(self._scheduler)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
            self._sigmas[num_steps] = scheduler.sigmas.float().clone()
        return self._sigmas[num_steps].to(self.device)
