"""The credit schemes compared at the shipped recipes that learn, at equal trajectories and at
equal compute, with the papers' ablations and a table of their claims.

Every run is one `stepgrpo train --config configs/shapes_<scheme>.yaml --set run.seed=S` (one
torch thread, exactly what a user runs; `bench/learning/learning.py` runs it in a warm worker process,
`bench/_lib/warm.py`). The
four schemes share everything but their credit: the shipped model and `shapes` reward, 8 prompts x
8 samples an iteration, the `flow` SDE on steps 0-2, one AdamW step an iteration. Seed `S` of
every scheme sees the same prompts and initial noise in every iteration, and its held-out
evaluations (126 prompts x 2 noise seeds) use the same prompts and noise as its base evaluation,
so every comparison between two runs of one seed pairs sample by sample.

Configurations (`CONFIGS`): the comparison (`outcome`, `stepwise`, `dense`, `turning_point`) and
the papers' ablations, each paired with the configuration it changes (`ABLATIONS`): the DDIM SDE
against Flow-GRPO's (`stepwise_ddim`), DenseGRPO's calibrated `psi` against uniform noise
(`dense_psi`), completion with 2 substeps and with one Tweedie step against the remaining grid
(`dense_substeps2`, `dense_tweedie`), TP-GRPO without its balancing rule (`turning_point_nobal`).

Budgets:
- equal trajectories: every scheme after `--iterations`;
- equal compute: `outcome` trains `--outcome-iterations` (its config's 300), and is evaluated at
  the iteration where its cumulative transformer NFEs (rollout + completion + update forwards), or
  its cumulative training seconds, equal a step-level scheme's after `--iterations`, per seed.

Printed and written to `--out` (default `bench/out/credit_schemes`): `summary.md` (every table),
`claims.md` (each claim of the three papers, the measurement, its interval and a verdict by a
stated rule), `heldout.csv`, `curves.csv`, `gains.csv`, `ablations.csv`, `sde_gap.csv`,
`analysis.json`, and `heldout.png` (held-out gain against iterations, NFEs and seconds),
`gain_heatmap.png`, `ablations.png`. Runs are resumable: a finished run is read back, not redone;
`--report-only` only reads and reports.

    .venv/bin/python -m bench.credit_schemes.credit_schemes --jobs 2      # the comparison of docs/BENCHMARKS.md
    .venv/bin/python -m bench.credit_schemes.credit_schemes --quick       # every path at tiny settings (~2 min)
    python -m bench.credit_schemes.credit_schemes --gpu                   # on a CUDA machine: 8x the trajectories
    .venv/bin/python -m bench.credit_schemes_w9.w9       # the papers' regime (docs/bench/credit_schemes_w9), resumable
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._lib.common import OUT_DIR, machine, mean_ci, read_run, relative, write_json
from bench._lib.runner import run_seed
from bench._lib.stats import ci, claims_md, crossing, fmt, paired, read_evals, verdict
from bench._lib.warm import Stepgrpo

# name -> (shipped config, overrides on it)
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "outcome": ("configs/shapes_outcome.yaml", []),
    "stepwise": ("configs/shapes_stepwise.yaml", []),
    "dense": ("configs/shapes_dense.yaml", []),
    "turning_point": ("configs/shapes_turning_point.yaml", []),
    "stepwise_ddim": ("configs/shapes_stepwise.yaml", ["sampler.kernel=ddim", "sampler.noise=1.0"]),
    "dense_psi": ("configs/shapes_dense.yaml", ["sampler.kernel=psi"]),
    "dense_substeps2": ("configs/shapes_dense.yaml", ["completion.method=substeps:2"]),
    "dense_tweedie": ("configs/shapes_dense.yaml", ["completion.method=tweedie"]),
    "turning_point_nobal": ("configs/shapes_turning_point.yaml", ["credit.options.balance=false"]),
}
MAIN = ("outcome", "stepwise", "dense", "turning_point")
STEP_LEVEL = MAIN[1:]
# ablation -> (base configuration, changed configuration, what changes)
ABLATIONS: dict[str, tuple[str, str, str]] = {
    "ddim_sde": ("stepwise", "stepwise_ddim", "Stepwise-Flow-GRPO: DDIM SDE (eta 1) instead of Flow-GRPO's (a 0.7)"),
    "psi": ("dense", "dense_psi", "DenseGRPO: calibrated psi instead of uniform a 0.7"),
    "substeps2": ("dense", "dense_substeps2", "DenseGRPO: completion with n = 2 substeps instead of n = t"),
    "tweedie": ("dense", "dense_tweedie", "DenseGRPO: completion with n = 1 (Tweedie) instead of n = t"),
    "tp_balance": ("turning_point_nobal", "turning_point", "TP-GRPO: balancing on instead of off"),
}
COLOURS = {
    "outcome": "black",
    "stepwise": "tab:blue",
    "dense": "tab:orange",
    "turning_point": "tab:green",
    "stepwise_ddim": "tab:cyan",
    "dense_psi": "tab:red",
    "dense_substeps2": "tab:purple",
    "dense_tweedie": "tab:brown",
    "turning_point_nobal": "tab:olive",
}
PRESETS: dict[str, dict[str, Any]] = {
    # the comparison of docs/BENCHMARKS.md: ~2 h on 2 cores (two runs at a time, one thread each)
    "full": {
        "iterations": 100,
        "eval_every": 25,
        "outcome_iterations": None,
        "seeds": [0, 1, 2],
        "ablation_seeds": [0],
    },
    # every code path at tiny settings: a test runs it. Of the ablations, the two whose analysis
    # has code of its own (the SDE gap of the DDIM kernel, the turning points without balancing);
    # the other three share the ablation table's code (their configs are tested in tests/test_flows.py)
    "quick": {
        "iterations": 2,
        "eval_every": 2,  # the base and the end of a 2-iteration run
        "outcome_iterations": 6,
        "seeds": [0, 1],
        "ablation_seeds": [0],
        "ablations": ["ddim_sde", "tp_balance"],
        "set": [
            "run.prompts_per_iteration=2",
            "run.group_size=4",
            "sampler.steps=5",  # the SDE window (steps 0-2) of 5 steps
            "sampler.eval_steps=5",
            "run.eval_prompts=4",
            "run.eval_seeds=1",
            "calibration.rounds=1",
            "calibration.prompts=2",
        ],
    },
    # a CUDA GPU: 8x the trajectories an iteration (64 prompts x 8), every run at once on 16 CPU cores.
    # Sized by estimate to ~10 minutes of one H200 (not yet measured): the tiny model's batches take
    # milliseconds there, so the CPU side (decoding, the rule-based reward, storage) sets the pace.
    "gpu": {
        "iterations": 60,
        "eval_every": 20,
        "outcome_iterations": 180,
        "seeds": [0, 1, 2],
        "ablation_seeds": [0],
        "jobs": 16,
        "set": ["model.device=cuda", "model.max_batch=1024", "run.prompts_per_iteration=64", "optim.micro_batch=512"],
    },
}


# --------------------------------------------------------------------------------- running


@dataclass
class Settings:
    iterations: int
    eval_every: int
    outcome_iterations: int | None  # None: the config's own (300)
    seeds: list[int]
    ablation_seeds: list[int]
    ablations: list[str]  # the keys of ABLATIONS that run
    overrides: list[str]  # applied to every run
    jobs: int
    out: Path


def run_overrides(name: str, s: Settings) -> list[str]:
    """The `--set` overrides of configuration `name` (outcome keeps its config's iterations and
    evaluation period unless told otherwise: the runs of `bench/learning/learning.py` are reused)."""
    own = list(CONFIGS[name][1]) + list(s.overrides)
    if name == "outcome":
        if s.outcome_iterations is not None:
            own += [f"run.iterations={s.outcome_iterations}", f"run.eval_every={s.eval_every}"]
        return own
    return own + [f"run.iterations={s.iterations}", f"run.eval_every={s.eval_every}"]


def train_all(s: Settings, jobs: list[tuple[str, int]], stepgrpo: Stepgrpo) -> None:
    """Every (configuration, seed) that has no finished run yet, `s.jobs` at a time."""

    def one(job: tuple[str, int]) -> None:
        name, seed = job
        out = (s.out / name).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if finished(out, seed, CONFIGS[name][0], run_overrides(name, s)):
            return
        t0 = time.perf_counter()
        run_seed(CONFIGS[name][0], seed, run_overrides(name, s), out, stepgrpo)
        print(f"{name} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)

    # outcome at its config's own settings is exactly bench/learning/learning.py's run: reuse those runs
    learned, mine = OUT_DIR / "learning" / "shapes_outcome", s.out / "outcome"
    if not run_overrides("outcome", s) and learned.is_dir() and not mine.exists():
        mine.symlink_to(learned.resolve(), target_is_directory=True)
        print(f"outcome: reusing bench/learning/learning.py's runs ({relative(learned)})", flush=True)
    with ThreadPoolExecutor(max(1, s.jobs)) as pool:
        list(pool.map(one, jobs))


def finished(out: Path, seed: int, config: str, overrides: list[str]) -> bool:
    """Whether `bench/learning/learning.py`'s timing record of this exact run exists (it is written after
    the run finished)."""
    timing = out / f"seed_{seed}.seconds.json"
    return timing.is_file() and json.loads(timing.read_text()).get("argv") == [config, *overrides]


def evaluate_at(run_dir: Path, iterations: int, out: Path, stepgrpo: Stepgrpo) -> None:
    """Held-out evaluation of a run's checkpoint after `iterations` iterations (`stepgrpo evaluate`,
    same prompts and noise as the run's other evaluations); a no-op when it exists."""
    if (run_dir / "eval" / f"iter_{iterations - 1}.json").is_file():
        return
    log = out / f"evaluate-{run_dir.name}-{iterations}.log"
    rc = stepgrpo.run(["evaluate", str(run_dir), "--iteration", str(iterations - 1)], log)
    if rc != 0:
        raise SystemExit(f"`stepgrpo evaluate {relative(run_dir)}` exited {rc}; see {relative(log)}")


# --------------------------------------------------------------------------------- reading


@dataclass
class Run:
    """One finished run: per-iteration costs and the held-out evaluations (iteration -> record)."""

    name: str
    seed: int
    run_dir: Path
    nfe: list[int]  # transformer forward rows of each iteration: rollout + completion + update
    seconds: list[float]  # training wall seconds of each iteration (evaluations excluded)
    setup_seconds: float  # before iteration 0 (psi calibration)
    train_reward: list[float]
    gains: list[list[float]]  # mean g_k per iteration
    turning: list[dict[str, int]]
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)
    grids: list[Any] = field(default_factory=list)  # reward grids [B, T+1] per iteration (step-level runs)
    trajectories: int = 0  # an iteration's (prompts x group size)
    step_std: list[float] = field(default_factory=list)  # the kernel's std of each step (its grid fixes it)

    def cum_nfe(self, n: int) -> float:
        return float(sum(self.nfe[:n]))

    def cum_seconds(self, n: float) -> float:
        """Training seconds of `n` iterations: `n` times the run's median iteration (robust to other
        load on the machine for a while), plus its set-up (psi calibration)."""
        return self.setup_seconds + n * float(statistics.median(self.seconds))

    def reward(self, n: int) -> float:
        return float(self.evals[n]["reward_mean"])


def read(name: str, seed: int, s: Settings) -> Run:
    from stepgrpo.config import validate_config

    run_dir = (s.out / name / f"seed_{seed}").resolve()
    from stepgrpo.storage import Run as StoredRun

    rec = read_run(run_dir)
    run = StoredRun.open(run_dir)  # the config and the rollout's stds; the rewards came with `rec`
    cfg = validate_config(run.config)
    grids = rec.extra["grids"] if name != "outcome" else []
    return Run(
        name,
        seed,
        run_dir,
        [sum(n.values()) for n in rec.nfe],
        rec.iter_seconds,
        rec.setup_seconds,
        rec.train_reward,
        rec.gains,
        rec.extra.get("turning_points", []),
        read_evals(run_dir),
        grids,
        cfg.run.prompts_per_iteration * cfg.run.group_size,
        run.stages.read_array(0, "rollout", "stds").mean(0).tolist(),
    )


# ------------------------------------------------------------------------------- statistics


def over_seeds(values: list[float]) -> dict[str, float]:
    m, lo, hi = mean_ci(values)
    return {"mean": m, "lo": lo, "hi": hi, "n": len([v for v in values if v == v])}


def matched_iteration(outcome: Run, cost: float, per: str) -> int:
    """The first outcome iteration count whose cumulative cost (`nfe` or `seconds`) reaches `cost`;
    capped at the iterations it ran."""
    total = outcome.cum_nfe if per == "nfe" else outcome.cum_seconds
    n = len(outcome.nfe)
    for i in range(1, n + 1):
        if total(i) >= cost:
            return i
    return n


# --------------------------------------------------------------------------------- analysis


def analyse(runs: dict[tuple[str, int], Run], s: Settings) -> dict[str, Any]:
    N = s.iterations
    seeds = s.seeds
    outcome = {seed: runs["outcome", seed] for seed in seeds}
    out: dict[str, Any] = {
        "iterations": N,
        "seeds": seeds,
        "trajectories": outcome[seeds[0]].trajectories,  # an iteration's
        "pairs": len(outcome[seeds[0]].evals[0]["scores"]),  # held-out prompt x noise pairs of an evaluation
    }

    # equal trajectories: after N iterations
    eq = {}
    for name in MAIN:
        rows = []
        for seed in seeds:
            r = runs[name, seed]
            base, final = r.evals[0], r.evals[N]
            rows.append(
                {
                    "seed": seed,
                    "reward": r.reward(N),
                    "strict": final.get("reward_strict", float("nan")),
                    "gain": paired(base, final)[0],
                    "minus_outcome": paired(outcome[seed].evals[N], final)[0] if name != "outcome" else 0.0,
                    "minus_outcome_pairs": list(paired(outcome[seed].evals[N], final)) if name != "outcome" else None,
                    "nfe": r.cum_nfe(N),
                    "seconds": r.cum_seconds(N),
                }
            )
        eq[name] = {
            "per_seed": rows,
            "reward": over_seeds([x["reward"] for x in rows]),
            "strict": over_seeds([x["strict"] for x in rows]),
            "gain": over_seeds([x["gain"] for x in rows]),
            "minus_outcome": over_seeds([x["minus_outcome"] for x in rows]) if name != "outcome" else None,
            "nfe_per_iteration": over_seeds([x["nfe"] / N for x in rows]),
            "seconds_per_iteration": over_seeds([x["seconds"] / N for x in rows]),
        }
    out["equal_trajectories"] = eq

    # equal compute: outcome at the iteration of equal cumulative NFEs / seconds, per seed
    ec = {}
    for name in STEP_LEVEL:
        entry = {}
        for per in ("nfe", "seconds"):
            rows = []
            for seed in seeds:
                r, o = runs[name, seed], outcome[seed]
                cost = r.cum_nfe(N) if per == "nfe" else r.cum_seconds(N)
                n = matched_iteration(o, cost, per)
                got = o.cum_nfe(n) if per == "nfe" else o.cum_seconds(n)
                rows.append(
                    {
                        "seed": seed,
                        "outcome_iterations": n,
                        "cost": cost,
                        "outcome_cost": got,
                        "outcome_reward": o.reward(n) if n in o.evals else float("nan"),
                        "outcome_gain": paired(o.evals[0], o.evals[n])[0] if n in o.evals else float("nan"),
                        "minus_outcome": paired(o.evals[n], r.evals[N])[0] if n in o.evals else float("nan"),
                    }
                )
            entry[per] = {
                "per_seed": rows,
                "outcome_iterations": over_seeds([x["outcome_iterations"] for x in rows]),
                "cost_fraction": over_seeds([x["outcome_cost"] / x["cost"] for x in rows]),
                "outcome_gain": over_seeds([x["outcome_gain"] for x in rows]),
                "minus_outcome": over_seeds([x["minus_outcome"] for x in rows]),
            }
        ec[name] = entry
    out["equal_compute"] = ec

    # speed: iterations / NFEs / seconds to reach outcome's held-out reward after N and after its last iteration
    speed = {}
    for name in STEP_LEVEL:
        entry = {}
        for label, n_target in (("at_equal_trajectories", N), ("at_outcome_end", None)):
            rows = []
            for seed in seeds:
                r, o = runs[name, seed], outcome[seed]
                nt = n_target or max(o.evals)
                target = o.reward(nt)
                pts = [(float(i), r.reward(i)) for i in sorted(r.evals)]
                # a target at or below the base (outcome did not rise) says nothing about speed
                x = crossing(pts, target) if target > r.reward(0) else None
                rows.append(
                    {
                        "seed": seed,
                        "target_iterations": nt,
                        "target": target,
                        "outcome_rose": target > r.reward(0),
                        "iterations": x,
                        "ratio": (x / nt) if x is not None else None,
                        "nfe": _interp(r.cum_nfe, x),
                        "seconds": _interp(r.cum_seconds, x),
                        "outcome_nfe": o.cum_nfe(nt),
                        "outcome_seconds": o.cum_seconds(nt),
                    }
                )
            reached = [x for x in rows if x["iterations"] is not None]
            entry[label] = {
                "per_seed": rows,
                "reached": len(reached),
                "ratio": over_seeds([x["ratio"] for x in reached]) if len(reached) == len(rows) else None,
                "nfe_ratio": over_seeds([x["nfe"] / x["outcome_nfe"] for x in reached])
                if len(reached) == len(rows)
                else None,
                "seconds_ratio": over_seeds([x["seconds"] / x["outcome_seconds"] for x in reached])
                if len(reached) == len(rows)
                else None,
            }
        speed[name] = entry
    out["speed"] = speed

    # ablations: paired held-out differences per seed (over the held-out pairs) and over seeds
    abl = {}
    for key, (base, changed, what) in ABLATIONS.items():
        rows = []
        for seed in s.ablation_seeds:
            if (base, seed) not in runs or (changed, seed) not in runs:
                continue
            b, c = runs[base, seed], runs[changed, seed]
            d = paired(b.evals[N], c.evals[N])
            rows.append(
                {
                    "seed": seed,
                    "base_gain": paired(b.evals[0], b.evals[N])[0],
                    "changed_gain": paired(c.evals[0], c.evals[N])[0],
                    "difference": d[0],
                    "lo": d[1],
                    "hi": d[2],
                    "seconds_ratio": c.cum_seconds(N) / b.cum_seconds(N),
                    "nfe_ratio": c.cum_nfe(N) / b.cum_nfe(N),
                    "changed_minus_outcome": list(paired(runs["outcome", seed].evals[N], c.evals[N])),
                }
            )
        abl[key] = {"base": base, "changed": changed, "what": what, "per_seed": rows}
        if len(rows) > 1:
            abl[key]["over_seeds"] = over_seeds([x["difference"] for x in rows])
    out["ablations"] = abl

    # DDIM SDE claim: how well each state's ODE completion predicts the SDE sample's reward, per step
    gap = {}
    for name in ("stepwise", "stepwise_ddim"):
        import numpy as np

        rs = [runs[name, seed] for seed in s.ablation_seeds if (name, seed) in runs]
        if not rs:
            continue
        g = np.concatenate([np.stack(r.grids[:N]).reshape(-1, r.grids[0].shape[1]) for r in rs])  # [runs*N*B, T+1]
        final = g[:, -1]
        width = int(np.argmax([np.allclose(g[:, k], final) for k in range(g.shape[1])]))  # first state equal to R_T
        gap[name] = [
            {
                "k": k,
                "abs_gap": float(np.abs(final - g[:, k]).mean()),
                "agree": float((np.abs(final - g[:, k]) < 1e-6).mean()),
                "corr": float(np.corrcoef(final, g[:, k])[0, 1]) if g[:, k].std() > 0 else float("nan"),
                "std": rs[0].step_std[k],  # the kernel's noise at step k, for scale
            }
            for k in range(max(width, 1))
        ]
    out["sde_gap"] = gap

    # turning points per iteration, before and after balancing
    tp = {}
    for name in ("turning_point", "turning_point_nobal"):
        rs = [runs[name, seed] for seed in s.seeds if (name, seed) in runs]
        rows = [t for r in rs for t in r.turning[:N]]
        if rows:
            tp[name] = {
                "raw": sum(t["raw"] for t in rows) / len(rows),
                "kept": sum(t["kept"] for t in rows) / len(rows),
                "none_kept": sum(t["kept"] == 0 for t in rows) / len(rows),
                "iterations": len(rows),
            }
    out["turning_points"] = tp
    return out


def _interp(cum, x: float | None) -> float | None:
    """A cumulative per-iteration cost at a fractional iteration count."""
    if x is None:
        return None
    lo = int(math.floor(x))
    return cum(lo) + (x - lo) * (cum(lo + 1) - cum(lo)) if x > lo else cum(lo)


# ------------------------------------------------------------------------------------ claims


def speed_verdict(entry: dict[str, Any], claimed: float, ran: int) -> str:
    """consistent: every seed reached outcome's reward within `claimed` of outcome's iterations;
    contradicted: every seed needed more (or had not reached it after `ran` iterations, when `ran`
    is at least that many); otherwise, or when outcome did not rise above the base, not resolved."""
    rows = entry["per_seed"]
    if not all(x["outcome_rose"] for x in rows):
        return "not resolved at this scale"
    fast = [x["ratio"] is not None and x["ratio"] <= claimed for x in rows]
    slow = [
        (x["ratio"] is not None and x["ratio"] > claimed)
        or (x["ratio"] is None and ran >= claimed * x["target_iterations"])
        for x in rows
    ]
    if all(fast):
        return "consistent"
    if all(slow):
        return "contradicted"
    return "not resolved at this scale"


def speed_text(entry: dict[str, Any]) -> str:
    rows = entry["per_seed"]
    per = ", ".join(
        ("not reached" if x["outcome_rose"] else "outcome below base") if x["ratio"] is None else f"{x['ratio']:.2f}"
        for x in rows
    )
    mean = ci(entry["ratio"], 2).replace("+", "") if entry["ratio"] else f"{entry['reached']}/{len(rows)} seeds reached"
    return f"iterations / outcome's: {mean} (per seed {per})"


def its(e: dict[str, Any]) -> str:
    """Outcome's iterations at an equal-compute point, per seed."""
    return "/".join(str(x["outcome_iterations"]) for x in e["per_seed"])


def claims(a: dict[str, Any]) -> list[dict[str, str]]:
    N = a["iterations"]
    eq, ec, sp, ab = a["equal_trajectories"], a["equal_compute"], a["speed"], a["ablations"]
    rows: list[dict[str, str]] = []

    def add(paper: str, claim: str, measured: str, v: str) -> None:
        rows.append({"paper": paper, "claim": claim, "measured": measured, "verdict": v})

    for paper, name, speed_claim, fraction in (
        ("Stepwise-Flow-GRPO", "stepwise", "reaches Flow-GRPO's reward in 2-3x fewer iterations", 0.5),
        ("TP-GRPO", "turning_point", "reaches Flow-GRPO's reward in about a third of the steps", 0.4),
        ("DenseGRPO", "dense", None, None),
    ):
        add(
            paper,
            "higher reward than Flow-GRPO at the same iterations",
            f"held-out {name} - outcome after {N} iterations: {ci(eq[name]['minus_outcome'])}",
            verdict(eq[name]["minus_outcome"]),
        )
        for per, what in (("nfe", "transformer NFEs"), ("seconds", "training seconds")):
            e = ec[name][per]
            add(
                paper,
                f"higher reward than Flow-GRPO at equal {what}"
                + (
                    " (shorter wall-clock despite completions)"
                    if paper.startswith("Stepwise") and per == "seconds"
                    else ""
                ),
                f"{name} - outcome after {its(e)} of its iterations "
                f"({e['cost_fraction']['mean']:.2f}x the cost): {ci(e['minus_outcome'])}",
                verdict(e["minus_outcome"]),
            )
        if speed_claim:
            for label, target in (("at_equal_trajectories", f"after {N}"), ("at_outcome_end", "at its end")):
                e = sp[name][label]
                add(paper, f"{speed_claim} (outcome's reward {target})", speed_text(e), speed_verdict(e, fraction, N))

    def one_or_seeds(e: dict[str, Any], key: str, label: str, sign: float = 1.0) -> tuple[str, str]:
        """The measured text and verdict of a paired difference (over seeds when there are several;
        else the one seed's held-out pairs), `sign` -1 for a claim that it is negative."""
        rows_ = e["per_seed"]
        if len(rows_) > 1:
            v = over_seeds([x[key][0] if isinstance(x[key], list) else x[key] for x in rows_])
            text, tail = f"{label} after {N}: {ci(v)} over {v['n']} seeds", ""
        else:
            x = rows_[0]
            m, lo, hi = x[key] if isinstance(x[key], list) else (x["difference"], x["lo"], x["hi"])
            v = {"mean": m, "lo": lo, "hi": hi}
            text, tail = f"{label} after {N}, seed {x['seed']}: {ci(v)} ({a['pairs']} pairs)", " (one training seed)"
        if sign < 0:
            v = {"mean": -v["mean"], "lo": -v["hi"], "hi": -v["lo"]}
        return text, verdict(v) + tail

    for key, paper, claim, against, sign in (
        ("ddim_sde", "Stepwise-Flow-GRPO", "the DDIM SDE trains better than Flow-GRPO's SDE", "base", 1.0),
        ("psi", "DenseGRPO", "calibrated psi beats a uniform noise level", "base", 1.0),
        ("tweedie", "DenseGRPO", "n = 1 completion step (Tweedie) is worse than Flow-GRPO", "outcome", -1.0),
        ("substeps2", "DenseGRPO", "n = 2 completion steps beat Flow-GRPO", "outcome", 1.0),
        ("tweedie", "DenseGRPO", "n = t completion steps beat n = 1", "base", -1.0),
        ("substeps2", "DenseGRPO", "n = t completion steps beat n = 2", "base", -1.0),
        ("tp_balance", "TP-GRPO (authors' code)", "balancing the turning points' signs helps", "base", 1.0),
    ):
        e = ab[key]
        if not e["per_seed"]:
            continue
        if against == "outcome":
            text, v = one_or_seeds(e, "changed_minus_outcome", f"{e['changed']} - outcome", sign)
        else:
            text, v = one_or_seeds(e, "difference", f"{e['changed']} - {e['base']}", sign)
        add(paper, claim, text, v)
    g = a["sde_gap"]
    if "stepwise" in g and "stepwise_ddim" in g:
        flow = " / ".join(f"{r['abs_gap']:.3f}" for r in g["stepwise"])
        ddim = " / ".join(f"{r['abs_gap']:.3f}" for r in g["stepwise_ddim"])
        stds = {k: " / ".join(f"{r['std']:.2f}" for r in g[k]) for k in ("stepwise", "stepwise_ddim")}
        better = all(d["abs_gap"] < f["abs_gap"] for d, f in zip(g["stepwise_ddim"], g["stepwise"]))
        worse = all(d["abs_gap"] > f["abs_gap"] for d, f in zip(g["stepwise_ddim"], g["stepwise"]))
        add(
            "Stepwise-Flow-GRPO",
            "the DDIM SDE's intermediate states give a more faithful reward signal",
            f"mean abs(R(SDE sample) - R(ODE completion of x_k)), k = 0, 1, 2: ddim {ddim}, flow {flow} "
            f"(the steps' noise std: ddim {stds['stepwise_ddim']}, flow {stds['stepwise']})",
            "consistent (every step)" if better else "contradicted (every step)" if worse else "mixed across steps",
        )
    return rows


# ------------------------------------------------------------------------------------ report


def summary_md(a: dict[str, Any], s: Settings, info: dict[str, Any]) -> str:
    N = a["iterations"]
    L = [
        f"settings: {json.dumps(info['settings'])}",
        f"machine: {json.dumps(info['machine'])}",
        "",
        f"### Equal trajectories: after {N} iterations x {a['trajectories']} trajectories "
        f"(95 % t-intervals over {len(s.seeds)} training seeds)",
        "",
        "| scheme | held-out reward | strict | gain over base | minus outcome, paired | NFE / iteration "
        "| s / iteration |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in MAIN:
        e = a["equal_trajectories"][name]
        L.append(
            f"| {name} | {ci(e['reward']).replace('+', '')} | {fmt(e['strict']['mean'], 3, False)} | {ci(e['gain'])} | "
            f"{ci(e['minus_outcome']) if e['minus_outcome'] else 'n/a'} | {e['nfe_per_iteration']['mean']:.0f} | "
            f"{e['seconds_per_iteration']['mean']:.2f} |"
        )
    L += ["", f"Per seed, the paired difference to outcome with its interval over the {a['pairs']} held-out pairs:", ""]
    for name in STEP_LEVEL:
        per = "; ".join(
            f"seed {x['seed']} {fmt(x['minus_outcome_pairs'][0])} [{fmt(x['minus_outcome_pairs'][1])}, "
            f"{fmt(x['minus_outcome_pairs'][2])}]"
            for x in a["equal_trajectories"][name]["per_seed"]
        )
        L.append(f"- {name}: {per}")
    L += [
        "",
        f"### Equal compute: outcome evaluated where its cumulative cost equals the scheme's after {N} iterations",
        "",
        "| scheme | budget | outcome iterations | outcome's cost / scheme's | outcome gain over base "
        "| scheme minus outcome |",
        "|---|---|---|---|---|---|",
    ]
    for name in STEP_LEVEL:
        for per, label in (("nfe", "NFEs"), ("seconds", "seconds")):
            e = a["equal_compute"][name][per]
            L.append(
                f"| {name} | {label} | {', '.join(str(x['outcome_iterations']) for x in e['per_seed'])} | "
                f"{e['cost_fraction']['mean']:.2f} | {ci(e['outcome_gain'])} | {ci(e['minus_outcome'])} |"
            )
    L += [
        "",
        "### Speed: to reach outcome's held-out reward (same seed), from the held-out curve "
        "(linear between evaluations)",
        "",
        "| scheme | outcome's reward | seeds reached | iterations / outcome's | NFEs / outcome's "
        "| seconds / outcome's | per seed (iterations) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in STEP_LEVEL:
        for label, text in (("at_equal_trajectories", f"after {N}"), ("at_outcome_end", "at its end")):
            e = a["speed"][name][label]
            per = ", ".join("-" if x["iterations"] is None else f"{x['iterations']:.0f}" for x in e["per_seed"])
            L.append(
                f"| {name} | {text} ({', '.join(str(x['target_iterations']) for x in e['per_seed'][:1])} it.) | "
                f"{e['reached']}/{len(e['per_seed'])} | "
                + " | ".join(
                    ci(e[k], 2).replace("+", "") if e[k] else "n/a" for k in ("ratio", "nfe_ratio", "seconds_ratio")
                )
                + f" | {per} |"
            )
    L += [
        "",
        f"### Ablations, each against its base configuration (paired, after {N} iterations)",
        "",
        f"| ablation | seed | base gain | changed gain | changed minus base ({a['pairs']} pairs) | NFE ratio "
        "| seconds ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in a["ablations"].values():
        for x in e["per_seed"]:
            L.append(
                f"| {e['what']} | {x['seed']} | {fmt(x['base_gain'])} | {fmt(x['changed_gain'])} | "
                f"{fmt(x['difference'])} [{fmt(x['lo'])}, {fmt(x['hi'])}] | {x['nfe_ratio']:.2f} | "
                f"{x['seconds_ratio']:.2f} |"
            )
        if "over_seeds" in e:
            L.append(f"| {e['what']} | over seeds | | | {ci(e['over_seeds'])} | | |")
    if a["sde_gap"]:
        L += [
            "",
            "### The SDE sample against each state's ODE completion (training rollouts, ablation seeds)",
            "",
            "| kernel | k | step std | mean abs(R_T - R_k) | share equal | correlation |",
            "|---|---|---|---|---|---|",
        ]
        for name, rows in a["sde_gap"].items():
            for r in rows:
                L.append(
                    f"| {name} | {r['k']} | {r['std']:.4f} | {r['abs_gap']:.4f} | {r['agree']:.3f} | {r['corr']:.3f} |"
                )
    if a["turning_points"]:
        L += ["", f"### Turning points per iteration ({a['trajectories']} trajectories)", ""]
        for name, t in a["turning_points"].items():
            L.append(
                f"- {name}: {t['raw']:.1f} found, {t['kept']:.1f} kept; none kept in "
                f"{100 * t['none_kept']:.0f} % of {t['iterations']} iterations (all its seeds)"
            )
    return "\n".join(L) + "\n"


def write_csvs(runs: dict[tuple[str, int], Run], a: dict[str, Any], out: Path) -> None:
    def dump(path: Path, rows: list[dict[str, Any]]) -> None:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows)

    held, curves, gains = [], [], []
    for (name, seed), r in sorted(runs.items()):
        for it in sorted(r.evals):
            e = r.evals[it]
            g = paired(r.evals[0], e) if it else (0.0, 0.0, 0.0)
            held.append(
                {
                    "config": name,
                    "seed": seed,
                    "iteration": it,
                    "nfe": r.cum_nfe(it),
                    "seconds": r.cum_seconds(it),
                    "reward": e["reward_mean"],
                    "strict": e.get("reward_strict", ""),
                    "gain": g[0],
                    "gain_lo": g[1],
                    "gain_hi": g[2],
                    **{f"sub_{k}": v for k, v in e.get("sub", {}).items()},
                }
            )
        for i in range(len(r.nfe)):
            t = r.turning[i] if i < len(r.turning) else {}
            curves.append(
                {
                    "config": name,
                    "seed": seed,
                    "iteration": i + 1,
                    "train_reward": r.train_reward[i],
                    "nfe": r.nfe[i],
                    "seconds": r.seconds[i],
                    "turning_raw": t.get("raw", ""),
                    "turning_kept": t.get("kept", ""),
                }
            )
            for k, g in enumerate(r.gains[i] if i < len(r.gains) else []):
                gains.append({"config": name, "seed": seed, "iteration": i + 1, "k": k, "gain": g})
    dump(out / "heldout.csv", held)
    dump(out / "curves.csv", curves)
    dump(out / "gains.csv", gains)
    dump(
        out / "ablations.csv",
        [
            {"ablation": k, "base": e["base"], "changed": e["changed"], **x}
            for k, e in a["ablations"].items()
            for x in e["per_seed"]
        ],
    )
    dump(out / "sde_gap.csv", [{"config": k, **x} for k, rows in a["sde_gap"].items() for x in rows])


def plots(runs: dict[tuple[str, int], Run], a: dict[str, Any], s: Settings, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # held-out gain over base against iterations, NFEs and seconds: seeds' mean and 95 % interval
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3), sharey=True)
    for name in MAIN:
        rs = [runs[name, seed] for seed in s.seeds]
        its = sorted(set.intersection(*(set(r.evals) for r in rs)))
        if name == "outcome":
            its = [i for i in its if i > 0] and [0, *[i for i in its if i > 0]]
        gains = [[paired(r.evals[0], r.evals[i])[0] if i else 0.0 for r in rs] for i in its]
        m = [over_seeds(g) for g in gains]
        for ax, xs in (
            (axes[0], its),
            (axes[1], [np.mean([r.cum_nfe(i) for r in rs]) / 1e3 for i in its]),
            (axes[2], [np.mean([r.cum_seconds(i) for r in rs]) / 60 for i in its]),
        ):
            y = [v["mean"] for v in m]
            ax.plot(xs, y, marker="o", color=COLOURS[name], label=name)
            lo = [v["lo"] if v["lo"] == v["lo"] else v["mean"] for v in m]
            hi = [v["hi"] if v["hi"] == v["hi"] else v["mean"] for v in m]
            ax.fill_between(xs, lo, hi, color=COLOURS[name], alpha=0.12)
    for ax, label in zip(
        axes,
        (f"iteration ({a['trajectories']} trajectories each)", "transformer NFEs (thousands)", "training minutes"),
    ):
        ax.set_xlabel(label)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axvline(a["iterations"] if ax is axes[0] else np.nan, color="grey", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out gain over the base (paired)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"held-out reward gain, mean and 95 % interval over {len(s.seeds)} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=110)
    plt.close(fig)

    # mean gain per step: iteration bins x steps k of the SDE window, per step-level scheme
    names = [n for n in STEP_LEVEL if all(runs[n, seed].gains and runs[n, seed].gains[0] for seed in s.seeds)]
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
        N = a["iterations"]
        bins = max(1, min(10, N))
        for ax, name in zip(axes[0], names):
            g = np.mean([np.array(runs[name, seed].gains[:N]) for seed in s.seeds], axis=0)  # [N, T]
            moved = (np.abs(g).sum(0) > 0).nonzero()[0]  # steps with any gain (the SDE window)
            width = int(moved.max() + 1) if len(moved) else 1
            edges = np.linspace(0, N, bins + 1).astype(int)
            h = np.stack([g[e0:e1, :width].mean(0) for e0, e1 in zip(edges, edges[1:]) if e1 > e0])
            v = float(np.abs(h).max()) or 1.0
            im = ax.imshow(h, aspect="auto", cmap="RdBu", vmin=-v, vmax=v, origin="lower")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step k (gain R_{k+1} - R_k)")
            ax.set_xticks(range(width))
            ax.set_yticks(range(len(h)))
            ax.set_yticklabels([f"{e0 + 1}-{e1}" for e0, e1 in zip(edges, edges[1:]) if e1 > e0], fontsize=7)
            ax.set_ylabel("iterations")
            fig.colorbar(im, ax=ax, fraction=0.05)
        fig.suptitle(f"mean step gain on the training rollouts ({len(s.seeds)} seeds)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "gain_heatmap.png", dpi=110)
        plt.close(fig)

    rows = [(e["what"].split(": ")[-1], x) for e in a["ablations"].values() for x in e["per_seed"]]
    if rows:
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.55 * len(rows)))
        ys = range(len(rows))
        ax.errorbar(
            [x["difference"] for _, x in rows],
            ys,
            xerr=[[x["difference"] - x["lo"] for _, x in rows], [x["hi"] - x["difference"] for _, x in rows]],
            fmt="o",
            capsize=3,
        )
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{w} (seed {x['seed']})" for w, x in rows], fontsize=8)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel(
            f"held-out reward, changed minus base after {a['iterations']} iterations ({a['pairs']} pairs, 95 %)"
        )
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "ablations.png", dpi=110)
        plt.close(fig)


# -------------------------------------------------------------------------------------- main


def settings(a: argparse.Namespace) -> Settings:
    p = PRESETS["quick" if a.quick else "gpu" if a.gpu else "full"]

    def pick(key: str) -> Any:
        v = getattr(a, key)
        return p.get(key) if v is None else v

    out = a.out or OUT_DIR / (
        "credit_schemes_quick" if a.quick else "credit_schemes_gpu" if a.gpu else "credit_schemes"
    )
    return Settings(
        iterations=pick("iterations"),
        eval_every=pick("eval_every"),
        outcome_iterations=pick("outcome_iterations"),
        seeds=pick("seeds"),
        ablation_seeds=pick("ablation_seeds"),
        ablations=list(p.get("ablations", ABLATIONS)),
        overrides=list(p.get("set", [])) + a.overrides,
        jobs=a.jobs or p.get("jobs", 2),
        out=out.resolve(),
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every path at tiny settings")
    mode.add_argument("--gpu", action="store_true", help="8x the trajectories an iteration on a CUDA GPU")
    ap.add_argument("--iterations", type=int, help="iterations of the step-level runs (the equal-trajectory budget)")
    ap.add_argument("--outcome-iterations", type=int, help="outcome's iterations (default: its config's)")
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--ablation-seeds", type=int, nargs="+")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value on every run")
    ap.add_argument("--jobs", type=int, help="runs at once (one torch thread each)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--report-only", action="store_true", help="read the finished runs and report")
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    s = settings(a)
    if a.gpu and not a.report_only:
        import torch

        if not torch.cuda.is_available():
            ap.error("--gpu needs a CUDA GPU (torch sees none); on a CPU run the default or --quick")
    if s.iterations % s.eval_every:
        ap.error(f"--iterations {s.iterations} is not a multiple of --eval-every {s.eval_every}")
    s.out.mkdir(parents=True, exist_ok=True)
    started = machine()
    jobs = [(n, seed) for seed in s.seeds for n in MAIN]
    chosen = {n for key in s.ablations for n in ABLATIONS[key][:2]} - set(MAIN)
    jobs += [(n, seed) for seed in s.ablation_seeds for n in CONFIGS if n in chosen]
    with contextlib.ExitStack() as stack:  # the warm workers, only when something is computed
        stepgrpo = None if a.report_only else stack.enter_context(Stepgrpo(s.jobs, s.out))
        if stepgrpo:
            train_all(s, jobs, stepgrpo)
        runs = {}
        for name, seed in jobs:
            if not finished(s.out / name, seed, CONFIGS[name][0], run_overrides(name, s)):
                raise SystemExit(f"{name} seed {seed} has not finished: run without --report-only")
            runs[name, seed] = read(name, seed, s)
        # outcome's evaluations at the equal-compute iterations
        pre = analyse_costs(runs, s)
        if stepgrpo:

            def evaluate(job: tuple[int, set[int]]) -> None:
                # one run's evaluations in turn: a run takes one command at a time (its lock)
                seed, its = job
                for n in sorted(its):
                    evaluate_at(runs["outcome", seed].run_dir, n, s.out, stepgrpo)
                    print(f"outcome seed {seed}: evaluated after {n} iterations", flush=True)

            with ThreadPoolExecutor(max(1, s.jobs)) as pool:
                list(pool.map(evaluate, pre.items()))
    for seed in s.seeds:
        runs["outcome", seed].evals = read_evals(runs["outcome", seed].run_dir)
    analysis = analyse(runs, s)
    info = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(s).items() if k != "out"}}
    info["machine"] = {"start": started, "end": machine()}
    table = claims(analysis)
    (s.out / "summary.md").write_text(summary_md(analysis, s, info))
    (s.out / "claims.md").write_text(claims_md(table))
    write_json(s.out / "analysis.json", {**info, **analysis, "claims": table})
    write_csvs(runs, analysis, s.out)
    plots(runs, analysis, s, s.out)
    print((s.out / "summary.md").read_text())
    print((s.out / "claims.md").read_text())
    print(f"wrote {relative(s.out)}/: summary.md, claims.md, analysis.json, CSVs and plots")


def analyse_costs(runs: dict[tuple[str, int], Run], s: Settings) -> dict[int, set[int]]:
    """Per seed, the outcome iteration counts the equal-compute budgets need evaluated."""
    need: dict[int, set[int]] = {}
    for seed in s.seeds:
        o = runs["outcome", seed]
        for name in STEP_LEVEL:
            r = runs[name, seed]
            need.setdefault(seed, set()).update(
                {
                    matched_iteration(o, r.cum_nfe(s.iterations), "nfe"),
                    matched_iteration(o, r.cum_seconds(s.iterations), "seconds"),
                }
            )
        need[seed].add(s.iterations)
    return need


if __name__ == "__main__":
    main()
