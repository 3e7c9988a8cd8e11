"""Does the shipped recipe learn? Held-out gain of `configs/shapes_outcome.yaml` over 3 seeds.

Each seed is one `stepgrpo train --config CONFIG --set run.seed=S` run (one torch thread), exactly
what a user runs, in a worker process that imported the CLI once (`bench/_lib/warm.py`). Every
`run.eval_every` iterations the run evaluates the held-out split (126 prompts x 2 noise seeds,
10-step ODE) with the same prompts and noise as its base evaluation, so each evaluation pairs with
the base sample by sample.

Printed per seed: base and final held-out reward, the paired gain with its 95 % interval over the
252 pairs, the wall time of the whole run (imports aside) and per iteration. Across seeds: the
mean gain with a 95 % t-interval over the seeds (what the target is about: the spread of training
itself), and the same at every evaluation. Writes `OUT/learning.csv`, `OUT/learning.json` and
`OUT/reward_vs_iteration.png` (held-out reward and paired gain per evaluation: each seed, and the
seeds' mean with its interval).

Runs are resumable: rerunning the script with the same `--out` resumes each seed's run directory
(a finished run costs seconds, and its recorded training time is kept; a run that was interrupted
and resumed reports the time of the part that finished it). Run with nothing else on the machine
for the wall times to mean anything; `--jobs 2` runs two seeds at once (one core each).

    .venv/bin/python -m bench.learning.learning                       # 3 seeds x 300 iterations
    .venv/bin/python -m bench.learning.learning --config configs/shapes_stepwise.yaml --seeds 0
    .venv/bin/python -m bench.learning.learning --quick               # 1 seed x 20 iterations: does it run
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench._lib.common import OUT_DIR, machine, mean_ci, relative, write_json
from bench._lib.runner import read_seed, run_seed
from bench._lib.warm import Stepgrpo

TARGET_GAIN = 0.05  # held-out gain the shipped outcome recipe must reach (3 seeds, interval above 0)
TARGET_MINUTES = 25.0  # per seed, one thread of a 2-core machine


def plot(seeds: list[dict[str, Any]], curve: list[dict[str, Any]], title: str, path: Path) -> None:
    """Held-out reward (left) and its paired gain over the base (right) per evaluation: each seed,
    and the seeds' mean with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "reward", "held-out reward (126 prompts x 2 seeds)"),
        (axes[1], "gain", "paired gain over the base model"),
    ):
        for s in seeds:
            ax.plot(
                [p["iteration"] for p in s["points"]],
                [p[key] for p in s["points"]],
                lw=0.8,
                alpha=0.5,
                marker=".",
                label=f"seed {s['seed']}",
            )
        if len(seeds) > 1:
            err = [[c[key] - c[f"{key}_lo"] for c in curve], [c[f"{key}_hi"] - c[key] for c in curve]]
            ax.errorbar(
                [c["iteration"] for c in curve],
                [c[key] for c in curve],
                yerr=err,
                color="black",
                lw=1.8,
                capsize=3,
                marker="o",
                label="mean, 95 % interval over seeds",
            )
        ax.set_xlabel("iteration (8 prompts x 8 samples each)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(0.0, color="grey", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/shapes_outcome.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra key=value config overrides")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once (one core each)")
    ap.add_argument("--quick", action="store_true", help="1 seed x 20 iterations, evaluations at 10 and 20")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.quick:
        a.seeds = a.seeds[:1]
        a.overrides += ["run.iterations=20", "run.eval_every=10"]
    name = Path(a.config).stem + ("_quick" if a.quick else "")
    out = (a.out or OUT_DIR / "learning" / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = machine()

    with Stepgrpo(a.jobs, out) as stepgrpo, ThreadPoolExecutor(max(1, a.jobs)) as pool:
        done = list(pool.map(lambda s: run_seed(a.config, s, a.overrides, out, stepgrpo), a.seeds))
    seeds = [read_seed(d) for d in done]

    # Across seeds, at each evaluation every seed has.
    common = sorted(set.intersection(*(set(p["iteration"] for p in s["points"]) for s in seeds)))
    curve = []
    for it in common:
        at = [next(p for p in s["points"] if p["iteration"] == it) for s in seeds]
        r, r_lo, r_hi = mean_ci([p["reward"] for p in at])
        g, g_lo, g_hi = mean_ci([p["gain"] for p in at])
        curve.append(
            {
                "iteration": it,
                "reward": r,
                "reward_lo": r_lo,
                "reward_hi": r_hi,
                "gain": g,
                "gain_lo": g_lo,
                "gain_hi": g_hi,
            }
        )

    print(f"\n{a.config} {' '.join(a.overrides)}: held-out reward (126 prompts x 2 noise seeds, paired with the base)")
    print(
        f"{'seed':>4} {'base':>7} {'final':>7} {'gain':>8}  {'95 % interval (252 pairs)':>26} {'minutes':>8} "
        f"{'s/iter':>7}"
    )
    for s in seeds:
        first, last = s["points"][0], s["points"][-1]
        print(
            f"{s['seed']:>4} {first['reward']:7.4f} {last['reward']:7.4f} {last['gain']:+8.4f}  "
            f"[{last['gain_lo']:+.4f}, {last['gain_hi']:+.4f}]{'':>8} {s['seconds'] / 60:8.1f} "
            f"{s['seconds_per_iteration']:7.2f}"
        )
    print("\nmean gain over the seeds at each evaluation (95 % t-interval over seeds):")
    for c in curve[1:]:
        print(
            f"  iteration {c['iteration']:>4}: {c['gain']:+.4f} [{c['gain_lo']:+.4f}, {c['gain_hi']:+.4f}]  (reward "
            f"{c['reward']:.4f})"
        )
    final = curve[-1]
    minutes = max(s["seconds"] for s in seeds) / 60
    if len(seeds) > 1:
        ok = final["gain"] >= TARGET_GAIN and final["gain_lo"] > 0 and minutes <= TARGET_MINUTES
        print(
            f"\ntarget (gain >= +{TARGET_GAIN}, interval above 0, <= {TARGET_MINUTES:.0f} min a seed): "
            f"{'met' if ok else 'NOT met'}: {final['gain']:+.4f} [{final['gain_lo']:+.4f}, {final['gain_hi']:+.4f}] "
            f"after {final['iteration']} iterations, slowest seed {minutes:.1f} min"
        )

    rows = [p for s in seeds for p in s["points"]]
    keys = sorted({k for p in rows for k in p})
    (out / "learning.csv").write_text(
        ",".join(keys) + "\n" + "\n".join(",".join(str(p.get(k, "")) for k in keys) for p in rows) + "\n"
    )
    write_json(
        out / "learning.json",
        {
            "config": a.config,
            "overrides": a.overrides,
            "machine": started,
            "curve": curve,
            "seeds": [
                {k: (relative(v) if isinstance(v, Path) else v) for k, v in s.items() if k != "points"} for s in seeds
            ],
        },
    )
    plot(seeds, curve, f"{a.config} ({len(seeds)} seed{'s' * (len(seeds) > 1)})", out / "reward_vs_iteration.png")
    print(
        f"\nwrote {relative(out / 'learning.csv')}, {relative(out / 'learning.json')}, "
        f"{relative(out / 'reward_vs_iteration.png')}"
    )


if __name__ == "__main__":
    main()
