"""One end-to-end `stepgrpo train` iteration at SD3.5-Medium's shape: each stage's seconds, peak GPU
memory and MFU.

    python -m bench.gpu.gpu_train [--recipe configs/flow_grpo_pickscore.yaml] [--out bench/out/gpu_train]
    python -m bench.gpu.gpu_train --small --device cpu          # every code path at toy sizes, on a CPU

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

import json
import time
from pathlib import Path

from bench._lib.gpu import PEAK_TFLOPS, REPO, device_name, gpu_arguments, prepare, train

STAGES = ("rollout", "complete", "score", "credit", "update")


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
    p = gpu_arguments(__doc__.split("\n\n")[0], "gpu_train", prompts=8)
    p.add_argument("--recipe", type=Path, default=REPO / "configs" / "flow_grpo_pickscore.yaml")
    p.add_argument("--peak-tflops", type=float, default=None, help="device's dense bf16 peak (default: by name)")
    args = p.parse_args()
    name = device_name(args.device)
    t0 = time.perf_counter()
    sets = prepare(args)
    built_s = time.perf_counter() - t0
    model, dtype = Path(sets["model.path"]), sets["model.dtype"]
    sets |= {"run.iterations": "1", "run.eval_prompts": "3", "optim.optimizer_steps": "1"}
    if args.small:  # trying the script: the evaluations' ODE sampling cut to 4 steps of 1 prompt
        sets |= {"sampler.eval_steps": "4", "run.eval_prompts": "1"}
    run_dir, train_s = train(args.recipe, sets, args.out, "train")
    metrics = mlflow_numbers(run_dir)
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
    update_nfe = json.loads((run_dir / "checkpoints" / "iter_0" / "_published.json").read_text())["inputs"].get(
        "nfe", 0
    )
    stage_flops["update"] = update_nfe * rows_per_nfe * flops + 2 * graded * flops
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
