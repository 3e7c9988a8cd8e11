"""One end-to-end `stepgrpo train` iteration at SD3.5-Medium's shape: each stage's seconds, peak GPU
memory and MFU.

    python bench/gpu/gpu_train.py [--recipe configs/flow_grpo_pickscore.yaml] [--out bench/out/gpu_train]
    python bench/gpu/gpu_train.py --small --device cpu          # every code path at toy sizes, on a CPU

What runs is the shipped command, `stepgrpo train --config <recipe>`, for one iteration (with its
base and final evaluations), on random weights built here (no download):

- the policy: a StableDiffusion3Pipeline directory of SD3.5-Medium's transformer shape, 24
  MMDiT-X blocks of width 1536 (24 heads x 64), the first 13 with dual attention, RMS-normed
  queries and keys, 16 latent channels, 512 px (64 x 64 latents); SD3's VAE channels; two CLIP
  text encoders (no T5, so 16 text tokens instead of SD3.5's 333: the 1024 image tokens dominate);
- the reward: `pickscore` on a random CLIPModel of PickScore's architecture (ViT-H/14 vision
  tower, 1024-wide text tower), with its processor;
- the recipe's sampler, completion, credit and optimizer; `--prompts` x `--group` trajectories.

Per stage it reads what the run logged to MLflow (`seconds/<stage>`, `memory/<stage>_gib`, the
NFEs) and derives the MFU: the stage's transformer FLOPs (FLOPs of one transformer row counted by
torch's FlopCounterMode on this model, times its rows; an update row costs its forward, a
backward of twice that for the rows with a gradient, and the KL reference's forward) over its
seconds times the device's dense bf16 peak (`--peak-tflops`; known for H100/H200/A100). Output:
`results.json` and `report.txt` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, by device name
WORDS = "a photo of red blue green cat dog car tree house on the left right with and".split()
STAGES = ("rollout", "complete", "score", "credit", "update")


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


def row_flops(model_dir: Path, device: str, dtype: str) -> float:
    """FLOPs of one transformer row (one latent, one conditioning) of the built policy."""
    import torch
    from diffusers import SD3Transformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    t = SD3Transformer2DModel.from_pretrained(str(model_dir / "transformer"), torch_dtype=getattr(torch, dtype))
    t = t.to(device).eval()
    c = t.config
    side = c.sample_size
    x = torch.randn(1, c.in_channels, side, side, device=device, dtype=t.dtype)
    ctx = torch.randn(1, 16, c.joint_attention_dim, device=device, dtype=t.dtype)  # 16 CLIP tokens
    pooled = torch.randn(1, c.pooled_projection_dim, device=device, dtype=t.dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        t(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=torch.ones(1, device=device))
    return float(counter.get_total_flops())


def mlflow_numbers(run_dir: Path) -> dict[str, float]:
    from stepgrpo.reporting.tracking import find_mlflow_run

    client, run = find_mlflow_run(run_dir)
    if run is None:
        raise SystemExit(f"no MLflow run for {run_dir}")
    out = {}
    for key in run.data.metrics:
        history = [m for m in client.get_metric_history(run.info.run_id, key) if m.step == 0]
        if history:
            out[key] = history[-1].value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=REPO / "configs" / "flow_grpo_pickscore.yaml")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_train")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (with --device cpu: try the script on a CPU)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    p.add_argument("--group", type=int, default=8, help="trajectories per prompt")
    p.add_argument("--peak-tflops", type=float, default=None, help="device's dense bf16 peak (default: by name)")
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; use --small --device cpu to try the script")
    args.out.mkdir(parents=True, exist_ok=True)
    model, reward = args.out / "policy", args.out / "reward"
    t0 = time.perf_counter()
    if not (model / "model_index.json").is_file():
        build_policy(model, args.small)
    if not (reward / "config.json").is_file():
        build_reward(reward, args.small)
    built_s = time.perf_counter() - t0
    prompts = args.out / "prompts.txt"
    colours, things = ("red", "blue", "green"), ("cat", "dog", "car", "tree", "house")
    lines = [f"a photo of a {c} {t}" for t in things for c in colours]  # 15 distinct prompts
    if args.prompts > len(lines):
        raise SystemExit(f"--prompts {args.prompts}: at most {len(lines)} distinct prompts are built here")
    prompts.write_text("\n".join(lines) + "\n")
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    sets = {
        "model.path": str(model), "model.device": args.device, "model.dtype": dtype, "model.resolution": "null",
        "reward.options": json.dumps({"model": str(reward), "processor": str(reward)}),
        "run.prompts": str(prompts), "run.heldout_prompts": str(prompts), "run.iterations": "1",
        "run.prompts_per_iteration": str(args.prompts), "run.group_size": str(args.group), "run.eval_prompts": "3",
        "run.runs_root": str(args.out / "runs"), "optim.optimizer_steps": "1", "storage.images": "false",
    }  # fmt: skip
    if args.small:  # trying the script: the evaluations' ODE sampling cut to 4 steps of 1 prompt
        sets |= {"sampler.eval_steps": "4", "run.eval_prompts": "1"}
    run_id = f"e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "stepgrpo_cli", "train", "--config", str(args.recipe), "--run-id", run_id]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    train_s = time.perf_counter() - t0
    (args.out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"stepgrpo train failed (log: {args.out / 'train.log'}):\n{proc.stderr[-3000:]}")
    metrics = mlflow_numbers(args.out / "runs" / run_id)
    from stepgrpo.config import load_config

    cfg = load_config(args.recipe, [f"{k}={v}" for k, v in sets.items()])
    flops = row_flops(model, args.device, dtype)
    rows_per_nfe = 2 if cfg.model.guidance_scale > 1 else 1
    B = args.prompts * args.group
    graded = B * len(cfg.trained_steps())  # conditional rows with a gradient (the unconditional is detached)
    stage_flops = {
        "rollout": (metrics.get("nfe/rollout", 0) + metrics.get("nfe/ode_reference", 0)) * rows_per_nfe * flops,
        "complete": metrics.get("nfe/complete", 0) * rows_per_nfe * flops,
    }
    update_nfe = json.loads((args.out / "runs" / run_id / "checkpoints" / "iter_0" / "_published.json").read_text())[
        "inputs"
    ].get("nfe", 0)
    stage_flops["update"] = update_nfe * rows_per_nfe * flops + 2 * graded * flops
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    stages = {}
    for s in STAGES:
        seconds = metrics.get(f"seconds/{s}")
        mfu = None
        if s in stage_flops and seconds and peak:
            mfu = stage_flops[s] / (seconds * peak * 1e12)
        stages[s] = {
            "seconds": seconds,
            "peak_memory_gib": metrics.get(f"memory/{s}_gib"),
            "tflops": stage_flops.get(s, 0) / 1e12 if s in stage_flops else None,
            "mfu": mfu,
        }
    result = {
        "recipe": args.recipe.name,
        "device": name,
        "small": args.small,
        "trajectories": B,
        "steps": cfg.sampler.steps,
        "completion": cfg.completion.method,
        "row_gflops": flops / 1e9,
        "peak_tflops": peak,
        "build_s": built_s,
        "train_command_s": train_s,
        "stages": stages,
        "eval_mean": metrics.get("eval/mean"),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"{args.recipe.name} on {name}: one iteration of {B} trajectories x T={cfg.sampler.steps} "
        f"({cfg.completion.method or 'no completion'}), a transformer row = {flops / 1e9:.3g} GFLOP; "
        f"`stepgrpo train` took {train_s:.1f} s with both evaluations and start-up",
    ]
    for s, v in stages.items():
        mem = f"{v['peak_memory_gib']:.1f} GiB" if v["peak_memory_gib"] is not None else "-"
        mfu = f"{100 * v['mfu']:.1f} %" if v["mfu"] is not None else "-"
        secs = f"{v['seconds']:.2f} s" if v["seconds"] is not None else "-"
        lines.append(f"  {s:9s} {secs:>10s}  peak memory {mem:>9s}  MFU {mfu:>7s}")
    (args.out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
