"""Disk per iteration of each shipped recipe, from the storage schema (docs/GPU.md's table).

    python -m bench.storage.disk [--model sd35m|shapes] [--check RUN_DIR]

A stage's bytes follow from its arrays (`stepgrpo.storage.schema`): every per-trajectory chunk is the raw
array bytes plus a 4-byte checksum, latents in the dtype they were sampled in. The paper recipes
run SD3.5-Medium (16 latent channels, 1/8 of the image side); its LoRA's size is counted on
SD3.5-Medium's transformer built on the meta device (no weights), with the recipe's rank and
targets. A checkpoint holds, in fp32, the LoRA, AdamW's two moments, with `optim.ema_decay` the
EMA, and with `optim.diagnostics` the signal check's two gradient sums. `--check RUN_DIR` compares
the formula with what a stored run's iteration 0 occupies.
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from stepgrpo.config import Config, load_config  # noqa: E402

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CHECKSUM = 4
# SD3.5-Medium's transformer (its published config): 24 MMDiT-X blocks of width 1536, the first 13
# with a second image self-attention, RMS-normed queries and keys.
SD35M = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip


def lora_parameters(cfg: Config, transformer: dict | None = None) -> int:
    """LoRA parameters of `cfg` on a transformer built from its config (SD3.5-Medium's by default)
    on the meta device: nothing allocated."""
    import torch
    from diffusers import SD3Transformer2DModel

    from stepgrpo.policy.lora import LoraSpec, add_lora

    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(transformer or SD35M)
        add_lora(model, LoraSpec(cfg.model.lora_rank, cfg.model.lora_alpha, tuple(cfg.model.lora_targets)))
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def per_iteration(cfg: Config, latent: tuple[int, int, int], image: int, lora: int) -> dict[str, int]:
    """Bytes a finished iteration stores, by stage (`storage.keep: all`)."""
    B, T = cfg.run.prompts_per_iteration * cfg.run.group_size, cfg.sampler.steps
    lat = DTYPE_BYTES[cfg.model.dtype] * latent[0] * latent[1] * latent[2]
    rollout = B * ((T + 1) * lat + CHECKSUM) + B * (lat + CHECKSUM) + 2 * B * (4 * T + CHECKSUM)
    out = {"rollout": rollout}
    _, end = cfg.sampler.window()
    if cfg.completion.method:
        out["completion"] = B * ((T + 1) * lat + CHECKSUM)
        scored = min(end, T) + 1  # the states before the deterministic tail, and x_T
    else:
        scored = 2  # the ODE sample of x_0 and x_T
    if cfg.storage.images:
        out["images"] = B * (scored * 3 * image * image + CHECKSUM)
    # the LoRA, AdamW's two moments, the EMA, and the signal check's two gradient sums (diagnostics)
    copies = 1 + 2 + (1 if cfg.optim.ema_decay is not None else 0) + (2 if cfg.optim.diagnostics else 0)
    out["checkpoint"] = 4 * lora * copies
    return out


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.name.endswith(".json"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", type=Path, help="a stored run: compare its iteration 0 with the formula")
    args = p.parse_args()
    if args.check:
        import json

        from stepgrpo.storage.run import Run
        from stepgrpo.storage.schema import completion_stage

        run = Run.open(args.check)
        cfg = Config.model_validate(run.config)
        attrs = run.stage_manifest(0, "rollout")["attrs"]
        latent = (attrs["C"], attrs["H"], attrs["W"])
        ckpt = run.stage_path(0, "checkpoint")
        from safetensors.torch import load_file

        lora = sum(t.numel() for t in load_file(str(ckpt / "lora.safetensors")).values())
        source = completion_stage(cfg.completion.method)
        images = run.stage_path(0, run.stages.images_stage(source))
        side = json.loads((images / "images" / "zarr.json").read_text())["shape"][-1] if images.exists() else 0
        formula = per_iteration(cfg, latent, side, lora)
        stored = {"rollout": du(run.stage_path(0, "rollout")), "checkpoint": du(ckpt)}
        if cfg.completion.method:
            stored["completion"] = du(run.stage_path(0, completion_stage(cfg.completion.method)))
        if images.exists():
            stored["images"] = du(images)
        for k in formula:
            print(f"{k:11s} formula {formula[k]:>12,d} B   stored {stored.get(k, 0):>12,d} B")
        return
    rows = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = load_config(path)
        if cfg.model.path == "models/shapes":
            latent, image = (4, 8, 8), 32
        else:
            side = cfg.model.resolution or 1024
            latent, image = (16, side // 8, side // 8), side
        lora = _shapes_lora(cfg) if cfg.model.path == "models/shapes" else lora_parameters(cfg)
        b = per_iteration(cfg, latent, image, lora)
        rows.append((path.name, cfg, b))
    print("| recipe | trajectories | latents (rollout + completion) | images | checkpoint | total / iteration |")
    print("|---|---|---|---|---|---|")
    for name, cfg, b in rows:
        B = cfg.run.prompts_per_iteration * cfg.run.group_size
        lat = b["rollout"] + b.get("completion", 0)
        total = sum(b.values())
        print(f"| {name} | {B} | {_h(lat)} | {_h(b.get('images', 0))} | {_h(b['checkpoint'])} | {_h(total)} |")


def _shapes_lora(cfg: Config) -> int:
    """LoRA parameters of `cfg` on the shipped shapes model's transformer."""
    import json

    return lora_parameters(cfg, json.loads((REPO / "models" / "shapes" / "transformer" / "config.json").read_text()))


def _h(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    main()
