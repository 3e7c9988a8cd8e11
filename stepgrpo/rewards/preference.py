"""Human-preference rewards from their published checkpoints: `hpsv2` (HPSv2 / HPSv2.1) and `imagereward`.

Both checkpoints are torch state dicts of their authors' own module trees. They are loaded here
into transformers' classes by renaming every key, and the load is strict both ways: every weight
of the transformers model must come from the checkpoint, and every checkpoint key the model
needs must be used, so a checkpoint in another layout fails with the keys that did not match
instead of giving plausible wrong numbers. `torch.load(weights_only=True)` reads them: no code
in a checkpoint runs.

- `hpsv2` (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences; the score is
  the cosine of the image and prompt features (HPSv2's `score`, ~0.25-0.30 for good images).
  The open_clip state dict (`visual.*`, `transformer.*`, `token_embedding`, ...) becomes a
  transformers `CLIPModel` whose architecture and processor (tokenizer, 224 px bicubic resize and
  center crop, OpenAI mean / std: open_clip's eval transform) come from the base model's
  transformers repository, `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`. The conversion is checked
  against open_clip's own model code in `tests/test_preference_rewards.py`.
- `imagereward` (Xu et al. 2023): BLIP's ViT-L/16 image encoder and its cross-attention BERT, the
  text encoder's `[CLS]` state through an MLP, standardized with the published mean and std. The
  original BLIP modules (`blip.visual_encoder`, `blip.text_encoder`) become transformers'
  `BlipVisionModel` and `BlipTextModel` (transformers' port of the same BLIP code; the renaming is
  the one of transformers' BLIP conversion script). The prompt is BERT-tokenized to 35 tokens with
  BLIP's two added tokens, the image resized and cropped to 224 px as ImageReward does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepgrpo.policy.devices import resolve_device, resolve_dtype
from stepgrpo.rewards.base import REWARDS, RewardOutput
from stepgrpo.rewards.clip_models import BATCH_SIZE, ClipEmbedder, _tag

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
HPS_BASE = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # ViT-H-14 in transformers' format: config and processor

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
IMAGEREWARD_TOKENIZER = "bert-base-uncased"
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.py
IMAGEREWARD_MAX_LENGTH = 35


class CheckpointMismatch(ValueError):
    """A checkpoint whose keys are not the layout a converter expects."""


def load_state_dict(source: str, filename: str) -> dict[str, torch.Tensor]:
    """A torch state dict from a local file, or `filename` of a hub repo `source`; tensors only
    (`weights_only`), unwrapped from `{"state_dict": ...}` and from a `module.` prefix."""
    path = Path(source).expanduser()
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(source, filename))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise CheckpointMismatch(f"{path}: not a state dict (got {type(state).__name__})")
    return {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_strict(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """`model.load_state_dict(state)` that names the keys on either side that do not match."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:
        raise CheckpointMismatch(
            f"{what}: the checkpoint does not fit the model (missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"shape differs {sorted(shapes)[:4]}); is it the published checkpoint?"
        )
    model.load_state_dict(dict(state), strict=True)


# ------------------------------------------------------------------ HPSv2: open_clip -> CLIPModel


def open_clip_to_transformers(state: Mapping[str, torch.Tensor], vision_layers: int, text_layers: int) -> dict:
    """An open_clip CLIP state dict (ViT image tower, text transformer) in `CLIPModel`'s names."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise CheckpointMismatch(f"open_clip checkpoint: no {key!r}; is it an open_clip ViT CLIP state dict?")
        used.add(key)
        return state[key]

    def tower(src: str, dst: str, layers: int) -> None:
        for i in range(layers):
            s, d = f"{src}.resblocks.{i}", f"{dst}.layers.{i}"
            q, k, v = take(f"{s}.attn.in_proj_weight").chunk(3)
            qb, kb, vb = take(f"{s}.attn.in_proj_bias").chunk(3)
            for name, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
                out[f"{d}.self_attn.{name}_proj.weight"], out[f"{d}.self_attn.{name}_proj.bias"] = w, b
            for a, b_ in (
                ("attn.out_proj", "self_attn.out_proj"),
                ("ln_1", "layer_norm1"),
                ("ln_2", "layer_norm2"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
            ):
                for p in ("weight", "bias"):
                    out[f"{d}.{b_}.{p}"] = take(f"{s}.{a}.{p}")

    v, t = "vision_model", "text_model"
    out[f"{v}.embeddings.class_embedding"] = take("visual.class_embedding")
    out[f"{v}.embeddings.patch_embedding.weight"] = take("visual.conv1.weight")
    out[f"{v}.embeddings.position_embedding.weight"] = take("visual.positional_embedding")
    for a, b in (("visual.ln_pre", f"{v}.pre_layrnorm"), ("visual.ln_post", f"{v}.post_layernorm")):
        for p in ("weight", "bias"):
            out[f"{b}.{p}"] = take(f"{a}.{p}")
    tower("visual.transformer", f"{v}.encoder", vision_layers)
    out["visual_projection.weight"] = take("visual.proj").t().contiguous()
    out[f"{t}.embeddings.token_embedding.weight"] = take("token_embedding.weight")
    out[f"{t}.embeddings.position_embedding.weight"] = take("positional_embedding")
    for p in ("weight", "bias"):
        out[f"{t}.final_layer_norm.{p}"] = take(f"ln_final.{p}")
    tower("transformer", f"{t}.encoder", text_layers)
    out["text_projection.weight"] = take("text_projection").t().contiguous()
    out["logit_scale"] = take("logit_scale").reshape(())
    left = sorted(set(state) - used - {"attn_mask", "visual.attn_mask"})
    if left:
        raise CheckpointMismatch(f"open_clip checkpoint: keys this converter does not know: {left[:4]}")
    return out


def load_hps_model(checkpoint: str, filename: str, base: str, dtype: torch.dtype) -> Any:
    """HPSv2's `CLIPModel`: the architecture of `base` (a transformers CLIP repo), the weights of `checkpoint`."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig.from_pretrained(base)
    state = open_clip_to_transformers(
        load_state_dict(checkpoint, filename),
        config.vision_config.num_hidden_layers,
        config.text_config.num_hidden_layers,
    )
    model = CLIPModel(config)
    load_strict(model, state, f"HPSv2 checkpoint {checkpoint}")
    return model.to(dtype).eval()


class HPSv2:
    """Cosine of image and prompt features under the HPSv2(.1) CLIP."""

    name = "hpsv2"

    def __init__(self, embedder: ClipEmbedder, version: str) -> None:
        self.embedder, self.version = embedder, version

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        return RewardOutput(scores=self.embedder.cosine(images, prompts).cpu())


def _hps_identity(variant: str, checkpoint: str, base: str, **_: Any) -> tuple[str, str]:
    if variant not in HPS_FILES:
        raise ValueError(f"hpsv2: variant {variant!r} is not one of {sorted(HPS_FILES)}")
    return "hpsv2", f"1+{variant}" + _tag(checkpoint, HPS_REPO) + _tag(base, HPS_BASE)


@REWARDS.register("hpsv2", identity=_hps_identity, hub=("checkpoint", "base"))
def hpsv2(
    variant: str = "v2.1",
    checkpoint: str = HPS_REPO,
    base: str = HPS_BASE,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
) -> HPSv2:
    """HPSv2.1 (`variant: v2.0` for HPSv2); `checkpoint`: the hub repo or a local `.pt` file."""
    _, version = _hps_identity(variant, checkpoint, base)
    dev = resolve_device(device)
    model = load_hps_model(checkpoint, HPS_FILES[variant], base, resolve_dtype(dtype, dev))
    return HPSv2(ClipEmbedder.from_model(model, base, device, dtype, batch_size), version)


# ------------------------------------------------------------------ ImageReward: BLIP -> transformers

VISION_RENAMES = (  # BLIP's ViT -> BlipVisionModel (transformers' convert_blip_original_pytorch_to_hf)
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^norm\.", "post_layernorm."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
)


def blip_vision_key(key: str) -> str:
    for pattern, repl in VISION_RENAMES:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    return key


class ImageRewardModel(nn.Module):
    """BLIP's image encoder, its image-grounded text encoder, and ImageReward's MLP head."""

    def __init__(self, vision: Any, text: Any) -> None:
        from transformers import BlipTextModel, BlipVisionModel

        from stepgrpo.rewards.clip_models import AestheticHead

        super().__init__()
        self.vision = BlipVisionModel(vision)
        self.text = BlipTextModel(text, add_pooling_layer=False)
        self.mlp = AestheticHead(text.hidden_size)  # the same five-layer MLP as LAION's predictor

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        image = self.vision(pixel_values=pixel_values).last_hidden_state
        out = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image,
            encoder_attention_mask=torch.ones(image.shape[:-1], dtype=torch.long, device=image.device),
            is_decoder=False,  # ImageReward's mode: bidirectional self-attention, cross-attention to the image
        )
        raw = self.mlp(out.last_hidden_state[:, 0, :].float()).squeeze(-1)
        return (raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def imagereward_configs(vocab_size: int = 30524) -> tuple[Any, Any]:
    """ImageReward's BLIP: ViT-L/16 at 224 px (`vit='large'`), BERT-base with cross-attention to it."""
    from transformers import BlipTextConfig, BlipVisionConfig

    vision = BlipVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=224,
        patch_size=16,
        layer_norm_eps=1e-6,  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
        hidden_act="gelu",
    )
    text = BlipTextConfig(
        vocab_size=vocab_size,
        hidden_size=768,
        encoder_hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=512,
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        is_decoder=True,  # transformers builds the cross-attention layers only for a "decoder"
    )
    return vision, text


def imagereward_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward's checkpoint (`blip.visual_encoder.*`, `blip.text_encoder.*`, `mlp.*`) in
    `ImageRewardModel`'s names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            out["vision." + blip_vision_key(key.removeprefix("blip.visual_encoder."))] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            out[key] = value
    # the rest (BLIP's projections, ITM head, momentum encoders) is not part of the score
    return out


class ImageReward:
    """ImageReward's standardized preference score of each image for its prompt."""

    name = "imagereward"

    def __init__(
        self,
        model: ImageRewardModel,
        tokenizer: Any,
        processor: Any,
        device: torch.device,
        dtype: torch.dtype,
        batch_size: int,
        version: str,
    ) -> None:
        self.model, self.tokenizer, self.processor = model.to(device, dtype).eval(), tokenizer, processor
        self.model.mlp.float()
        self.device, self.dtype, self.batch_size, self.version = device, dtype, batch_size, version

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        from stepgrpo.images import to_pil

        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        pil, scores = to_pil(images), []
        for s in range(0, len(pil), self.batch_size):
            pixels = self.processor(images=pil[s : s + self.batch_size], return_tensors="pt")["pixel_values"]
            text = self.tokenizer(
                list(prompts[s : s + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=IMAGEREWARD_MAX_LENGTH,
                return_tensors="pt",
            )
            scores.append(
                self.model(
                    pixels.to(self.device, self.dtype),
                    text["input_ids"].to(self.device),
                    text["attention_mask"].to(self.device),
                )
                .float()
                .cpu()
            )
        return RewardOutput(scores=torch.cat(scores))


def blip_tokenizer(source: str) -> Any:
    """BLIP's tokenizer: BERT's, with `[DEC]` as its bos token and `[ENC]` added (BLIP's `init_tokenizer`)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def clip_eval_transform(size: int = 224) -> Any:
    """Resize the shorter side to `size` (bicubic), center-crop, OpenAI CLIP mean / std: ImageReward's `_transform`."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def _imagereward_identity(checkpoint: str, tokenizer: str, **_: Any) -> tuple[str, str]:
    return "imagereward", "1" + _tag(checkpoint, IMAGEREWARD_REPO) + _tag(tokenizer, IMAGEREWARD_TOKENIZER)


@REWARDS.register("imagereward", identity=_imagereward_identity, hub=("checkpoint", "tokenizer"))
def imagereward(
    checkpoint: str = IMAGEREWARD_REPO,
    tokenizer: str = IMAGEREWARD_TOKENIZER,
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = BATCH_SIZE,
    architecture: Mapping[str, Any] | None = None,
) -> ImageReward:
    """ImageReward v1.0; `checkpoint`: the hub repo (its `ImageReward.pt`) or a local file.
    `architecture` (`{"vision": {...}, "text": {...}}` config overrides) is for tests' tiny models."""
    from transformers import BlipTextConfig, BlipVisionConfig

    _, version = _imagereward_identity(checkpoint, tokenizer)
    tok = blip_tokenizer(tokenizer)
    vision, text = imagereward_configs(len(tok))
    if architecture:
        vision = BlipVisionConfig(**{**vision.to_dict(), **architecture.get("vision", {})})
        text = BlipTextConfig(**{**text.to_dict(), **architecture.get("text", {})})
    model = ImageRewardModel(vision, text)
    load_strict(
        model, imagereward_state(load_state_dict(checkpoint, IMAGEREWARD_FILE)), f"ImageReward checkpoint {checkpoint}"
    )
    dev = resolve_device(device)
    return ImageReward(
        model, tok, clip_eval_transform(vision.image_size), dev, resolve_dtype(dtype, dev), batch_size, version
    )
