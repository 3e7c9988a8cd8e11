"""The papers' optimizer at SD3.5-Medium's shape: does the PPO clip bind there as it does on the
shipped model? (docs/bench/credit_schemes_clip/README.md; the CPU screen is `bench/credit_schemes_clip/clip.py`.)

    python -m bench.credit_schemes_clip.gpu_clip [--out bench/out/gpu_clip]   # on a CUDA machine (~5 min, one H100)
    python -m bench.credit_schemes_clip.gpu_clip --small --device cpu          # every code path at toy sizes, on a CPU

Two arms of `configs/flow_grpo_pickscore.yaml` (Flow-GRPO's recipe: its clip 1e-4), each
`--iterations` iterations of `stepgrpo train` with four AdamW steps a sampled batch (the CPU
screen's binding setting, `optim.optimizer_steps=4`) on random weights of SD3.5-M's transformer
shape and a PickScore-shaped reward (`bench/gpu/gpu_train.py` builds both; no download): outcome
credit, and DenseGRPO on the rollout's own x0 predictions (`completion.method=rollout`, no extra
NFEs). For every iteration it reads the update's clip diagnostics from the checkpoint (the clip
fraction at each optimizer step of the batch, and after the first step at each trained step) and
prints them beside the CPU model's from the screen's records (seed 0, the same iterations).
Output: `results.json` and `report.txt` in `--out`.

Random weights say how the ratio moves under the update at this shape and grid, not how a trained
model's does: the clip fraction depends on the size of the step the optimizer takes relative to
the policy's noise, which random weights share with a trained model only roughly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench._lib.gpu import REPO, device_name, gpu_arguments, prepare, train, write_report

RECORDS = REPO / "docs" / "bench" / "credit_schemes_clip" / "runs"
BIND = {"optim.optimizer_steps": "4", "optim.clip_range": "0.0001"}
ARMS: dict[str, tuple[dict[str, str], str]] = {  # arm -> (overrides, the CPU screen's arm)
    "outcome": ({}, "outcome_w9_k4"),
    "dense_rollout": (
        {"credit.scheme": "dense", "credit.options": "{}", "completion.method": "rollout"},
        "dense_rollout_w9_k4",
    ),
}
KEEP = ("clip_frac", "clip_frac_by_part", "clip_frac_later_by_step", "zero_grad_frac", "approx_kl")


def update_diagnostics(run_dir: Path) -> list[dict[str, Any]]:
    """The update's clip diagnostics of every checkpoint of a run, in order."""
    rows = []
    for ckpt in sorted((run_dir / "checkpoints").glob("iter_*"), key=lambda p: int(p.name[5:])):
        update = json.loads((ckpt / "state.json").read_text()).get("update", {})
        rows.append({k: update.get(k) for k in KEEP})
    return rows


def cpu_reference(arm: str, iterations: int) -> list[dict[str, Any]]:
    """The CPU screen's diagnostics of `arm`, seed 0, its first `iterations` iterations (none if not recorded)."""
    path = RECORDS / arm / "seed_0.json"
    if not path.is_file():
        return []
    return [{k: row.get(k) for k in KEEP} for row in json.loads(path.read_text())["update"][:iterations]]


def fmt(values: Any) -> str:
    if values is None:
        return "-"
    if isinstance(values, dict):  # {step: fraction}
        return " ".join(f"{k}:{v:.2f}" for k, v in sorted(values.items(), key=lambda kv: int(kv[0])))
    if isinstance(values, list):
        return " ".join(f"{v:.2f}" for v in values)
    return f"{values:.3f}"


def main() -> None:
    p = gpu_arguments(__doc__.split("\n\n")[0], "gpu_clip")
    p.add_argument("--recipe", type=Path, default=REPO / "configs" / "flow_grpo_pickscore.yaml")
    p.add_argument("--iterations", type=int, default=3)
    args = p.parse_args()
    results: dict[str, Any] = {"device": device_name(args.device)}
    common = prepare(args) | {
        "run.iterations": str(args.iterations), "run.eval_prompts": "1", "run.eval_every": str(args.iterations),
        "sampler.eval_steps": "4", **BIND,
    }  # fmt: skip
    lines_out = [f"device: {results['device']}; {args.recipe.name} + {BIND}, {args.iterations} iterations", ""]
    for arm, (sets, cpu_arm) in ARMS.items():
        t0 = time.perf_counter()
        run_dir, _ = train(args.recipe, common | sets, args.out, arm)
        here, cpu = update_diagnostics(run_dir), cpu_reference(cpu_arm, args.iterations)
        results[arm] = {"seconds": time.perf_counter() - t0, "here": here, "cpu_model": cpu}
        lines_out.append(
            f"{arm} ({results[arm]['seconds']:.0f} s): clip fraction by optimizer step | after step 1, by trained step"
        )
        for i, row in enumerate(here):
            ref = cpu[i] if i < len(cpu) else {}
            lines_out.append(
                f"  iteration {i}: here {fmt(row['clip_frac_by_part'])} | {fmt(row['clip_frac_later_by_step'])}"
            )
            lines_out.append(
                f"  {'':11s} CPU  {fmt(ref.get('clip_frac_by_part'))} | {fmt(ref.get('clip_frac_later_by_step'))}"
            )
        lines_out.append("")
    write_report(args.out, results, lines_out)


if __name__ == "__main__":
    main()
