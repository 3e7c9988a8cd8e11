"""Scale-out on this machine, as ratios measured in one run (issue 13, docs/SCALING.md).

The shipped `models/shapes` model, 64 trajectories an iteration (16 prompts x 4),
`model.max_batch` 32 so that a stage is two blocks (two shards on two workers), the `remaining`
completion and the `shapes` reward. Each configuration trains `--iterations` iterations,
`--repeats` times in alternating order (the machine drifts); the first iteration of each run is
dropped (model loading, worker start-up) and the medians of the rest are compared. Every torch
process uses one thread (a Ray shard asks one CPU; the in-process run is pinned to one too), so
the ratios compare workers, not thread counts.

1. Ray with 1 worker / in-process, on rollout + complete + score (target >= 0.9 of its throughput).
2. Ray with 2 workers / 1 worker on rollout + complete + score (target >= 1.6x on 2 idle cores).
3. The 2-process update (torchrun, gloo) / the update in this process.
4. The ceiling of 2: the same bare rollout (32 trajectories, one thread) in two processes at once
   against one alone (what two busy cores of this machine give, with no pipeline at all).
Every configuration must store the same bytes (checked with bench._lib.digests' items).

    python -m bench.scale.scale [--iterations 4] [--repeats 2] [--prompts 16]   # writes bench/out/scale/scale.json
    python -m bench.scale.scale --device cuda --configs in-process ray-2       # on a GPU: two shards share it
    python -m bench.scale.scale --configs in-process update-2 --set sampler.sde_window_size=9   # update-heavy
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import _common
from bench._lib.common import OUT_DIR, machine, write_json
from bench._lib.digests import items

RECIPE = [
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
SAMPLED = ("rollout", "complete", "score")


def stage_seconds(run_dir: Path) -> list[dict[str, float]]:
    """Seconds of each stage of each iteration as the stages recorded them, and `overhead`: what
    rollout, complete and score spent beyond their slowest shard (submission, Prefect task runs,
    begin and publish)."""
    from stepgrpo.storage import Run

    run = Run.open(run_dir)
    out = []
    for i in run.iterations("checkpoint"):
        version = run.tables.read_rewards(i).column("reward_version")[0].as_py()
        rewards = run.tables.rows_info("rewards", run.tables.rewards_digest(i, "shapes", version))
        rollout = run.stage_manifest(i, "rollout")["inputs"]
        complete = run.stage_manifest(i, "completions/remaining")["inputs"]
        images = run.stage_manifest(i, "images/remaining")["inputs"]
        out.append(
            {
                "rollout": rollout["seconds"],
                "complete": complete["seconds"],
                "score": rewards["seconds"],
                "update": run.stage_manifest(i, "checkpoint")["inputs"]["seconds"],
                "overhead": rollout["seconds"]
                + complete["seconds"]
                + rewards["seconds"]
                - sum(max(m["shards"]["seconds"]) for m in (rollout, complete, images)),
            }
        )
    return out


BARE = """
import sys, time
import numpy as np, torch
torch.set_num_threads(1)
from stepgrpo.loops import workspace
from stepgrpo.config import load_config
from stepgrpo.loops.sampling import sample_groups
cfg = load_config("configs/demo.yaml", ["model.max_batch=32", "run.group_size=4"])
pol = workspace.policy(cfg)
def once():
    for _ in sample_groups(pol, ["two red circles"] * 8, np.zeros(32, np.int64), [(g,) for g in range(8)], 4,
                           pol.sigmas(10), kernel="flow", noise=0.7, sde_seed=lambda c: (c,), groups_per_call=8,
                           window=(0, 3), ode_reference=True):
        pass
once()
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # both processes start their loops together
t = time.perf_counter()
for _ in range(4):
    once()
print((time.perf_counter() - t) / 4)
"""


def ceiling() -> dict[str, float]:
    """Seconds of one bare rollout alone and of each of two at once (separate processes that start
    their timed loops at the same moment, after loading)."""
    import subprocess

    def start(at: float) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", BARE, str(at)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )

    alone = float(start(0.0).communicate()[0].split()[-1])
    at = time.time() + 40.0  # both have loaded the model by then
    pair = [start(at), start(at)]
    together = [float(p.communicate()[0].split()[-1]) for p in pair]
    return {"alone_s": alone, "together_s": together, "speedup": 2 * alone / max(together)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration, in alternating order")
    parser.add_argument("--prompts", type=int, default=16, help="prompt groups of 4 an iteration (16: 64 trajectories)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu", help="cuda: the shards share the GPU (--gpus-per-shard)")
    parser.add_argument("--gpus-per-shard", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "scale")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="key=value on every run (e.g. an update-heavy iteration: --set sampler.sde_window_size=9)",
    )
    a = parser.parse_args()
    import os

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ["STEPGRPO_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"  # the torchrun ranks and Ray workers read it
    _common.setup_env(a.out, threads=1)
    import shutil

    from bench._lib.common import train_flow

    runs_root = a.out / "runs"
    shutil.rmtree(runs_root, ignore_errors=True)
    common = [*RECIPE, f"run.prompts_per_iteration={a.prompts}", f"run.iterations={a.iterations}"]
    common.append(f"run.runs_root={runs_root}")
    common += a.overrides
    if a.device != "cpu":  # on a GPU: two shards share it, against the in-process run on it
        common += [f"model.device={a.device}", f"scale.gpus_per_shard={a.gpus_per_shard}"]
    result: dict[str, Any] = {"machine": machine(), "recipe": common, "configs": {}}
    result["ceiling"] = ceiling()
    print(f"two bare rollouts at once: {result['ceiling']['speedup']:.2f}x one alone", flush=True)
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in a.configs}
    order = [n for r in range(a.repeats) for n in (a.configs if r % 2 == 0 else a.configs[::-1])]
    for r, name in enumerate(order):
        run_id = f"{name}-{r}"
        train_flow([*common, *CONFIGS[name]], run_id=run_id, config_path="configs/demo.yaml")
        got = stage_seconds(runs_root / run_id)[1:]  # the first iteration holds loading and start-up
        samples[name] += got
        print(f"{run_id:12s} sample " + " ".join(f"{sum(it[s] for s in SAMPLED):5.2f}" for it in got), flush=True)
    for name, its in samples.items():
        median = {s: statistics.median(it[s] for it in its) for s in (*STAGES, "overhead")}
        median["sample"] = statistics.median(sum(it[s] for s in SAMPLED) for it in its)
        result["configs"][name] = {"median_seconds": median, "iterations": its}
        print(f"{name:10s} median " + "  ".join(f"{k} {v:5.2f} s" for k, v in median.items()), flush=True)
    c = {n: r["median_seconds"] for n, r in result["configs"].items()}
    ratios = {"two_processes_at_once_vs_one": result["ceiling"]["speedup"]}
    if {"in-process", "ray-1"} <= c.keys():
        ratios["ray_1_worker_throughput_vs_in_process"] = c["in-process"]["sample"] / c["ray-1"]["sample"]
    if {"ray-1", "ray-2"} <= c.keys():
        ratios["ray_2_workers_speedup_vs_1"] = c["ray-1"]["sample"] / c["ray-2"]["sample"]
    if {"in-process", "update-2"} <= c.keys():
        ratios["update_2_processes_speedup_vs_1"] = c["in-process"]["update"] / c["update-2"]["update"]
    reference = items(runs_root / f"{a.configs[0]}-0")
    same = {}
    for r, name in enumerate(order[1:], start=1):
        if name == "update-2":
            continue  # its weights differ in the last bits, and the next rollouts with them
        other = items(runs_root / f"{name}-{r}")
        same[f"{name}-{r}"] = [k for k in sorted(set(reference) | set(other)) if reference.get(k) != other.get(k)]
    result.update(ratios=ratios, differing_items=same)
    print(json.dumps(ratios, indent=1))
    print("items that differ from the first run:", json.dumps(same))
    write_json(a.out / "scale.json", result)


if __name__ == "__main__":
    main()
