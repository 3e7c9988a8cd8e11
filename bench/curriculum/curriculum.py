"""The gain-variance curriculum against uniform prompt draws, paired, on the shipped shapes task.

Two arms of `configs/shapes_outcome.yaml` (the recipe that learns, docs/bench/learning/README.md),
identical but for `curriculum.draw`: `uniform` and `gain_variance` (window and floor at their
defaults). Each seed is one `stepgrpo train` run per arm (`bench/learning/learning.py`'s `run_seed`);
both arms of a seed start from the same base model, LoRA initialisation, rollout noise and
held-out noise, so they differ only in which prompts they train on. With `--jobs 2` the two arms
of a seed run at the same time, under the same load.

Printed: per seed and arm, the base and final held-out reward (126 prompts x 2 noise seeds) and
the paired gain; per seed, the curriculum's final reward minus the uniform arm's, paired sample by
sample over the 252 held-out pairs, with its 95 % interval; across seeds, the mean of that
difference with a 95 % t-interval over the seeds. What the draw did, from the stored rewards:
the mean within-group variance of the training rewards of each arm's iterations (what the
curriculum draws by) and the share of groups with zero spread. Writes `OUT/curriculum.json`.

    .venv/bin/python -m bench.curriculum.curriculum --jobs 2    # 3 seeds x 300 iterations x 2 arms (~95 min)
    .venv/bin/python -m bench.curriculum.curriculum --iterations 20 --seeds 0   # does it run
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench._lib.common import OUT_DIR, machine, mean_ci, relative, write_json
from bench._lib.runner import read_seed, run_seed
from bench._lib.warm import Stepgrpo

ARMS = {"uniform": [], "gain_variance": ["curriculum.draw=gain_variance"]}


def final_eval(run_dir: Path) -> dict[str, Any]:
    """The run's last evaluation record."""
    from stepgrpo.results import EvaluateResult

    records = [
        EvaluateResult.model_validate(json.loads(f.read_text())).record() for f in run_dir.glob("eval/iter_*.json")
    ]
    return max(records, key=lambda e: int(e["label"].removeprefix("iter_")))


def training_spread(run_dir: Path) -> dict[str, float]:
    """Mean within-group variance of the training rewards over the run's iterations, and the share
    of groups with none (`stepgrpo_core.curriculum.group_spread`)."""
    import torch

    from stepgrpo.storage.run import Run
    from stepgrpo_core.curriculum import group_spread

    run = Run.open(run_dir)
    spreads = []
    for j in run.iterations("rollout"):
        rewards = run.tables.reward_grid(j, "shapes")
        group_ids = torch.from_numpy(run.stages.read_array(j, "rollout", "group_ids")).long()
        spreads.append(group_spread(rewards, group_ids)[1])
    v = torch.cat(spreads)
    return {"group_variance": float(v.mean()), "zero_spread_share": float((v == 0).float().mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/shapes_outcome.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (one core each); 2 runs a seed's arms together")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from stepgrpo.reporting.report import paired_gain

    out = (a.out or OUT_DIR / "curriculum" / f"{Path(a.config).stem}_{a.iterations}").resolve()
    started = machine()
    common = [f"run.iterations={a.iterations}", f"run.eval_every={a.eval_every}"]
    jobs = [(arm, seed) for seed in a.seeds for arm in ARMS]
    for arm in ARMS:
        (out / arm).mkdir(parents=True, exist_ok=True)

    def one(job: tuple[str, int]) -> dict[str, Any]:
        arm, seed = job
        return {"arm": arm, **read_seed(run_seed(a.config, seed, common + ARMS[arm], out / arm, stepgrpo))}

    with Stepgrpo(a.jobs, out) as stepgrpo, ThreadPoolExecutor(max(1, a.jobs)) as pool:
        runs = list(pool.map(one, jobs))
    by = {(r["arm"], r["seed"]): r for r in runs}

    print(f"\n{a.config}, {a.iterations} iterations: held-out reward (126 prompts x 2 noise seeds)")
    print(f"{'seed':>4} {'arm':>14} {'base':>7} {'final':>7} {'gain':>8}  {'95 % interval':>18} {'s/iter':>7}")
    rows = []
    for seed in a.seeds:
        for arm in ARMS:
            r = by[(arm, seed)]
            first, last = r["points"][0], r["points"][-1]
            print(
                f"{seed:>4} {arm:>14} {first['reward']:7.4f} {last['reward']:7.4f} {last['gain']:+8.4f}  "
                f"[{last['gain_lo']:+.4f}, {last['gain_hi']:+.4f}] {r['seconds_per_iteration']:7.2f}"
            )
        u, c = (final_eval(by[(arm, seed)]["run_dir"]) for arm in ARMS)
        diff = paired_gain(u, c)  # curriculum minus uniform, pair by pair
        spread = {arm: training_spread(by[(arm, seed)]["run_dir"]) for arm in ARMS}
        rows.append(
            {
                "seed": seed,
                "uniform_gain": by[("uniform", seed)]["points"][-1]["gain"],
                "curriculum_gain": by[("gain_variance", seed)]["points"][-1]["gain"],
                "difference": diff[0],
                "difference_lo": diff[1],
                "difference_hi": diff[2],
                "spread": spread,
            }
        )
    print("\ncurriculum minus uniform, final held-out reward, paired over the 252 held-out pairs:")
    for r in rows:
        s = r["spread"]
        print(
            f"  seed {r['seed']}: {r['difference']:+.4f} [{r['difference_lo']:+.4f}, {r['difference_hi']:+.4f}]; "
            f"training group variance uniform {s['uniform']['group_variance']:.4f}, curriculum "
            f"{s['gain_variance']['group_variance']:.4f}; zero-spread groups "
            f"{s['uniform']['zero_spread_share']:.3f} / {s['gain_variance']['zero_spread_share']:.3f}"
        )
    summary: dict[str, Any] = {}
    if len(rows) > 1:
        m, lo, hi = mean_ci([r["difference"] for r in rows])
        gu = mean_ci([r["uniform_gain"] for r in rows])
        gc = mean_ci([r["curriculum_gain"] for r in rows])
        summary = {"difference": [m, lo, hi], "uniform_gain": list(gu), "curriculum_gain": list(gc)}
        print(
            f"\nover {len(rows)} seeds (95 % t-interval): gain uniform {gu[0]:+.4f} [{gu[1]:+.4f}, {gu[2]:+.4f}], "
            f"curriculum {gc[0]:+.4f} [{gc[1]:+.4f}, {gc[2]:+.4f}]; difference {m:+.4f} [{lo:+.4f}, {hi:+.4f}]"
        )
    write_json(
        out / "curriculum.json",
        {
            "config": a.config,
            "iterations": a.iterations,
            "arms": ARMS,
            "machine": started,
            "seeds": rows,
            "summary": summary,
            "runs": [{k: (relative(v) if isinstance(v, Path) else v) for k, v in r.items()} for r in runs],
        },
    )
    print(f"\nwrote {relative(out / 'curriculum.json')}")


if __name__ == "__main__":
    main()
