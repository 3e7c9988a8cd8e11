"""Build a random-weight Stable Diffusion 3 pipeline from configs (the `shapes` model's skeleton).

Every component is a stock diffusers / transformers class, so the result is an ordinary
`StableDiffusion3Pipeline` directory once saved:

- `AutoencoderKL`: images `[N, 3, 32, 32]` in [-1, 1] <-> latents `[N, 4, 8, 8]` (3 blocks, so the
  pipeline's `vae_scale_factor` is 4);
- `SD3Transformer2DModel` with patch 2 on the 8x8 latents (16 image tokens);
- two small `CLIPTextModelWithProjection` encoders with `CLIPTokenizer`s whose vocabulary is the
  shapes grammar's words, one token per word (a BPE trainer run over the words; a hand-written
  merge list would split words by merge priority);
- no T5 (`text_encoder_3=None`): sample with `max_sequence_length=0`, which makes the T5 part of
  the context zero tokens long. The pipeline's default (256) would append 256 zero rows that the
  model never saw in training;
- `FlowMatchEulerDiscreteScheduler(shift=3.0)`.

`tiny_spec()` is a variant that builds in well under a second, for tests of other modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")
MAX_TOKENS = 16  # CLIP context length: the longest prompt is 8 words + 2 special tokens


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the pipeline's components."""

    layers: int = 6  # transformer blocks
    heads: int = 4  # attention heads; transformer width = heads * head_dim
    head_dim: int = 32
    text_dim: int = 64  # hidden size of each CLIP text encoder
    text_layers: int = 3  # CLIP layers; SD3 reads the penultimate layer's hidden states
    text_heads: int = 4
    projection_dim: int = 64  # each CLIP's pooled projection; the transformer gets both concatenated
    vae_channels: tuple[int, ...] = (32, 64, 64)  # 3 blocks -> 32x32 images to 8x8 latents
    vae_groups: int = 32  # GroupNorm groups; must divide every entry of `vae_channels`
    latent_channels: int = 4
    sample_size: int = 8  # latent side
    patch_size: int = 2
    shift: float = 3.0  # scheduler's sigma shift (SD3's default)
    qk_norm: str | None = None  # SD3.5: "rms_norm" on queries and keys
    dual_attention_layers: tuple[int, ...] = ()  # SD3.5-M (MMDiT-X): blocks with a second image self-attention

    def __post_init__(self) -> None:
        if any(c % self.vae_groups for c in self.vae_channels):
            raise ValueError(f"vae_groups={self.vae_groups} must divide every vae_channels {self.vae_channels}")
        if self.sample_size % self.patch_size:
            raise ValueError(f"sample_size={self.sample_size} must be a multiple of patch_size={self.patch_size}")
        if self.text_dim % self.text_heads:
            raise ValueError(f"text_dim={self.text_dim} must be a multiple of text_heads={self.text_heads}")

    @property
    def image_size(self) -> int:
        """Pixel side: the VAE halves the side once per block after the first."""
        return self.sample_size * 2 ** (len(self.vae_channels) - 1)


def tiny_spec() -> ModelSpec:
    """A very small spec (random weights build in well under a second): for tests, not quality."""
    return ModelSpec(
        layers=2,
        heads=2,
        head_dim=16,
        text_dim=16,
        text_layers=2,
        text_heads=2,
        projection_dim=16,
        vae_channels=(8, 16, 16),
        vae_groups=8,
    )


def sd35_medium_like_spec() -> ModelSpec:
    """`tiny_spec` in SD3.5-Medium's architecture: 16 latent channels, RMS norm on queries and
    keys, and MMDiT-X's dual-attention blocks (SD3.5-M: the first 13 of 24; here the first of 2);
    the two CLIP encoders, no T5. For tests and benchmarks of the paper recipes' code paths."""
    base = tiny_spec()
    return ModelSpec(**{**base.__dict__, "latent_channels": 16, "qk_norm": "rms_norm", "dual_attention_layers": (0,)})


def build_tokenizer(words: Sequence[str]):
    """A `CLIPTokenizer` in which every word of `words` is a single token.

    The merges are learned like BPE training, deterministically: repeatedly merge the most
    frequent adjacent pair over the words (ties broken by the pair's text) until every word is one
    piece, with CLIP's `</w>` end-of-word suffix on each word's last letter. Ids are assigned in a
    fixed order (special tokens, the byte-level alphabet, then the merges), so the same words
    always give the same tokenizer. (A `tokenizers` BPE trainer breaks ties in hash order, so its
    ids change from run to run; a hand-written left-to-right merge list lets one word's merge,
    e.g. "r e" from "red", split another, "three".)
    """
    from collections import Counter

    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    words = sorted({w.lower() for w in words})
    if not words or not all(w.isalpha() and w.isascii() for w in words):
        raise ValueError(f"build_tokenizer needs a non-empty list of ASCII words, got {words!r}")
    vocab: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    seqs = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in seqs):
        counts = Counter(pair for s in seqs for pair in zip(s, s[1:]))
        best = max(counts, key=lambda pair: (counts[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for k, s in enumerate(seqs):
            out: list[str] = []
            i = 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[k] = out
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)
    for w in words:
        ids = tok(w, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise RuntimeError(f"word {w!r} tokenized into {len(ids)} tokens: two words' merge chains conflict")
    return tok


def _text_encoder(spec: ModelSpec, tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_dim,
        intermediate_size=4 * spec.text_dim,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=spec.projection_dim,
        hidden_act="gelu",
        # the pooled output is read at the first end-of-text token: these ids must be the tokenizer's
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def build_pipeline(spec: ModelSpec | None = None, words: Sequence[str] | None = None, seed: int = 0):
    """A `StableDiffusion3Pipeline` with random weights, fp32, on the CPU.

    spec: component sizes (default `ModelSpec()`, the shipped model's).
    words: tokenizer vocabulary (default: the shapes grammar's words).
    seed: seeds the weight initialisation (the same seed gives the same weights).
    Sample with `pipe(prompts, height=spec.image_size, width=spec.image_size, max_sequence_length=0)`.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    spec = spec or ModelSpec()
    if words is None:
        from stepgrpo.shapes.data import vocabulary

        words = vocabulary()
    tokenizer = build_tokenizer(words)
    tokenizer_2 = build_tokenizer(words)
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        text_encoder = _text_encoder(spec, tokenizer)
        text_encoder_2 = _text_encoder(spec, tokenizer_2)
        width = spec.heads * spec.head_dim
        transformer = SD3Transformer2DModel(
            sample_size=spec.sample_size,
            patch_size=spec.patch_size,
            in_channels=spec.latent_channels,
            out_channels=spec.latent_channels,
            num_layers=spec.layers,
            attention_head_dim=spec.head_dim,
            num_attention_heads=spec.heads,
            # the pipeline concatenates both CLIPs' hidden states along features (and pads to this)
            joint_attention_dim=2 * spec.text_dim,
            caption_projection_dim=width,
            pooled_projection_dim=2 * spec.projection_dim,
            pos_embed_max_size=spec.sample_size // spec.patch_size,
            qk_norm=spec.qk_norm,
            dual_attention_layers=spec.dual_attention_layers,
        )
        n = len(spec.vae_channels)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=tuple(spec.vae_channels),
            layers_per_block=1,
            latent_channels=spec.latent_channels,
            norm_num_groups=spec.vae_groups,
            sample_size=spec.image_size,
            # SD3's VAE has no 1x1 quant convs; set from latent statistics after training
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=1.0,
            shift_factor=0.0,
        )
    finally:
        torch.random.set_rng_state(rng_state)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.shift)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def load_pipeline(path: str, dtype: torch.dtype = torch.float32):
    """Load a saved shapes pipeline directory (e.g. `models/shapes`) as a `StableDiffusion3Pipeline`.

    diffusers refuses a directory whose `model_index.json` lists no T5 unless the missing
    components are passed explicitly, hence `text_encoder_3=None, tokenizer_3=None`.
    """
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None, dtype=dtype)


def tiny_flux_pipeline(seed: int = 0):
    """A `FluxPipeline` with random weights, fp32, on the CPU (tests): one double- and one
    single-stream block, a guidance embedding, tiny CLIP and T5 encoders sharing a letter vocabulary,
    a 2x VAE with Flux's scaling and shift, Flux's dynamically shifted scheduler."""
    import string

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    words = ["<|startoftext|>"] + list(string.ascii_lowercase) + [c + "</w>" for c in string.ascii_lowercase]
    words.append("<|endoftext|>")
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(words)}, merges=[], model_max_length=16)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=len(words) - 1, projection_dim=32,
        )
    )  # fmt: skip
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(words), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
        scaling_factor=0.3611, shift_factor=0.1159,
    )  # fmt: skip
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
        max_shift=1.15,
    )  # fmt: skip
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer, text_encoder_2=t5,
        tokenizer_2=tokenizer, transformer=transformer,
    )  # fmt: skip
