"""The policy adapter of a diffusers Stable Diffusion 3 pipeline (SD3, SD3.5): its prompt encoding,
classifier-free guidance, timestep scale and sigma grid; the rest is `TransformerPolicy`'s.

The same code loads the shipped tiny model (`models/shapes` at the repository root, the default)
and real checkpoints such as `stabilityai/stable-diffusion-3.5-medium` from the hub.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from stepgrpo.policy.base import T5_MAX_SEQUENCE_LENGTH, Cond, TransformerPolicy, _one_truncation_warning


class SD3Policy(TransformerPolicy):
    """`velocity`, `encode`, `decode` and the sigma grid of a `StableDiffusion3Pipeline`
    (`TransformerPolicy` for the attributes and the construction)."""

    PIPELINE = "StableDiffusion3Pipeline"
    KIND = "SD3"
    HUB_EXAMPLE = "stabilityai/stable-diffusion-3.5-medium"

    @staticmethod
    def _default_sequence_length(pipe: Any) -> int:
        # without a T5 encoder the pipeline would append this many zero rows to the context
        return 0 if pipe.text_encoder_3 is None else T5_MAX_SEQUENCE_LENGTH

    def _latent_layout(self, resolution: int | None) -> tuple[int, int, int]:
        """`(C, H, W)` of the latents the core sees, for an image side of `resolution` pixels."""
        cfg = self.transformer.config
        side = cfg.sample_size if resolution is None else resolution // self.vae_scale_factor
        if resolution is not None and resolution % (self.vae_scale_factor * cfg.patch_size):
            raise ValueError(
                f"resolution {resolution} must be a multiple of vae scale x patch = "
                f"{self.vae_scale_factor * cfg.patch_size}"
            )
        return (cfg.in_channels, side, side)

    def _image_tokens(self) -> int:
        """Image tokens of one latent (the scheduler's dynamic shift reads it)."""
        _, h, w = self.latent_shape
        patch = self.transformer.config.patch_size
        return (h // patch) * (w // patch)

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> Cond:
        """`B` prompts -> conditioning dict, every leaf `[B, ...]` in the policy dtype:

        `prompt_embeds [B, L, D]`, `pooled_prompt_embeds [B, P]`, and with CFG also
        `negative_prompt_embeds`, `negative_pooled_prompt_embeds` (the same shapes).
        """
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode needs a non-empty list of prompt strings")
        with _one_truncation_warning():
            pe, npe, pooled, npooled = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                do_classifier_free_guidance=self.do_cfg,
                negative_prompt=[self.negative_prompt] * len(prompts) if self.do_cfg else None,
                max_sequence_length=self.max_sequence_length,
            )
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if self.do_cfg:
            cond |= {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npooled}
        return cond

    def _velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        timestep = sigma.to(self.device, torch.float32) * self.num_train_timesteps
        x = x.to(self.device, self.dtype)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.do_cfg:
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        v = self.transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=embeds.to(self.device, self.dtype),
            pooled_projections=pooled.to(self.device, self.dtype),
            return_dict=False,
        )[0]
        if self.do_cfg:
            v_uncond, v_cond = v.chunk(2)
            if self._detach_uncond:
                v_uncond = v_uncond.detach()
            v = v_uncond + self.guidance_scale * (v_cond - v_uncond)
        return v

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """`[T+1]` fp32 grid from the scheduler (its shift), decreasing from ~1 to a final 0.

        Exactly the grid `StableDiffusion3Pipeline` samples on with `num_inference_steps=T`.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if num_steps not in self._sigmas:
            kwargs = {}
            if self._scheduler.config.get("use_dynamic_shifting", False):
                from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

                c = self._scheduler.config
                kwargs["mu"] = calculate_shift(
                    self._image_tokens(),
                    c.get("base_image_seq_len", 256),
                    c.get("max_image_seq_len", 4096),
                    c.get("base_shift", 0.5),
                    c.get("max_shift", 1.16),
                )
            scheduler = copy.deepcopy(self._scheduler)  # set_timesteps mutates the scheduler
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
            self._sigmas[num_steps] = scheduler.sigmas.float().clone()
        return self._sigmas[num_steps].to(self.device)
