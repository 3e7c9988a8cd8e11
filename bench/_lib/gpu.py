"""What the GPU checks share: SD3.5-Medium's shape built with random weights (no download), a
random CLIPModel of PickScore's architecture, the prompts, the options every check takes, and one
`stepgrpo train` run as a user runs it.

Imports nothing heavy at module level: `bench/gpu/gpu.py` runs with torch, diffusers and peft alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, by device name
WORDS = "a photo of red blue green cat dog car tree house on the left right with and".split()


def sd35m_spec(small: bool):
    from stepgrpo.shapes.model import ModelSpec, sd35_medium_like_spec

    if small:
        return sd35_medium_like_spec()
    return ModelSpec(
        layers=24, heads=24, head_dim=64, text_dim=1024, text_layers=12, text_heads=16, projection_dim=1024,
        vae_channels=(128, 256, 512, 512), vae_groups=32, latent_channels=16, sample_size=64, patch_size=2,
        qk_norm="rms_norm", dual_attention_layers=tuple(range(13)),
    )  # fmt: skip


def build_policy(path: Path, small: bool) -> None:
    from stepgrpo.shapes.model import build_pipeline

    build_pipeline(sd35m_spec(small), seed=0).save_pretrained(str(path))


def build_reward(path: Path, small: bool) -> None:
    """A random CLIPModel of PickScore's architecture (ViT-H/14), with a CLIPProcessor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from stepgrpo.shapes.model import build_tokenizer

    tokenizer = build_tokenizer(WORDS)
    if small:
        text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=8)
        size, dim = 32, 32
    else:
        text = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
        vision = dict(
            hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120, patch_size=14
        )
        size, dim = 224, 1024
    config = CLIPConfig(
        text_config={**text, "vocab_size": len(tokenizer), "max_position_embeddings": 77},
        vision_config={**vision, "image_size": size},
        projection_dim=dim,
    )
    CLIPModel(config).save_pretrained(str(path))
    image = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    CLIPProcessor(image_processor=image, tokenizer=tokenizer).save_pretrained(str(path))


# diffusers' stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json.
SD3_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
)


# 15 distinct prompts over the tokenizer's words
PROMPTS = [f"a photo of a {c} {t}" for t in ("cat", "dog", "car", "tree", "house") for c in ("red", "blue", "green")]


def gpu_arguments(description: str, out: str, prompts: int = 4, group: int = 8) -> argparse.ArgumentParser:
    """The options every GPU check takes; `out`: its folder under bench/out."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / out)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (with --device cpu: try the script on a CPU)")
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per iteration")
    p.add_argument("--group", type=int, default=group, help="trajectories per prompt")
    return p


def device_name(device: str) -> str:
    """The device's name, refused with the fix when CUDA is asked for and torch sees none."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; use --small --device cpu to try the script")
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def prepare(args: argparse.Namespace, reward: bool = True) -> dict[str, str]:
    """Build the policy (and the reward) under `--out` once, write the prompt file, and return the
    overrides every check's runs share (model, reward, prompts, run size, no stored images)."""
    args.out.mkdir(parents=True, exist_ok=True)
    model, scorer = args.out / "policy", args.out / "reward"
    if not (model / "model_index.json").is_file():
        build_policy(model, args.small)
    if reward and not (scorer / "config.json").is_file():
        build_reward(scorer, args.small)
    if args.prompts > len(PROMPTS):
        raise SystemExit(f"--prompts {args.prompts}: at most {len(PROMPTS)} distinct prompts are built here")
    prompts = args.out / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sets = {
        "model.path": str(model), "model.device": args.device, "model.dtype": dtype_of(args.device),
        "model.resolution": "null", "run.prompts": str(prompts), "run.heldout_prompts": str(prompts),
        "run.prompts_per_iteration": str(args.prompts), "run.group_size": str(args.group),
        "run.runs_root": str(args.out / "runs"), "storage.images": "false",
    }  # fmt: skip
    if reward:
        sets["reward.options"] = json.dumps({"model": str(scorer), "processor": str(scorer)})
    return sets


def dtype_of(device: str) -> str:
    return "float32" if device == "cpu" else "bfloat16"


def train(recipe: str | Path, sets: dict[str, str], out: Path, name: str) -> tuple[Path, float]:
    """`stepgrpo train --config recipe` with `sets` (its log `out/<name>.log`): the run directory
    and the command's wall seconds; a failure stops the check with the log's tail."""
    run_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "stepgrpo_cli", "train", "--config", str(recipe), "--run-id", run_id]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log = out / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"stepgrpo train ({name}) failed (log: {log}):\n{proc.stderr[-3000:]}")
    return Path(sets["run.runs_root"]) / run_id, seconds


def write_report(out: Path, results: dict[str, Any], lines: list[str]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
