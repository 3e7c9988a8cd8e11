"""Credit schemes compared on the shapes task, through the real pipeline (issue 5).

Every configuration is one run of the product's `train` flow (Prefect tasks, Zarr / Parquet run
directory, MLflow), in this process, on the shipped `models/shapes` model and the rule-based
`shapes` reward, with the same budget: the same iterations, prompts per iteration, group size,
sampler, LoRA and optimiser settings, and the same seeds (so seed `s` of every scheme sees the
same prompts and initial noise in every iteration). Configurations:

- main: `outcome` (Flow-GRPO, scores x_T only), `stepwise`, `dense`, `turning_point`, each with
  `remaining` completion (every state run down the rest of the grid);
- ablations, on `dense`: the `psi` kernel with DenseGRPO's calibrated noise table
  (`dense_psi`) against the flow kernel's noise `a = 0.7` (`dense`); completion `substeps:2`
  (`dense_substeps2`) and `tweedie` (`dense_tweedie`) against `remaining` (`dense`); and
  `turning_point` without its balancing rule (`turning_point_nobal`): with small batches the rule
  often keeps no turning point at all, and `turning_point` then equals `dense`.

`outcome` may run longer (`--outcome-iterations`): it costs about a third as much per iteration,
so its extra iterations show where it stands at equal wall-clock; every per-iteration statistic
uses the first `--iterations` only.

Outputs in `--out` (default `bench/out/credit_schemes[_quick]`): `curves.csv` (per run and
iteration: training reward, wall seconds, NFEs), `heldout.csv` (held-out evaluations),
`gains.csv` (mean gain per step k), `summary.csv` / `summary.md` (final held-out reward with a
95 % Student-t interval over seeds, paired differences to `outcome`, iterations and seconds to
reach thresholds), PNG plots, and `records/<run>.json`. A run whose record exists is not redone,
so an interrupted benchmark continues where it stopped; `--report-only` redraws from records.

    python bench/credit_schemes.py --quick      # <= 10 min on 2 CPU cores
    python bench/credit_schemes.py              # the full comparison (see docs/BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import _common  # noqa: I001  (first: fixes sys.path, see its docstring)
from _common import COMMON, OUT_DIR, first_reach, mean_ci, moving_average, read_run, write_json

# name -> (scheme, completion method or None, kernel)
CONFIGS: dict[str, tuple[str, str | None, str]] = {
    "outcome": ("outcome", None, "flow"),
    "stepwise": ("stepwise", "remaining", "flow"),
    "dense": ("dense", "remaining", "flow"),
    "turning_point": ("turning_point", "remaining", "flow"),
    "dense_psi": ("dense", "remaining", "psi"),
    "dense_substeps2": ("dense", "substeps:2", "flow"),
    "dense_tweedie": ("dense", "tweedie", "flow"),
    "turning_point_nobal": ("turning_point", "remaining", "flow"),
}
# scheme options of a configuration (default: the scheme's defaults)
OPTIONS: dict[str, dict[str, object]] = {"turning_point_nobal": {"balance": "false"}}
MAIN = ("outcome", "stepwise", "dense", "turning_point")
ABLATIONS = {
    "exploration noise (dense, remaining)": ("dense", "dense_psi"),
    "completion (dense)": ("dense", "dense_substeps2", "dense_tweedie"),
    "turning-point balancing": ("turning_point", "turning_point_nobal"),
}
COLOURS = {
    "outcome": "black",
    "stepwise": "tab:blue",
    "dense": "tab:orange",
    "turning_point": "tab:green",
    "dense_psi": "tab:red",
    "dense_substeps2": "tab:purple",
    "dense_tweedie": "tab:brown",
    "turning_point_nobal": "tab:olive",
}
EXPERIMENT = "bench-credit-schemes"  # MLflow experiment of every run
THRESHOLDS = (0.02, 0.05)  # training-reward gains over the base whose first crossing is reported
SMOOTH = 3  # iterations in the trailing mean of the training reward (thresholds, curves)

PRESETS = {
    # quick: every configuration once, the main ones with 2 seeds; checks the whole path
    "quick": {
        "iterations": 4,
        "outcome_iterations": 4,
        "prompts": 4,
        "group_size": 4,
        "eval_prompts": 32,
        "eval_every": 2,
        "seeds": [0, 1],
        "ablation_seeds": [0],
    },
    # full: sized to fit ~30 min on 2 busy CPU cores with one torch thread (docs/BENCHMARKS.md)
    "full": {
        "iterations": 8,
        "outcome_iterations": 12,
        "prompts": 4,
        "group_size": 4,
        "eval_prompts": 64,
        "eval_every": 4,
        "seeds": [0, 1, 2],
        "ablation_seeds": [0, 1, 2],
    },
}


def overrides(name: str, seed: int, iterations: int, a: argparse.Namespace, runs_root: Path) -> list[str]:
    scheme, method, kernel = CONFIGS[name]
    values = (
        dict(COMMON)
        | {
            "model.path": a.model,
            "sampler.kernel": kernel,
            "completion.method": method,
            "credit.scheme": scheme,
            "run.iterations": iterations,
            "run.prompts_per_iteration": a.prompts,
            "run.group_size": a.group_size,
            "run.eval_prompts": a.eval_prompts,
            "run.eval_every": a.eval_every,
            "run.seed": seed,
            "run.runs_root": str(runs_root),
            "run.name": EXPERIMENT,
        }
        | {f"credit.options.{k}": v for k, v in OPTIONS.get(name, {}).items()}
        | dict(item.split("=", 1) for item in a.set)
    )
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


def shared_tracking(out: Path) -> None:
    """One MLflow store for every run of the benchmark (`MLFLOW_TRACKING_URI`, as a user with a
    tracking server would set it): the per-run SQLite default would create a database per run."""
    if _common.os.environ.get("MLFLOW_TRACKING_URI"):
        return
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    _common.os.environ["MLFLOW_TRACKING_URI"] = uri
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(EXPERIMENT) is None:
        client.create_experiment(EXPERIMENT, artifact_location=(out / "mlflow-artifacts").resolve().as_uri())


def load_record(path: Path, out: Path, refresh: bool = False) -> dict[str, Any]:
    """A stored record, re-read from its run directory when `refresh` or when an older version of
    this script wrote it (everything in a record but its timing of the whole flow derives from the
    run's files)."""
    rec = json.loads(path.read_text())
    run_dir = out / "runs" / path.stem
    if (refresh or "turning_points" not in rec.get("extra", {})) and run_dir.is_dir():
        rec |= asdict(read_run(run_dir))
        write_json(path, rec)
    return rec


def run_one(name: str, seed: int, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One configuration x seed through the `train` flow; its record (cached in `records/`)."""
    run_id = f"{name}-s{seed}"
    record_path = out / "records" / f"{run_id}.json"
    iterations = a.outcome_iterations if name == "outcome" else a.iterations
    ov = overrides(name, seed, iterations, a, out / "runs")
    if record_path.is_file():
        rec = load_record(record_path, out)
        if rec["overrides"] != ov:
            raise SystemExit(f"{record_path} was made with other settings; use another --out or delete it")
        return rec
    run_dir = out / "runs" / run_id
    if run_dir.exists():  # an interrupted attempt: its timings would include the gap, start it over
        shutil.rmtree(run_dir)
    import torch

    load_before = _common.os.getloadavg()[0]
    result = _common.train_flow(ov, run_id)
    rec = asdict(read_run(Path(result["run_dir"])))
    rec |= {
        "config": name,
        "seed": seed,
        "overrides": ov,
        "flow_seconds": result["flow_seconds"],
        "load_before": load_before,
        "load_after": _common.os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
    }
    write_json(record_path, rec)
    return rec


# ------------------------------------------------------------------------------- analysis


def by_config(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (list(CONFIGS).index(r["config"]), r["seed"])):
        out.setdefault(r["config"], []).append(r)
    return out


def wall(rec: dict[str, Any]) -> list[float]:
    """Cumulative training seconds at the end of each iteration (set-up such as psi calibration included)."""
    t, out = rec["setup_seconds"], []
    for s in rec["iter_seconds"]:
        t += s
        out.append(t)
    return out


def heldout_at(rec: dict[str, Any], iteration: int) -> dict[str, Any] | None:
    return next((h for h in rec["heldout"] if h["iteration"] == iteration), None)


def analyse(records: list[dict[str, Any]], n_iter: int) -> dict[str, Any]:
    groups = by_config(records)
    base_train = mean_ci([r["train_reward"][0] for r in records if r["config"] != "dense_psi"])[0]
    outcome = groups.get("outcome", [])
    # thresholds above the base policy's training reward of the same seed (iteration 1 samples
    # the base policy; its prompts and noise are the same for every configuration of a seed)
    thresholds = {f"+{d}": d for d in THRESHOLDS}
    out_train = {r["seed"]: r["train_reward"][:n_iter] for r in outcome}
    out_final_held = {r["seed"]: heldout_at(r, n_iter)["reward"] for r in outcome if heldout_at(r, n_iter)}
    rows = []
    for name, recs in groups.items():
        finals = [heldout_at(r, n_iter) for r in recs]
        finals = [f["reward"] if f else float("nan") for f in finals]
        strict = [heldout_at(r, n_iter)["strict"] if heldout_at(r, n_iter) else float("nan") for r in recs]
        gain = [f - heldout_at(r, 0)["reward"] for f, r in zip(finals, recs)]
        paired = [f - out_final_held[r["seed"]] for f, r in zip(finals, recs) if r["seed"] in out_final_held]
        m, lo, hi = mean_ci(finals)
        gm, glo, ghi = mean_ci(gain)
        dm, dlo, dhi = mean_ci(paired) if name != "outcome" else (float("nan"),) * 3
        # training reward minus outcome's at the same seed and iteration (the same prompts and
        # initial noise): the prompt-sampling noise of the training curve cancels; averaged over
        # the second half of the iterations, when the policies have had time to diverge
        half = [
            sum(a - b for a, b in zip(r["train_reward"][n_iter // 2 : n_iter], out_train[r["seed"]][n_iter // 2 :]))
            / (n_iter - n_iter // 2)
            for r in recs
            if r["seed"] in out_train
        ]
        tm, tlo, thi = mean_ci(half) if name != "outcome" else (float("nan"),) * 3
        row: dict[str, Any] = {
            "config": name,
            "scheme": CONFIGS[name][0],
            "completion": CONFIGS[name][1] or "none",
            "kernel": CONFIGS[name][2],
            "seeds": len(recs),
            "iterations": n_iter,
            "heldout_final": m,
            "heldout_ci_lo": lo,
            "heldout_ci_hi": hi,
            "heldout_strict": mean_ci(strict)[0],
            "heldout_gain": gm,
            "gain_ci_lo": glo,
            "gain_ci_hi": ghi,
            "diff_vs_outcome": dm,
            "diff_ci_lo": dlo,
            "diff_ci_hi": dhi,
            "train_vs_outcome": tm,
            "train_diff_ci_lo": tlo,
            "train_diff_ci_hi": thi,
            "train_final": mean_ci([moving_average(r["train_reward"][:n_iter], SMOOTH)[-1] for r in recs])[0],
            "seconds_per_iter": mean_ci([sum(r["iter_seconds"][:n_iter]) / n_iter for r in recs])[0],
            "setup_seconds": mean_ci([r["setup_seconds"] for r in recs])[0],
            "nfe_per_iter": mean_ci(
                [sum(n["rollout"] + n["complete"] for n in r["nfe"][:n_iter]) / n_iter for r in recs]
            )[0],
        }
        tps = [t for r in recs for t in r.get("extra", {}).get("turning_points", [])[:n_iter]]
        row["tp_raw_per_iter"] = sum(t["raw"] for t in tps) / len(tps) if tps else float("nan")
        row["tp_kept_per_iter"] = sum(t["kept"] for t in tps) / len(tps) if tps else float("nan")
        for tname, thr in thresholds.items():
            its = [reach(r["train_reward"][:n_iter], thr) for r in recs]
            secs = [wall(r)[i - 1] if i else None for i, r in zip(its, recs)]
            # outcome may have run longer: where did it reach the threshold at all (equal wall-clock view)
            its_all = [reach(r["train_reward"], thr) for r in recs]
            secs_all = [wall(r)[i - 1] if i else None for i, r in zip(its_all, recs)]
            row[f"reached_{tname}"] = f"{sum(i is not None for i in its)}/{len(its)}"
            row[f"iters_to_{tname}"] = _mean_known(its)
            row[f"seconds_to_{tname}"] = _mean_known(secs_all if name == "outcome" else secs)
        rows.append(row)
    result = {
        "rows": rows,
        "thresholds": thresholds,
        "base_train": base_train,
        "threads": sorted({str(r.get("torch_threads", "not recorded")) for r in records}),
        "load": (
            mean_ci([r["load_before"] for r in records])[0],
            mean_ci([r["load_after"] for r in records])[0],
            max(max(r["load_before"], r["load_after"]) for r in records),
        ),
    }
    # outcome run longer than n_iter: its held-out reward at the end, and when that was
    longest = max((len(r["train_reward"]) for r in outcome), default=0)
    if longest > n_iter:
        last = [heldout_at(r, longest) for r in outcome]
        if all(last):
            step_walls = [wall(r)[n_iter - 1] for n in MAIN[1:] for r in groups.get(n, [])]
            result["outcome_long"] = {
                "iterations": longest,
                "heldout": mean_ci([h["reward"] for h in last]),
                "paired_gain": mean_ci([h["reward"] - heldout_at(r, 0)["reward"] for h, r in zip(last, outcome)]),
                "wall_seconds": mean_ci([wall(r)[-1] for r in outcome])[0],
                "step_schemes_wall_seconds_at_n": mean_ci(step_walls)[0],
            }
    return result


def reach(train_reward: list[float], gain: float) -> int | None:
    """First iteration (>= 2) whose trailing-mean training reward is `gain` above iteration 1's."""
    hit = first_reach(moving_average(train_reward, SMOOTH)[1:], train_reward[0] + gain)
    return None if hit is None else hit + 1


def _mean_known(values: list[Any]) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else float("nan")


def write_csvs(records: list[dict[str, Any]], analysis: dict[str, Any], out: Path) -> None:
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "config",
                "seed",
                "iteration",
                "train_reward",
                "train_reward_smoothed",
                "train_strict",
                "iter_seconds",
                "wall_seconds",
                "rollout_seconds",
                "complete_seconds",
                "update_seconds",
                "nfe_rollout",
                "nfe_complete",
            ]
        )
        for r in records:
            smooth, cum = moving_average(r["train_reward"], SMOOTH), wall(r)
            for i, rew in enumerate(r["train_reward"]):
                s, n = r["stage_seconds"][i], r["nfe"][i]
                w.writerow(
                    [
                        r["config"],
                        r["seed"],
                        i + 1,
                        rew,
                        smooth[i],
                        r["train_strict"][i],
                        r["iter_seconds"][i],
                        cum[i],
                        s["rollout"],
                        s["complete"],
                        s["update"],
                        n["rollout"],
                        n["complete"],
                    ]
                )
    subs = sorted({k for r in records for h in r["heldout"] for k in h if k.startswith("sub_")})
    with open(out / "heldout.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "iteration", "wall_seconds", "reward", "strict", *subs])
        for r in records:
            cum = [r["setup_seconds"], *wall(r)]
            for h in r["heldout"]:
                w.writerow(
                    [
                        r["config"],
                        r["seed"],
                        h["iteration"],
                        cum[h["iteration"]],
                        h["reward"],
                        h["strict"],
                        *[h.get(s, "") for s in subs],
                    ]
                )
    with open(out / "gains.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "seed", "iteration", "k", "mean_gain"])
        for r in records:
            for i, g in enumerate(r["gains"]):
                for k, v in enumerate(g):
                    w.writerow([r["config"], r["seed"], i + 1, k, v])
    rows = analysis["rows"]
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_md(analysis: dict[str, Any], settings: dict[str, Any], machine: dict[str, Any]) -> str:
    th = analysis["thresholds"]
    lines = [
        f"settings: {json.dumps(settings, sort_keys=True)}",
        f"machine: {machine['cores']} cores ({machine['cpu']}), torch {machine['torch']}, GPU: {machine['gpu']}; "
        f"torch threads of the runs: {analysis['threads']}; load average (1 min) before / after each run: "
        f"mean {fmt(analysis['load'][0], 2)} / {fmt(analysis['load'][1], 2)}, max {fmt(analysis['load'][2], 2)}",
        "",
        f"thresholds: the training reward (trailing mean of {SMOOTH} iterations) exceeds the same seed's base-policy "
        f"reward (iteration 1) by {' / '.join(th)}; mean base {fmt(analysis['base_train'])}",
        "",
        "| config | seeds | held-out reward after N (95% CI) | gain over base (95% CI) | minus outcome, paired (95% "
        "CI) "
        "| training reward minus outcome, paired, 2nd half (95% CI) "
        "| strict | iters to base+0.02 / +0.05 | seconds to base+0.02 / +0.05 | s / iter | NFE / iter | turning "
        "points / iter (kept) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in analysis["rows"]:
        lines.append(
            f"| {r['config']} | {r['seeds']} | {fmt(r['heldout_final'])} [{fmt(r['heldout_ci_lo'])}, "
            f"{fmt(r['heldout_ci_hi'])}] "
            f"| {fmt(r['heldout_gain'])} [{fmt(r['gain_ci_lo'])}, {fmt(r['gain_ci_hi'])}] "
            f"| {fmt(r['diff_vs_outcome'])} [{fmt(r['diff_ci_lo'])}, {fmt(r['diff_ci_hi'])}] "
            f"| {fmt(r['train_vs_outcome'])} [{fmt(r['train_diff_ci_lo'])}, {fmt(r['train_diff_ci_hi'])}] | "
            f"{fmt(r['heldout_strict'])} "
            f"| {fmt(r['iters_to_+0.02'], 1)} ({r['reached_+0.02']}) / {fmt(r['iters_to_+0.05'], 1)} "
            f"({r['reached_+0.05']}) "
            f"| {fmt(r['seconds_to_+0.02'], 0)} / {fmt(r['seconds_to_+0.05'], 0)} | {fmt(r['seconds_per_iter'], 1)} "
            f"| {fmt(r['nfe_per_iter'], 0)} | {fmt(r['tp_raw_per_iter'], 1)} ({fmt(r['tp_kept_per_iter'], 1)}) |"
        )
    if "outcome_long" in analysis:
        o = analysis["outcome_long"]
        lines += [
            "",
            f"outcome after {o['iterations']} iterations ({fmt(o['wall_seconds'], 0)} s of training; the step-level "
            f"schemes' {analysis['rows'][0]['iterations']} iterations took "
            f"{fmt(o['step_schemes_wall_seconds_at_n'], 0)} s): "
            f"held-out {fmt(o['heldout'][0])} [{fmt(o['heldout'][1])}, {fmt(o['heldout'][2])}], gain over base "
            f"{fmt(o['paired_gain'][0])} [{fmt(o['paired_gain'][1])}, {fmt(o['paired_gain'][2])}]",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- plots


def plot(records: list[dict[str, Any]], analysis: dict[str, Any], n_iter: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    groups = by_config(records)

    def curves(names: tuple[str, ...], x_wall: bool, path: Path, title: str) -> None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for name in names:
            recs = groups.get(name, [])
            if not recs:
                continue
            n = min(len(r["train_reward"]) for r in recs)
            y = np.array([moving_average(r["train_reward"][:n], SMOOTH) for r in recs])
            x = np.mean([wall(r)[:n] for r in recs], 0) if x_wall else np.arange(1, n + 1)
            c = COLOURS[name]
            axes[0].plot(x, y.mean(0), color=c, label=f"{name} ({len(recs)} seeds)")
            axes[0].fill_between(x, y.min(0), y.max(0), color=c, alpha=0.12)
            its = sorted({h["iteration"] for h in recs[0]["heldout"]})
            hx, hy, lo, hi = [], [], [], []
            shift = 0.08 * (names.index(name) - (len(names) - 1) / 2)  # side by side at one iteration
            for it in its:
                # paired: each seed's held-out reward minus its base model's (same prompts and noise)
                vals = [heldout_at(r, it)["reward"] - heldout_at(r, 0)["reward"] for r in recs if heldout_at(r, it)]
                if len(vals) != len(recs):
                    continue
                m, a, b = mean_ci(vals)
                hx.append(np.mean([([r["setup_seconds"], *wall(r)])[it] for r in recs]) if x_wall else it + shift)
                hy.append(m)
                lo.append(m - a if a == a else 0.0)
                hi.append(b - m if b == b else 0.0)
            axes[1].errorbar(hx, hy, yerr=[lo, hi], color=c, marker="o", capsize=3, label=name)
        for ax in axes:
            ax.set_xlabel("training wall-clock seconds" if x_wall else "iteration")
            ax.grid(alpha=0.3)
            if not x_wall:
                ax.axvline(n_iter, color="grey", lw=0.8, ls=":")
        axes[0].set_ylabel(f"training reward R_T (mean of last {SMOOTH} iterations)")
        axes[0].set_title("training reward: mean over seeds, band = min..max")
        axes[1].set_ylabel("held-out reward minus the base model's")
        axes[1].set_title("held-out gain (ODE samples): mean, 95% CI over seeds")
        axes[1].axhline(0.0, color="grey", lw=0.8)
        for thr, ls in zip(analysis["thresholds"].values(), ("--", "-.")):
            axes[0].axhline(analysis["base_train"] + thr, color="grey", lw=0.8, ls=ls)
        axes[0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    curves(MAIN, False, out / "reward_vs_iteration.png", "credit schemes on the shapes task: reward vs iteration")
    curves(MAIN, True, out / "reward_vs_wallclock.png", "credit schemes on the shapes task: reward vs wall-clock")
    for title, names in ABLATIONS.items():
        slug = {
            "exploration": "ablation_psi",
            "completion": "ablation_completion",
            "turning-point": "ablation_tp_balance",
        }[title.split()[0]]
        curves(names, False, out / f"{slug}.png", f"ablation, {title}: reward vs iteration")
        curves(names, True, out / f"{slug}_wallclock.png", f"ablation, {title}: reward vs wall-clock")

    # mean gain per step k: one heatmap per configuration with step rewards (iteration x k)
    with_gains = [n for n, recs in groups.items() if recs[0]["gains"] and recs[0]["gains"][0]]
    if with_gains:
        cols = min(4, len(with_gains))
        rows = math.ceil(len(with_gains) / cols)
        fig, axes = plt.subplots(
            rows, cols, figsize=(3.8 * cols + 1, 3.2 * rows + 0.6), squeeze=False, constrained_layout=True
        )
        arrays = {n: np.mean([np.array(r["gains"][:n_iter]) for r in groups[n]], 0) for n in with_gains}
        vmax = max(float(np.abs(a).max()) for a in arrays.values()) or 1.0
        for ax, name in zip(axes.flat, with_gains):
            im = ax.imshow(
                arrays[name],
                cmap="RdBu",
                vmin=-vmax,
                vmax=vmax,
                aspect="auto",
                origin="lower",
                extent=(-0.5, arrays[name].shape[1] - 0.5, 0.5, arrays[name].shape[0] + 0.5),
            )
            ax.set_title(f"{name} ({len(groups[name])} seeds)", fontsize=9)
            ax.set_xlabel("step k")
            ax.set_ylabel("iteration")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in list(axes.flat)[len(with_gains) :]:
            ax.axis("off")
        fig.colorbar(im, ax=axes, shrink=0.8, label="mean gain g_k = R_{k+1} - R_k")
        fig.suptitle("mean gain per step k (training rollouts, mean over trajectories and seeds)")
        fig.savefig(out / "gain_heatmap.png", dpi=110)
        plt.close(fig)


# ------------------------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small settings that finish in <= 10 min on 2 CPU cores")
    p.add_argument("--iterations", type=int, help="iterations of every configuration")
    p.add_argument(
        "--outcome-iterations", type=int, help="iterations of outcome (>= --iterations; equal wall-clock view)"
    )
    p.add_argument("--prompts", type=int, help="prompts per iteration")
    p.add_argument("--group-size", type=int, help="trajectories per prompt")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts per evaluation (all held-out prompts if larger)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation every N iterations (must divide --iterations)")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds of the main configurations")
    p.add_argument("--ablation-seeds", type=int, nargs="+", help="seeds of the ablation configurations")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides applied to every configuration (e.g. optim.lr=3e-4)",
    )
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    p.add_argument("--model", default=None, help="SD3 pipeline directory (default: the shipped models/shapes)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--report-only", action="store_true", help="only redraw tables and plots from existing records")
    a = p.parse_args()
    preset = PRESETS["quick" if a.quick else "full"]
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.outcome_iterations = max(a.outcome_iterations, a.iterations)
    if a.iterations % a.eval_every:
        p.error(f"--eval-every {a.eval_every} must divide --iterations {a.iterations}")
    out = a.out or OUT_DIR / ("credit_schemes_quick" if a.quick else "credit_schemes")
    _common.setup_env(out, a.threads)
    a.model = _common.model_path(a.model)
    shared_tracking(out)
    settings = {
        k: getattr(a, k)
        for k in (
            "iterations",
            "outcome_iterations",
            "prompts",
            "group_size",
            "eval_prompts",
            "eval_every",
            "seeds",
            "ablation_seeds",
            "model",
            "set",
        )
    }
    print(f"settings: {settings}", flush=True)

    # every seed of the main comparison first, then the ablations seed by seed: a time budget
    # (--max-minutes) cuts ablation seeds, never the main comparison's
    plan = [(n, s) for s in a.seeds for n in a.configs if n in MAIN]
    plan += [(n, s) for s in a.ablation_seeds for n in a.configs if n not in MAIN]
    records, skipped, t0 = [], [], time.perf_counter()
    for name, seed in plan:
        done = (out / "records" / f"{name}-s{seed}.json").is_file()
        if a.report_only and not done:
            continue
        if not done and a.max_minutes is not None and time.perf_counter() - t0 > 60 * a.max_minutes:
            skipped.append(f"{name}-s{seed}")
            continue
        t1 = time.perf_counter()
        if a.report_only:
            records.append(load_record(out / "records" / f"{name}-s{seed}.json", out, refresh=True))
            continue
        rec = run_one(name, seed, a, out)
        records.append(rec)
        final = rec["heldout"][-1]
        print(
            f"[{(time.perf_counter() - t0) / 60:5.1f} min] {name:16s} seed {seed}: held-out "
            f"{rec['heldout'][0]['reward']:.3f} -> "
            f"{final['reward']:.3f} (iteration {final['iteration']}), "
            f"{sum(rec['iter_seconds']) / len(rec['iter_seconds']):.1f} s/iter, "
            f"{time.perf_counter() - t1:.0f} s",
            flush=True,
        )
    if skipped:
        print(f"not run (--max-minutes {a.max_minutes}): {', '.join(skipped)}")
    if not records:
        raise SystemExit("no records to report")
    analysis = analyse(records, a.iterations)
    write_csvs(records, analysis, out)
    plot(records, analysis, a.iterations, out)
    machine = _common.machine()
    text = summary_md(analysis, settings, machine)
    if skipped:
        text += f"\nnot run (time budget): {', '.join(skipped)}\n"
    (out / "summary.md").write_text(text)
    write_json(
        out / "analysis.json",
        {
            "settings": settings,
            "machine": machine,
            "skipped": skipped,
            **analysis,
            "total_minutes": (time.perf_counter() - t0) / 60,
        },
    )
    print(text)
    print(f"outputs in {_common.relative(out)}")


if __name__ == "__main__":
    main()
