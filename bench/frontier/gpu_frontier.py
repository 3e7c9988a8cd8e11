"""The frontier's objectives at SD3.5-Medium's shape: seconds per iteration and transformer passes of
DiffusionNFT, AWM and DGPO beside Flow-GRPO's, one iteration each (docs/bench/frontier/README.md; the
CPU decision is `bench/frontier/frontier.py`).

    python bench/frontier/gpu_frontier.py [--out bench/out/gpu_frontier]   # on a CUDA machine (~5 min, one H100)
    python bench/frontier/gpu_frontier.py --small --device cpu             # every code path at toy sizes, on a CPU

Four recipes as shipped (`configs/diffusionnft_geneval.yaml`, `configs/awm_geneval.yaml`,
`configs/dgpo_ocr.yaml`, `configs/flow_grpo_pickscore.yaml`), each `--iterations` iterations of
`stepgrpo train` on random weights of SD3.5-M's transformer shape and a PickScore-shaped reward
(`bench/gpu/gpu_train.py` builds both; no download; the GenEval detector is not part of what is
timed), with `--prompts x --group` trajectories an iteration for all four. For each it reads the stored costs
(`stepgrpo.reporting.costs.iteration_costs`): seconds per stage and NFEs per stage, and the
forward-equivalent passes (a backward row = 2 forwards). Output: `results.json` and `report.txt`
in `--out`.
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

if __name__ == "__main__":  # `python bench/frontier/gpu_frontier.py`: the repository, not bench/, first on the path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.gpu.gpu_train import build_policy, build_reward

REPO = Path(__file__).resolve().parents[2]
RECIPES = {
    "diffusionnft": "configs/diffusionnft_geneval.yaml",
    "awm": "configs/awm_geneval.yaml",
    "dgpo": "configs/dgpo_ocr.yaml",
    "flow_grpo": "configs/flow_grpo_pickscore.yaml",
}


def costs(run_dir: Path) -> list[dict[str, Any]]:
    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.run import Run

    return iteration_costs(Run.open(run_dir))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_frontier")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="toy sizes (with --device cpu: try the script on a CPU)")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    p.add_argument("--group", type=int, default=8, help="trajectories per prompt")
    args = p.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; use --small --device cpu to try the script")
    args.out.mkdir(parents=True, exist_ok=True)
    model, reward = args.out / "policy", args.out / "reward"
    if not (model / "model_index.json").is_file():
        build_policy(model, args.small)
    if not (reward / "config.json").is_file():
        build_reward(reward, args.small)
    prompts = args.out / "prompts.txt"
    lines = [f"a photo of a {c} {t}" for t in ("cat", "dog", "car", "tree", "house") for c in ("red", "blue", "green")]
    prompts.write_text("\n".join(lines) + "\n")
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    common = {
        "model.path": str(model), "model.device": args.device, "model.dtype": dtype, "model.resolution": "null",
        "reward.name": "pickscore", "reward.options": json.dumps({"model": str(reward), "processor": str(reward)}),
        "run.prompts": str(prompts), "run.heldout_prompts": str(prompts), "run.iterations": str(args.iterations),
        "run.prompts_per_iteration": str(args.prompts), "run.group_size": str(args.group), "run.eval_prompts": "1",
        "run.eval_every": str(args.iterations + 1), "run.runs_root": str(args.out / "runs"),
        "storage.images": "false", "sampler.eval_steps": "4",
    }  # fmt: skip
    if args.small:  # toy sizes: fewer grid steps than the recipes' 10 and 14
        common["sampler.steps"] = "4"
        common["update.times"] = "2"
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_DISABLE_TELEMETRY="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    out = [
        f"device: {results['device']}; {args.prompts} x {args.group} trajectories, {args.iterations} iteration(s)",
        "",
    ]
    out.append("recipe: seconds an iteration (rollout / score / update) | NFEs an iteration | passes an iteration")
    for name, recipe in RECIPES.items():
        sets = dict(common)
        if name == "flow_grpo":
            sets.pop("update.times", None)
        run_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        cmd = [sys.executable, "-m", "stepgrpo_cli", "train", "--config", recipe, "--run-id", run_id]
        cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(
                f"stepgrpo train ({name}) failed (log: {args.out / f'{name}.log'}):\n{proc.stderr[-3000:]}"
            )
        rows = costs(args.out / "runs" / run_id)
        results[name] = {"wall_seconds": time.perf_counter() - t0, "iterations": rows}
        last = rows[-1]
        st = last["seconds_stages"]
        out.append(
            f"{name}: {last['seconds']:.1f} s ({st.get('rollout', 0):.1f} / {st.get('score', 0):.1f} / "
            f"{st.get('update', 0):.1f}) | {last['nfe']} ({last['nfe_stages']}) | {last['passes']}"
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "report.txt").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
