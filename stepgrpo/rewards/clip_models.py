"""Rewards computed from CLIP embeddings: PickScore, CLIPScore and the LAION aesthetic predictor.

Each loads a transformers `CLIPModel` and `CLIPProcessor` with `from_pretrained`, from a hub id
(the published defaults below) or a local directory, so tests load tiny random-weight models
saved to a temporary directory through the same code.

- `pickscore` (Kirstain et al. 2023; Flow-GRPO's scorer): CLIP-H processor + PickScore_v1,
  `logit_scale.exp() * cos(image, text) / 26`. The division by 26 is Flow-GRPO's, to bring the
  reward near 1; papers report the unscaled number (~23 for SD3.5-M), i.e. our score * 26.
- `clipscore` (Hessel et al. 2021, CLIP-S): `2.5 * max(cos(image, text), 0)`, with CLIP ViT-L/14.
- `aesthetic` (LAION aesthetic predictor v2, as in DDPO): the MLP head of
  improved-aesthetic-predictor on the L2-normalised CLIP ViT-L/14 image embedding; roughly a
  1-10 rating. The head loads from a local `.pth`/`.safetensors` file or a file on the hub.

HPSv2 and ImageReward, whose checkpoints are other module trees, are in `stepgrpo.rewards.preference`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepgrpo.images import to_pil
from stepgrpo.policy.devices import resolve_device, resolve_dtype
from stepgrpo.rewards.base import REWARDS, RewardOutput

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PICKSCORE_SCALE = 1.0 / 26.0  # Flow-GRPO's normalisation
CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
CLIPSCORE_WEIGHT = 2.5  # Hessel et al.'s w
AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "trl-lib/ddpo-aesthetic-predictor"  # hub repo (or a local file path)
AESTHETIC_HEAD_FILE = "aesthetic-model.pth"  # file inside the hub repo
BATCH_SIZE = 32


def _tag(model_id: str, default: str) -> str:
    """Version suffix: empty for the published default, else the model's last path component,
    so scores of a different checkpoint are never mixed with the default's."""
    return "" if model_id == default else f"+{Path(model_id).name}"


class ClipEmbedder:
    """L2-normalised CLIP image and text embeddings, in batches, in fp32.

    model: hub id or directory of a `CLIPModel`; processor: of its `CLIPProcessor` (default: model).
    """

    def __init__(
        self,
        model: str,
        processor: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int = BATCH_SIZE,
    ) -> None:
        from transformers import CLIPModel, CLIPProcessor

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.processor = CLIPProcessor.from_pretrained(processor or model)
        self.model = CLIPModel.from_pretrained(model, dtype=self.dtype).to(self.device).eval() if model else None
        self.batch_size = batch_size
        if self.model is not None:
            self._set_model(self.model)

    def _set_model(self, model: Any) -> None:
        self.model = model.to(self.device, self.dtype).eval()
        # the text tower has a fixed number of positions (77 for the published models)
        self.max_length = self.model.config.text_config.max_position_embeddings

    @classmethod
    def from_model(
        cls,
        model: Any,
        processor: str,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int = BATCH_SIZE,
    ) -> ClipEmbedder:
        """An embedder of an already built `CLIPModel` (converted weights), with `processor`'s `CLIPProcessor`."""
        embedder = cls("", processor, device, dtype, batch_size)
        embedder._set_model(model)
        return embedder

    @staticmethod
    def _pooled(out: Any) -> torch.Tensor:
        # transformers >= 5 returns a model output whose pooler_output is the projected feature;
        # 4.x returns the tensor itself
        return getattr(out, "pooler_output", out)

    @torch.no_grad()
    def images(self, images: torch.Tensor) -> torch.Tensor:
        """`[N, 3, H, W]` in [0, 1] -> `[N, D]` unit vectors."""
        pil = to_pil(images)
        feats = []
        for start in range(0, len(pil), self.batch_size):
            inputs = self.processor(images=pil[start : start + self.batch_size], return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.device, self.dtype)
            feats.append(self._pooled(self.model.get_image_features(pixel_values=pixels)).float())
        return nn.functional.normalize(torch.cat(feats), dim=-1)

    @torch.no_grad()
    def texts(self, prompts: Sequence[str]) -> torch.Tensor:
        """`N` strings -> `[N, D]` unit vectors (truncated to the text tower's length)."""
        feats = []
        for start in range(0, len(prompts), self.batch_size):
            inputs = self.processor.tokenizer(
                list(prompts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            out = self.model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            feats.append(self._pooled(out).float())
        return nn.functional.normalize(torch.cat(feats), dim=-1)

    def cosine(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """`[N]` cosine similarity of each image with its own prompt."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        return (self.images(images) * self.texts(prompts)).sum(-1)


class PickScore:
    """`logit_scale.exp() * cos(image, prompt) * scale` with the PickScore_v1 CLIP-H model."""

    name = "pickscore"

    def __init__(self, embedder: ClipEmbedder, scale: float, version: str) -> None:
        self.embedder = embedder
        self.scale = scale
        self.version = version

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        logit_scale = self.embedder.model.logit_scale.exp().float().cpu()
        scores = logit_scale * self.embedder.cosine(images, prompts).cpu() * self.scale
        return RewardOutput(scores=scores)


def _pickscore_identity(model: str, scale: float, **_: Any) -> tuple[str, str]:
    return "pickscore", "1" + _tag(model, PICKSCORE_MODEL) + ("" if scale == PICKSCORE_SCALE else f"+x{scale:g}")


@REWARDS.register("pickscore", identity=_pickscore_identity, hub=("model", "processor"))
def pickscore(
    model: str = PICKSCORE_MODEL,
    processor: str = PICKSCORE_PROCESSOR,
    scale: float = PICKSCORE_SCALE,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
) -> PickScore:
    """PickScore / 26 (Flow-GRPO); `scale=1` gives the number papers report."""
    _, version = _pickscore_identity(model, scale)
    return PickScore(ClipEmbedder(model, processor, device, dtype, batch_size), scale, version)


class ClipScore:
    """`weight * max(cos(image, prompt), 0)` (CLIP-S); `clip_at_zero=False` keeps negatives."""

    name = "clipscore"

    def __init__(self, embedder: ClipEmbedder, weight: float, clip_at_zero: bool, version: str) -> None:
        self.embedder = embedder
        self.weight = weight
        self.clip_at_zero = clip_at_zero
        self.version = version

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        cos = self.embedder.cosine(images, prompts).cpu()
        return RewardOutput(scores=self.weight * (cos.clamp(min=0) if self.clip_at_zero else cos))


def _clipscore_identity(model: str, weight: float, clip_at_zero: bool, **_: Any) -> tuple[str, str]:
    options = "" if (weight, clip_at_zero) == (CLIPSCORE_WEIGHT, True) else f"+w{weight:g}{'c' if clip_at_zero else ''}"
    return "clipscore", "1" + _tag(model, CLIPSCORE_MODEL) + options


@REWARDS.register("clipscore", identity=_clipscore_identity, hub=("model", "processor"))
def clipscore(
    model: str = CLIPSCORE_MODEL,
    processor: str | None = None,
    weight: float = CLIPSCORE_WEIGHT,
    clip_at_zero: bool = True,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
) -> ClipScore:
    """CLIP-S of Hessel et al. with the ViT-L/14 CLIP by default."""
    _, version = _clipscore_identity(model, weight, clip_at_zero)
    return ClipScore(ClipEmbedder(model, processor, device, dtype, batch_size), weight, clip_at_zero, version)


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP: `[N, D]` unit embedding -> `[N, 1]` rating.

    Layer indices match the published state dict (`layers.0`, `layers.2`, `layers.4`, `layers.6`,
    `layers.7`); dropout is inactive at eval.
    """

    def __init__(self, in_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def load_aesthetic_head(head: str, head_file: str, in_dim: int) -> AestheticHead:
    """`head` is a local `.pth`/`.safetensors` file, or a hub repo id holding `head_file`."""
    path = Path(head)
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(head, head_file))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    module = AestheticHead(in_dim)
    module.load_state_dict(state)
    return module.eval()


class Aesthetic:
    """LAION aesthetic rating of each image (the prompt is not used)."""

    name = "aesthetic"

    def __init__(self, embedder: ClipEmbedder, head: AestheticHead, version: str) -> None:
        self.embedder = embedder
        self.head = head.to(embedder.device)
        self.version = version

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        embeds = self.embedder.images(images)  # fp32 unit vectors, as the head was trained on
        return RewardOutput(scores=self.head(embeds).squeeze(-1).cpu())


def _aesthetic_identity(model: str, head: str, **_: Any) -> tuple[str, str]:
    return "aesthetic", "1" + _tag(model, AESTHETIC_CLIP) + _tag(head, AESTHETIC_HEAD)


@REWARDS.register("aesthetic", identity=_aesthetic_identity, hub=("model", "processor", "head"))
def aesthetic(
    model: str = AESTHETIC_CLIP,
    processor: str | None = None,
    head: str = AESTHETIC_HEAD,
    head_file: str = AESTHETIC_HEAD_FILE,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
) -> Aesthetic:
    """The DDPO aesthetic score (LAION predictor v2 on CLIP ViT-L/14)."""
    embedder = ClipEmbedder(model, processor, device, dtype, batch_size)
    in_dim = embedder.model.config.projection_dim
    _, version = _aesthetic_identity(model, head)
    return Aesthetic(embedder, load_aesthetic_head(head, head_file, in_dim), version)
