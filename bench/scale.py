"""Scale-out on this machine, as ratios measured in one run (issue 13, docs/SCALING.md).

The shipped `models/shapes` model, 64 trajectories an iteration (16 prompts x 4),
`model.max_batch` 32 so that a stage is two blocks (two shards on two workers), the `remaining`
completion and the `shapes` reward. Each configuration trains `--iterations` iterations; the
first is dropped (model loading, worker start-up) and the rest are averaged. Every torch
process uses one thread (a Ray shard asks one CPU; the in-process run is pinned to one too), so
the ratios compare workers, not thread counts.

1. Ray with 1 worker / in-process, on rollout + complete + score (target >= 0.9 of its throughput).
2. Ray with 2 workers / 1 worker on rollout + complete + score (target >= 1.6x on 2 idle cores).
3. The 2-process update (torchrun, gloo) / the update in this process.
Every configuration must store the same bytes (checked with bench/digests.py's items).

    python bench/scale.py [--iterations 3]     # writes bench/out/scale/scale.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common  # noqa: I001  (first: fixes sys.path, see its docstring)
from _common import BENCH_DIR, OUT_DIR, machine, write_json

sys.path.insert(1, str(BENCH_DIR))
from digests import items  # noqa: E402

RECIPE = [
    "run.prompts_per_iteration=16",
    "run.group_size=4",
    "model.max_batch=32",
    "completion.method=remaining",
    "credit.scheme=stepwise",
    "run.eval_prompts=8",
    "run.eval_every=0",
]
CONFIGS = {
    "in-process": [],
    "ray-1": ["scale.workers=ray", "scale.num_workers=1"],
    "ray-2": ["scale.workers=ray", "scale.num_workers=2"],
    "update-2": ["scale.update_processes=2"],
}
STAGES = ("rollout", "complete", "score", "update")


def stage_seconds(run_dir: Path) -> list[dict[str, float]]:
    """Seconds of each stage of each iteration, as the stages recorded them."""
    from storage import Run

    run = Run.open(run_dir)
    out = []
    for i in run.iterations("checkpoint"):
        rewards = run.rows_info(
            "rewards", run.rewards_digest(i, "shapes", run.read_rewards(i).column("reward_version")[0].as_py())
        )
        out.append(
            {
                "rollout": run.stage_manifest(i, "rollout")["inputs"]["seconds"],
                "complete": run.stage_manifest(i, "completions/remaining")["inputs"]["seconds"],
                "score": rewards["seconds"],
                "update": run.stage_manifest(i, "checkpoint")["inputs"]["seconds"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "scale")
    a = parser.parse_args()
    import os

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ["STEPGRPO_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"  # the torchrun ranks and Ray workers read it
    _common.setup_env(a.out, threads=1)
    import shutil

    from _common import train_flow

    runs_root = a.out / "runs"
    shutil.rmtree(runs_root, ignore_errors=True)
    common = [*RECIPE, f"run.iterations={a.iterations}", f"run.runs_root={runs_root}"]
    result: dict[str, Any] = {"machine": machine(), "recipe": common, "configs": {}}
    for name, extra in CONFIGS.items():
        t0 = time.perf_counter()
        train_flow([*common, *extra], run_id=name, config_path="configs/demo.yaml")
        per_iteration = stage_seconds(runs_root / name)[1:]  # the first holds loading and start-up
        mean = {s: statistics.mean(it[s] for it in per_iteration) for s in STAGES}
        mean["sample"] = mean["rollout"] + mean["complete"] + mean["score"]
        result["configs"][name] = {"seconds": mean, "flow_seconds": time.perf_counter() - t0}
        print(f"{name:10s} " + "  ".join(f"{k} {v:6.2f} s" for k, v in mean.items()), flush=True)
    c = {n: r["seconds"] for n, r in result["configs"].items()}
    ratios = {
        "ray_1_worker_throughput_vs_in_process": c["in-process"]["sample"] / c["ray-1"]["sample"],
        "ray_2_workers_speedup_vs_1": c["ray-1"]["sample"] / c["ray-2"]["sample"],
        "update_2_processes_speedup_vs_1": c["in-process"]["update"] / c["update-2"]["update"],
    }
    reference = items(runs_root / "in-process")
    same = {}
    for n in ("ray-1", "ray-2"):
        other = items(runs_root / n)
        same[n] = [k for k in sorted(set(reference) | set(other)) if reference.get(k) != other.get(k)]
    result.update(ratios=ratios, differing_items=same)
    print(json.dumps(ratios, indent=1))
    print("items that differ from the in-process run:", json.dumps(same))
    write_json(a.out / "scale.json", result)


if __name__ == "__main__":
    main()
