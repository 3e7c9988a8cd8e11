"""What every policy adapter shares: a diffusers pipeline's transformer behind the `velocity` interface.

stepgrpo drives the transformer itself (the diffusers scheduler has no log-prob); this adapter
owns everything model-specific: prompt encoding, classifier-free guidance, the timestep scale,
the VAE's latent normalisation, the scheduler's sigma grid and the LoRA adapter.

Shapes: `B` rows of latents `[B, C, H, W]`, `N` images `[N, 3, H_img, W_img]`, `T` steps.

The same code loads the shipped tiny model (`models/shapes` at the repository root, the default)
and real checkpoints such as `stabilityai/stable-diffusion-3.5-medium` from the hub.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import torch

from stepgrpo.images import quantize
from stepgrpo.paths import SHIPPED_MODEL, SHIPPED_ROOT
from stepgrpo.policy import lora as lora_lib
from stepgrpo.policy.devices import resolve_device, resolve_dtype
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.shards import copy_into

DEFAULT_MODEL = SHIPPED_ROOT / SHIPPED_MODEL
DEFAULT_MAX_BATCH = 64
T5_MAX_SEQUENCE_LENGTH = 256  # the pipeline's default T5 context when a T5 encoder is present

Cond = dict[str, torch.Tensor]


def _is_hub_id(name: str) -> bool:
    """`org/name` that is not a local path: hand it to the hub (or its offline cache)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def _absent_components(source: str) -> dict[str, None]:
    """Components saved as absent (`[null, null]` in `model_index.json`, e.g. no T5 encoder).

    diffusers refuses to load a pipeline with a missing required component unless it is passed
    explicitly, so pass these as `None`.
    """
    index = Path(source) / "model_index.json"
    if not index.is_file():
        return {}
    entries = json.loads(index.read_text())
    return {name: None for name, value in entries.items() if value == [None, None]}


class ImageDecoder:
    """The VAE half of a pipeline: clean latents -> images.

    Scoring needs only this, so re-scoring a stored run loads the VAE alone
    (`ImageDecoder.from_pretrained`), not the transformer and text encoders.
    Rewards are given 8-bit images (`decode_uint8`, then `stepgrpo.images.dequantize`), as a
    deployed pipeline hands them PIL images; the stored image cache holds exactly those bytes.
    """

    def __init__(self, vae: Any, dtype: torch.dtype, device: torch.device, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.vae, self.dtype, self.device, self.max_batch = vae, dtype, device, max_batch

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = "cpu",
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> ImageDecoder:
        """The `vae` of a `StableDiffusion3Pipeline` directory or hub id (default: the shipped model)."""
        from diffusers import AutoencoderKL

        source = str(path_or_hub_id) if path_or_hub_id is not None else str(DEFAULT_MODEL)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        if "vae" in _absent_components(source):
            return cls(None, dtype, device, max_batch)
        vae = AutoencoderKL.from_pretrained(source, subfolder="vae", torch_dtype=dtype)
        return cls(vae.to(device).requires_grad_(False).eval(), dtype, device, max_batch)

    def image_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """`(3, Y, X)` of the images `decode` makes of latents of shape `(C, H, W)`."""
        C, H, W = (int(v) for v in latent_shape)
        if self.vae is None:
            return C, H, W
        f = 2 ** (len(self.vae.config.block_out_channels) - 1)
        return 3, H * f, W * f

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """`[N, C, H, W]` clean latents -> images `[N, 3, H_img, W_img]` fp32 in [0, 1], in chunks.

        Undoes the VAE normalisation (`z / scaling_factor + shift_factor`) as the pipeline does.
        Without a VAE the latents are pixels in [-1, 1].
        """
        images = []
        for chunk in latents.split(self.max_batch):
            z = chunk.to(self.device, self.dtype)
            if self.vae is not None:
                z = z / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
                z = self.vae.decode(z, return_dict=False)[0]
            images.append((z.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(images)

    def decode_uint8(self, latents: torch.Tensor) -> torch.Tensor:
        """`[N, C, H, W]` -> `[N, 3, H_img, W_img]` uint8 (on the CPU)."""
        return quantize(self.decode(latents)).cpu()


class TransformerPolicy:
    """`velocity`, `encode`, `decode` and the sigma grid of a diffusers text-to-image pipeline whose
    transformer predicts a flow velocity. What differs between pipelines is in its subclasses
    (`SD3Policy`, `FluxPolicy`, side by side); what the loops use is the `Policy` protocol
    (`stepgrpo.policy`).

    Build with `<Subclass>.from_pretrained(path_or_hub_id, ...)` or `<Subclass>.from_pipeline(pipe, ...)`.

    Attributes:
        nfe: transformer evaluations counted in rows of `x` passed to `velocity`. With CFG the
            transformer runs on 2 rows (unconditional + conditional) per counted row: a guided
            velocity counts once, as the papers count function evaluations.
        dtype, device: of every component (the LoRA weights stay fp32 when `dtype` is half).
    """

    def __init__(
        self,
        pipe: Any,
        dtype: torch.dtype,
        device: torch.device,
        guidance_scale: float,
        lora: LoraSpec | None,
        max_batch: int,
        resolution: int | None,
        max_sequence_length: int | None,
        negative_prompt: str,
        full: bool = False,
        gradient_checkpointing: bool = False,
    ) -> None:
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1 turns CFG off), got {guidance_scale}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.pipe = pipe.to(device)
        if pipe.transformer.dtype != dtype:  # diffusers warns about any cast, so cast only when needed
            self.pipe.to(dtype=dtype)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.decoder = ImageDecoder(pipe.vae, dtype, device, max_batch)
        self.dtype, self.device = dtype, device
        self.guidance_scale = float(guidance_scale)
        self._detach_uncond = False  # see `detached_uncond`
        self.max_batch = max_batch
        self.negative_prompt = negative_prompt
        if max_sequence_length is None:
            max_sequence_length = self._default_sequence_length(pipe)
        self.max_sequence_length = max_sequence_length
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
        # the scheduler is only read for its sigma grid; keep a private copy of its config
        self._scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        self.num_train_timesteps = int(self._scheduler.config.num_train_timesteps)
        self._sigmas: dict[int, torch.Tensor] = {}

        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        self.latent_shape: tuple[int, int, int] = self._latent_layout(resolution)
        self.nfe = 0

        self.lora = lora
        self.full = full
        self._reference: Any = None  # full fine-tuning: the frozen reference transformer (`reference`)
        if lora is not None and full:
            raise ValueError("a policy trains either a LoRA or every weight (full=True), not both")
        if lora is not None:
            lora_lib.add_lora(self.transformer, lora)
            # half-precision adapters lose small updates; train them in fp32 (peft casts inputs)
            for p in self.trainable_parameters():
                p.data = p.data.float()
        if full:
            self._reference = copy.deepcopy(self.transformer).requires_grad_(False).eval()
            self.transformer.requires_grad_(True)
        if gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()

    # ---- what differs between pipelines (each subclass defines these) ----

    PIPELINE: str  # the diffusers class name: loading, and the LoRA format
    KIND: str  # the model family, in messages
    HUB_EXAMPLE: str  # a hub id of the family, in messages

    @staticmethod
    def _default_sequence_length(pipe: Any) -> int:
        raise NotImplementedError

    def _latent_layout(self, resolution: int | None) -> tuple[int, int, int]:
        """`(C, H, W)` of the latents the core sees, for an image side of `resolution` pixels."""
        raise NotImplementedError

    def _image_tokens(self) -> int:
        """Image tokens of one latent (the scheduler's dynamic shift reads it)."""
        raise NotImplementedError

    @property
    def do_cfg(self) -> bool:
        """Whether a velocity runs the classifier-free pass."""
        raise NotImplementedError

    def encode(self, prompts: Sequence[str]) -> Cond:
        raise NotImplementedError

    def _velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        raise NotImplementedError

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sampling grid `[T+1]` from 1 to 0."""
        raise NotImplementedError

    # ---- the pipeline's class, and construction ----

    @classmethod
    def pipeline_class(cls) -> Any:
        import diffusers

        return getattr(diffusers, cls.PIPELINE)

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | Path | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = "cpu",
        **options: Any,
    ) -> Self:
        """Load a pipeline directory or hub id of the subclass's `PIPELINE` (default: the shipped `models/shapes`).

        dtype: `None` -> fp32 on CPU, bf16 on GPU; or "float32" / "float16" / "bfloat16".
        device: "cpu", "cuda", ... (`None` -> CUDA if available).
        options: `guidance_scale`, `lora`, `max_batch`, ... as in `from_pipeline`.
        """
        source = str(path_or_hub_id) if path_or_hub_id is not None else str(DEFAULT_MODEL)
        if not Path(source).is_dir() and not _is_hub_id(source):
            hint = (
                "build the shipped model with `stepgrpo pretrain`"
                if path_or_hub_id is None
                else f"pass a {cls.PIPELINE} directory or a hub id like {cls.HUB_EXAMPLE}"
            )
            raise FileNotFoundError(f"no {cls.KIND} pipeline directory at {source}; {hint}")
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        pipe = cls.pipeline_class().from_pretrained(source, dtype=dtype, **_absent_components(source))
        return cls.from_pipeline(pipe, dtype, device, **options)

    @classmethod
    def from_pipeline(
        cls,
        pipe: Any,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = "cpu",
        guidance_scale: float = 1.0,
        lora: LoraSpec | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        resolution: int | None = None,
        max_sequence_length: int | None = None,
        negative_prompt: str = "",
        full: bool = False,
        gradient_checkpointing: bool = False,
    ) -> Self:
        """Wrap a `StableDiffusion3Pipeline`; its modules are moved / cast in place.

        dtype, device: as `from_pretrained`.
        guidance_scale: CFG scale; 1.0 turns CFG off (one transformer row per velocity row).
        lora: attach a trainable adapter of this shape; `None` for a frozen policy.
        max_batch: most transformer rows per call (CFG rows included); larger batches are chunked.
        resolution: image side in pixels (default: the transformer's `sample_size` x VAE scale).
        max_sequence_length: T5 tokens (default 256 with a T5 encoder, 0 without one).
        negative_prompt: the unconditional prompt for CFG.
        full: train every transformer weight (no adapter); `reference()` is then a frozen copy.
        gradient_checkpointing: recompute activations in the backward pass (less memory).
        """
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        return cls(
            pipe,
            dtype,
            device,
            guidance_scale,
            lora,
            max_batch,
            resolution,
            max_sequence_length,
            negative_prompt,
            full,
            gradient_checkpointing,
        )

    # ---- the model interface ----

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """`x [B, C, H, W]`, `sigma [B]`, `cond` from `encode` (rows aligned with `x`) -> `v [B, C, H, W]`.

        One transformer call per chunk (SD3 timestep = sigma * num_train_timesteps); with CFG the
        chunk is doubled (unconditional rows first, as the pipeline does) and combined as
        `v_u + s (v_c - v_u)`. Differentiable (no `no_grad`): the policy update calls it too.
        """
        if x.ndim != 4 or tuple(x.shape[1:]) != self.latent_shape:
            raise ValueError(f"x must be [B, {', '.join(map(str, self.latent_shape))}], got {tuple(x.shape)}")
        if sigma.shape != (x.shape[0],):
            raise ValueError(f"sigma must be [B] = [{x.shape[0]}], got {tuple(sigma.shape)}")
        rows = max(1, self.max_batch // (2 if self.do_cfg else 1))
        out = [
            self._velocity_chunk(x[i : i + rows], sigma[i : i + rows], {k: c[i : i + rows] for k, c in cond.items()})
            for i in range(0, x.shape[0], rows)
        ]
        self.nfe += x.shape[0]
        return torch.cat(out).to(x.dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """`[N, C, H, W]` clean latents -> images `[N, 3, H_img, W_img]` fp32 in [0, 1] (`ImageDecoder.decode`)."""
        return self.decoder.decode(latents)

    def decode_uint8(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents -> uint8 images, as the rewards see them (`ImageDecoder.decode_uint8`)."""
        return self.decoder.decode_uint8(latents)

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """`[B, C, H, W]` standard normal in the policy dtype: the pipeline's own draw for `generator`."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor((batch, *self.latent_shape), generator=generator, device=self.device, dtype=self.dtype)

    # ---- LoRA ----

    def _require_lora(self) -> None:
        if self.lora is None:
            raise ValueError("this policy has no LoRA adapter; build it with lora=LoraSpec(...)")

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The trained weights: the LoRA's, or every transformer weight (`full`); empty if frozen."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[Self]:
        """Inside the block `velocity` is the KL reference: the base model (the adapter disabled),
        or with full fine-tuning the reference transformer (`set_reference`; a frozen copy of the
        weights the policy was built with)."""
        if self.full:
            trained, self.transformer = self.transformer, self._reference
            try:
                yield self
            finally:
                self.transformer = trained
            return
        self._require_lora()
        self.transformer.disable_adapters()
        try:
            yield self
        finally:
            self.transformer.enable_adapters()

    def set_reference(self, weights: dict[str, torch.Tensor]) -> None:
        """Full fine-tuning: load `weights` (every transformer weight by name, e.g. the EMA) into the reference."""
        if not self.full:
            raise ValueError("set_reference is for a fully fine-tuned policy; a LoRA's reference is its base model")
        with torch.no_grad():
            for name, p in self._reference.named_parameters():
                copy_into(p, weights[name])  # whole, or a sharded update's shard

    @contextlib.contextmanager
    def detached_uncond(self, enabled: bool = True) -> Iterator[Self]:
        """Inside the block, CFG's unconditional prediction carries no gradient (Flow-GRPO's update):
        the policy is trained through its conditional branch only. Same values as outside."""
        before, self._detach_uncond = self._detach_uncond, enabled
        try:
            yield self
        finally:
            self._detach_uncond = before

    def save_lora(self, directory: str | Path) -> Path:
        """Write the adapter as `directory/pytorch_lora_weights.safetensors`, loadable with
        `StableDiffusion3Pipeline.load_lora_weights(directory)`."""
        self._require_lora()
        return lora_lib.save_lora(self.transformer, directory, self.pipeline_class())

    def load_lora(self, directory: str | Path) -> None:
        """Load adapter weights written by `save_lora` (same rank and targets)."""
        self._require_lora()
        lora_lib.load_lora(self.transformer, directory, self.pipeline_class())


_truncation_said = False


@contextlib.contextmanager
def _one_truncation_warning() -> Any:
    """diffusers logs every truncated prompt whole, on every encode (megabytes for long prompts):
    say it once per process, in one line, instead."""
    import logging

    global _truncation_said
    log = logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")
    seen: list[logging.LogRecord] = []

    class Catch(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if "was truncated" in record.getMessage():
                seen.append(record)
                return False
            return True

    catch = Catch()
    log.addFilter(catch)
    try:
        yield
    finally:
        log.removeFilter(catch)
        if seen and not _truncation_said:
            _truncation_said = True
            log.warning("some prompts are longer than the text encoders read; they are truncated (said once)")
