"""The memory each GPU needs for the update's states (`stepgrpo.runtime.memory`), for SD3.5-M,
SD3.5-L and FLUX.1-dev, LoRA and full fine-tuning, on 1 / 2 / 4 / 8 / 16 GPUs: the table of
docs/SCALING.md ("Sharded update"), printed as Markdown.

The transformers' parameter counts come from building each architecture's published config on
PyTorch's meta device (no weights, no download); the text encoders and VAE from their published
sizes (CLIP-L 123M, OpenCLIP bigG 695M, T5-XXL encoder 4.76B, VAE 84M). bf16 weights, as the GPU
recipes train; AdamW's moments in the parameter's dtype (torch's AdamW). 1 GPU: the unsharded
update; 2-16: `scale.update_sharding: fsdp` over that many ranks.

    python -m bench.scale.memory_table
"""

from __future__ import annotations

from stepgrpo.runtime.memory import GIB, ModelCounts, transformer_counts, update_states

CLIP_L, CLIP_G, T5_XXL, VAE = 123_000_000, 695_000_000, 4_760_000_000, 84_000_000
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
MODELS = {
    "SD3.5-M": (
        {
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)),
            "qk_norm": "rms_norm",
        },
        CLIP_L + CLIP_G + T5_XXL + VAE,
    ),
    "SD3.5-L": (
        {
            "_class_name": "SD3Transformer2DModel",
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 38,
            "attention_head_dim": 64,
            "num_attention_heads": 38,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 2432,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 192,
            "qk_norm": "rms_norm",
        },
        CLIP_L + CLIP_G + T5_XXL + VAE,
    ),
    "FLUX.1-dev": (
        {
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        },
        CLIP_L + T5_XXL + VAE,
    ),
}
GPUS = (1, 2, 4, 8, 16)
# (label, full fine-tuning, EMA, companion, offload)
SETUPS = [
    ("LoRA r32, GRPO", False, False, False, False),
    ("LoRA r32, + EMA + companion (nft / awm)", False, True, True, False),
    ("full, GRPO (reference copy)", True, False, False, False),
    ("full, + EMA + companion", True, True, True, False),
    ("full, + EMA + companion, offload", True, True, True, True),
]


def table() -> str:
    lines = []
    for name, (config, encoders) in MODELS.items():
        P, block, lora = transformer_counts(config, 32, TARGETS)
        counts = ModelCounts(P, block, lora, encoders)
        lines += [
            f"**{name}**: transformer {P / 1e9:.2f}B parameters (largest block {block / 1e6:.0f}M), LoRA r32 "
            f"{lora / 1e6:.1f}M, text encoders + VAE {encoders / 1e9:.2f}B",
            "",
            "| GiB per GPU | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in GPUS) + " |",
            "|---|" + "---|" * len(GPUS),
        ]
        for label, full, ema, companion, offload in SETUPS:
            cells = []
            for g in GPUS:
                if offload and g == 1:
                    cells.append("n/a")
                    continue
                s = update_states(
                    counts,
                    dtype="bfloat16",
                    full=full,
                    shards=g,
                    offload=offload,
                    ema=ema,
                    companion=companion,
                    signal=False,
                )
                cells.append(f"{sum(s['device'].values()) / GIB:.1f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
