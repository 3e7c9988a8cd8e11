"""Step-level credit where the PPO clip binds: the papers' optimizer (several AdamW steps on one
sampled batch, clip 1e-4) against the shipped one (one step, so the ratio is 1 and the clip idle).

Every arm is a shipped recipe plus optimizer overrides, run as a user runs it (`stepgrpo train`,
one torch thread, `run.eval_seeds=8`: 126 held-out prompts x 8 noise seeds every 25 iterations).
Seed S of an arm sees the prompts, initial noise and held-out noise of seed S of every other arm
and of the one-step records already kept (docs/bench/credit_schemes_w9, credit_schemes_cheap), so
arms pair sample by sample with those records, which need no rerun.

Arms (`ARMS`; K = optimizer steps an iteration, c = clip range):
  outcome_w9_k4 / outcome_w9_k2      outcome credit, W = 9, K = 4 / 2, c = 1e-4 (Flow-GRPO's clip)
  dense|stepwise|turning_point_rollout_w9_k4   the step-level schemes on the rollout's own x0
                                     predictions (no extra NFEs), K = 4, c = 1e-4
  outcome_w9_k4_c01                  K = 4 at the shipped clip 0.01 (where the clip never acts)
  outcome_w3_k2 / outcome_w3_k4      the shipped window (W = 3), c = 1e-4
  oracle_w9_k4                       oracle credit (bench/oracle/oracle.py's runner) at K = 4, c = 1e-4, 3 seeds x 50
                                     iterations, read against the one-step oracle at 50
The step-level arms run at K = 4, the setting chosen before this screen by its one-seed probe
(+0.014 [+0.001, +0.027] over K = 1 after 50 iterations); the K = 2 outcome arm says whether that
choice was the better one (the summary prints both).

The decision, fixed before the runs (this file's commit is the pre-registration): for a scheme s,
    DiD = (s - outcome at K = 4, c = 1e-4) - (s - outcome at K = 1, the records)
on the held-out reward after 100 iterations, paired sample by sample within a training seed (the
base cancels). Credit "matters where the clip binds" if the t-interval of DiD over training seeds
lies above 0; the prompt-clustered interval (each prompt's DiD averaged over its noise seeds and
the training seeds, the interval over the 126 prompts) is printed beside it.

The shipped default, fixed before the 300-iteration records of seeds 1-2 (seed 0's was read: +0.013):
outcome_w3_k4 (configs/shapes_outcome_clip.yaml) replaces shapes_outcome.yaml as the recipe the demo and
the README start from if, after shapes_outcome.yaml's 300 iterations (seeds 0-2), its held-out reward
minus shapes_outcome.yaml's, paired by seed (two-level bootstrap), has a mean above 0 and an interval
that does not lie below 0: the 100-iteration win not reversed. shapes_outcome.yaml itself stays the
one-step recipe every kept record names.

Durable state: one record per finished run (`RECORDS/<arm>/seed_<S>.json`: argv, NFEs, seconds,
training rewards, every held-out evaluation's per-sample scores, and the update's clip diagnostics
per iteration). Run directories (`--out`) are scratch. Resumable: a recorded run is skipped.

    .venv/bin/python -m bench.credit_schemes_clip.clip --jobs 2            # the screen (background it; ~10 core-hours)
    .venv/bin/python -m bench.credit_schemes_clip.clip --report-only        # the tables from the records so far
    .venv/bin/python -m bench.credit_schemes_clip.clip --arms outcome_w3_k4 --iterations 300 --seeds 3
    .venv/bin/python -m bench.credit_schemes_clip.clip --arms outcome_w3 --iterations 400
                                     # the shipped recipe's kept records of seeds 3-5 (175 iterations) made
                                     # longer, here (the frontier reads its objectives against them at equal passes)
                                     # the shipped window's candidate over the shipped recipe's 300 iterations
                                     # (read with --report-only --iterations 300 --seeds 3: summary_300.md)
    .venv/bin/python -m bench.credit_schemes_clip.clip --quick --out DIR    # every path at tiny settings
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench._lib.common import ROOT
from bench._lib.runner import FULL, QUICK, Screen, screen, screen_arguments
from bench._lib.stats import by_prompt, pooled

DOCS = ROOT / "docs" / "bench"
RECORDS = DOCS / "credit_schemes_clip" / "runs"
W9 = "configs/shapes_outcome_w9.yaml"
ROLLOUT = ["completion.method=rollout"]
BIND = ["optim.clip_range=0.0001"]

# arm -> (config, overrides, the one-step arm it pairs with)
ARMS: dict[str, tuple[str, list[str], str]] = {
    "outcome_w9_k4": (W9, ["optim.optimizer_steps=4", *BIND], "outcome_w9"),
    "dense_rollout_w9_k4": (
        "configs/shapes_dense_w9.yaml",
        [*ROLLOUT, "optim.optimizer_steps=4", *BIND],
        "dense_rollout_w9",
    ),
    "outcome_w9_k2": (W9, ["optim.optimizer_steps=2", *BIND], "outcome_w9"),
    "stepwise_rollout_w9_k4": (
        "configs/shapes_stepwise_w9.yaml",
        [*ROLLOUT, "optim.optimizer_steps=4", *BIND],
        "stepwise_rollout_w9",
    ),
    "turning_point_rollout_w9_k4": (
        "configs/shapes_turning_point_w9.yaml",
        [*ROLLOUT, "optim.optimizer_steps=4", *BIND],
        "turning_point_rollout_w9",
    ),
    "outcome_w9_k4_c01": (W9, ["optim.optimizer_steps=4"], "outcome_w9"),
    "outcome_w3_k2": ("configs/shapes_outcome.yaml", ["optim.optimizer_steps=2", *BIND], "outcome_w3"),
    "outcome_w3_k4": ("configs/shapes_outcome.yaml", ["optim.optimizer_steps=4", *BIND], "outcome_w3"),
}
# the one-step arms: (config, overrides), where their records are kept (the first that has the seed)
ONE_STEP: dict[str, tuple[str, list[str], list[Path]]] = {
    "outcome_w9": (W9, [], [DOCS / "credit_schemes_w9" / "runs"]),
    "dense_rollout_w9": ("configs/shapes_dense_w9.yaml", ROLLOUT, [DOCS / "credit_schemes_cheap" / "runs"]),
    "outcome_w3": (
        "configs/shapes_outcome.yaml",
        [],
        [DOCS / "credit_schemes_w9" / "runs", DOCS / "credit_schemes_cheap" / "runs"],
    ),
    # not run at one step yet: the DiD of these schemes waits for them (run with --one-step)
    "stepwise_rollout_w9": ("configs/shapes_stepwise_w9.yaml", ROLLOUT, [RECORDS]),
    "turning_point_rollout_w9": ("configs/shapes_turning_point_w9.yaml", ROLLOUT, [RECORDS]),
}
SCHEMES = ("dense_rollout_w9", "stepwise_rollout_w9", "turning_point_rollout_w9")
# the order runs are taken in: the decision's pairs first, seed by seed; then the optimizer's K = 2
# check beside the shipped window at K = 4; then the other schemes (the decision's remaining pairs,
# seed by seed, so a partial screen still pairs); then the rest
PHASES: list[tuple[tuple[str, ...], int]] = [
    (("outcome_w9", "dense_rollout_w9", "outcome_w3"), 6),  # kept records: found, not rerun
    (("outcome_w9_k4", "dense_rollout_w9_k4"), 6),
    (("outcome_w9_k2", "outcome_w3_k4"), 6),  # the K = 2 check, and the candidate for the shipped recipe
    (("stepwise_rollout_w9_k4", "turning_point_rollout_w9_k4", "stepwise_rollout_w9", "turning_point_rollout_w9"), 6),
    (("outcome_w3_k2",), 6),
    (("outcome_w9_k4_c01",), 6),
]
# the oracle where the clip binds (bench/oracle/oracle.py's runner, its 3 seeds x 50 iterations with the K = 4
# overrides), read against the one-step oracle of docs/bench/credit_schemes_oracle at 50 iterations
ORACLE_ARM, ORACLE_ONE_STEP = "oracle_w9_k4", DOCS / "credit_schemes_oracle" / "runs" / "oracle_w9"
ORACLE_SEEDS, ORACLE_ITERATIONS = 3, 50


def recipes() -> dict[str, tuple[str, list[str]]]:
    return {arm: (v[0], v[1]) for arm, v in ARMS.items()} | {arm: v[:2] for arm, v in ONE_STEP.items()}


def settings(a: argparse.Namespace) -> Screen:
    return screen(a, "clip", recipes(), RECORDS, kept={k: v[2] for k, v in ONE_STEP.items()})


def queue(seeds: int | None = None, only: list[str] | None = None) -> list[tuple[str, int]]:
    """The runs in the order they are taken (`only`: just these arms)."""
    jobs = []
    for arms, n in PHASES:
        n = min(n, seeds) if seeds else n
        jobs += [(arm, seed) for seed in range(n) for arm in arms if not only or arm in only]
    return jobs


def update_diagnostics(run_dir: Path) -> dict[str, Any]:
    """The update's clip diagnostics of every iteration (its checkpoint's state), kept in the record."""
    from bench._lib.common import open_run_once

    run = open_run_once(run_dir)
    keep = ("clip_frac", "zero_grad_frac", "clip_frac_later", "zero_grad_frac_later", "approx_kl", "ratio_std")
    rows = []
    for i in range(len(run.iterations("checkpoint"))):
        u = json.loads((run.stage_path(i, "checkpoint") / "state.json").read_text()).get("update", {})
        row = {k: u.get(k) for k in keep}
        for k in ("clip_frac_by_part", "zero_grad_frac_by_part", "clip_frac_later_by_step"):
            row[k] = u.get(k)
        rows.append(row)
    return {"update": rows}


# --------------------------------------------------------------------------------- analysis


def scores(r: dict[str, Any], it: int) -> tuple[list[float], int]:
    e = r["evals"][str(it)]
    return e["scores"], int(e["prompts"])


def contrast(runs: list[tuple[Any, ...]], it: int) -> dict[str, Any] | None:
    """`sum_i w_i * held-out(run_i)` per training seed's sample, for runs `(record, weight)` of one
    seed read at iteration `it` (or `(record, weight, iteration)`, each at its own): the per-seed
    mean, and the per-prompt values (for clustering across seeds). None when they do not pair."""
    total, prompts = None, None
    for r, w, *at in runs:
        key = str(at[0] if at else it)
        if key not in r["evals"]:
            return None
        v, p = scores(r, int(key))
        if (prompts is not None and p != prompts) or (total is not None and len(v) != len(total)):
            return None
        prompts = p
        total = [w * x for x in v] if total is None else [t + w * x for t, x in zip(total, v)]
    assert total is not None and prompts is not None
    per_prompt = by_prompt(total, prompts)
    return {"mean": sum(per_prompt) / len(per_prompt), "prompts": per_prompt}


def analyse(s: Screen, seeds: int = 6) -> dict[str, Any]:
    N = s.iterations
    rec = {(arm, k): r for arm in [*ARMS, *ONE_STEP] for k in range(seeds) if (r := s.load(arm, k))}
    out: dict[str, Any] = {"iterations": N, "arms": {}, "vs_one_step": {}, "credit": {}, "k2_vs_k4": {}}
    for arm in [*ARMS, *ONE_STEP]:
        mine = {k: r for (a, k), r in rec.items() if a == arm}
        if not mine:
            continue
        gains = {k: contrast([(r, 1.0)], N) for k, r in mine.items()}
        base = {k: contrast([(r, 1.0)], 0) for k, r in mine.items()}
        g = {k: {"mean": gains[k]["mean"] - base[k]["mean"]} for k in mine if gains[k] and base[k]}
        clip = [u for r in mine.values() for u in r.get("update", [])[:N]]  # a longer record: its first N
        out["arms"][arm] = {
            "seeds": sorted(mine),
            "gain": {str(k): v["mean"] for k, v in g.items()},
            "nfe_per_iteration": statistics.mean(sum(r["nfe"][:N]) / N for r in mine.values()),
            "seconds_per_iteration": statistics.mean(statistics.median(r["seconds"][:N]) for r in mine.values()),
            "clip": clip_summary(clip),
        }
    out["oracle"] = oracle_did(s, rec)
    for arm, (_, _, ref) in ARMS.items():
        if rows := paired(rec, [(arm, 1), (ref, -1)], seeds, N):
            out["vs_one_step"][f"{arm} - {ref}"] = pooled(rows)
    for scheme in SCHEMES:
        arm = scheme + "_k4"
        if rows := paired(rec, [(arm, 1), ("outcome_w9_k4", -1), (scheme, -1), ("outcome_w9", 1)], seeds, N):
            out["credit"][scheme] = pooled(rows) | {"matters": bool(pooled(rows)["seeds"]["lo"] > 0)}
        if at_k4 := paired(rec, [(arm, 1), ("outcome_w9_k4", -1)], seeds, N):
            out["credit"].setdefault(scheme, {})["at_k4"] = pooled(at_k4)
    if rows := paired(rec, [("outcome_w9_k2", 1), ("outcome_w9_k4", -1)], seeds, N):
        out["k2_vs_k4"] = pooled(rows)
    if rows := paired(rec, [("outcome_w3_k2", 1), ("outcome_w3_k4", -1)], seeds, N):
        out["k2_vs_k4_w3"] = pooled(rows)
    if rows := paired(rec, [("outcome_w9_k4", 1), ("outcome_w9_k4_c01", -1)], seeds, N):
        out["clip_at_k4"] = pooled(rows)  # the clip's own effect: four steps at 1e-4 minus four at 0.01
    out["vs_shipped"] = vs_shipped(s, rec, seeds)
    out["claims"] = claims(s, rec, seeds) if not s.quick else []
    return out


def oracle_records(s: Screen) -> dict[tuple[str, int], dict[str, Any]]:
    """The oracle's records: where the clip binds (this screen's) and at one step (bench/oracle/oracle.py's)."""
    out = {}
    for arm, folder in ((ORACLE_ARM, s.records / ORACLE_ARM), ("oracle_w9", ORACLE_ONE_STEP)):
        for k in range(ORACLE_SEEDS):
            if (p := folder / f"seed_{k}.json").is_file():
                out[(arm, k)] = json.loads(p.read_text())
    return out


def oracle_did(s: Screen, rec: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """(oracle - outcome) where the clip binds minus the same at one step, after 50 iterations (the
    oracle's budget), paired by seed; and the oracle minus outcome at K = 4 alone."""
    both = {**rec, **oracle_records(s)}
    out: dict[str, Any] = {}
    terms = [(ORACLE_ARM, 1), ("outcome_w9_k4", -1), ("oracle_w9", -1), ("outcome_w9", 1)]
    if rows := paired(both, terms, ORACLE_SEEDS, ORACLE_ITERATIONS):
        out["did"] = pooled(rows)
    if rows := paired(both, [(ORACLE_ARM, 1), ("outcome_w9_k4", -1)], ORACLE_SEEDS, ORACLE_ITERATIONS):
        out["at_k4"] = pooled(rows)
    return out


def train_oracle(s: Screen, seed: int) -> None:
    """One oracle run where the clip binds (bench/oracle/oracle.py's runner: its own process and server)."""
    from bench._lib.oracle import PRESETS, train

    p = dict(PRESETS["full"])
    p["set"] = [*p["set"], "optim.optimizer_steps=4", *BIND]
    train(p, seed, s.out / ORACLE_ARM, s.records, ORACLE_ARM)


def paired(
    rec: dict[tuple[str, int], dict[str, Any]], terms: list[tuple[str, float]], seeds: int, it: int
) -> dict[int, dict[str, Any]]:
    """`contrast` of the arms `terms` (arm, weight) for every seed all of them have, by seed."""
    rows = {}
    for k in range(seeds):
        if all((arm, k) in rec for arm, _ in terms):
            if c := contrast([(rec[arm, k], w) for arm, w in terms], it):
                rows[k] = c
    return rows


def vs_shipped(s: Screen, rec: dict[tuple[str, int], dict[str, Any]], seeds: int) -> dict[str, Any]:
    """Each W9 arm after N minus the shipped recipe (`outcome_w3`, one step) at equal transformer
    NFEs: outcome_w3 read at its evaluation nearest the arm's cumulative NFEs (the ratio is kept)."""
    N, out = s.iterations, {}
    for arm in ("outcome_w9_k4", "outcome_w9_k2", "dense_rollout_w9_k4", "outcome_w9"):
        rows, ratios = {}, []
        for k in range(seeds):
            if (arm, k) not in rec or ("outcome_w3", k) not in rec:
                continue
            a, o = rec[arm, k], rec["outcome_w3", k]
            cost = sum(a["nfe"][:N])
            its = [int(i) for i in o["evals"] if int(i) > 0]
            near = min(its, key=lambda i: abs(sum(o["nfe"][:i]) - cost))
            if (c := contrast([(a, 1), (o, -1, near)], N)) is None:
                continue
            rows[k] = c
            ratios.append((near, sum(o["nfe"][:near]) / cost))
        if rows:
            out[f"{arm} - outcome_w3"] = pooled(rows) | {"read_at": ratios}
    return out


# claims v4: each paper's "higher reward than Flow-GRPO at the same iterations" read three ways:
# v2 the paper's own completion at one optimizer step (docs/bench/credit_schemes_w9), v3 the rollout's
# own x0 predictions at one step (0 extra NFEs), v4 the same where the clip binds (K = 4, clip 1e-4);
# at rollout step rewards equal iterations are equal NFEs (within 2 %)
PAPERS = {
    "stepwise": "Stepwise-Flow-GRPO",
    "turning_point": "TP-GRPO",
    "dense": "DenseGRPO",
}
V2_RECORDS = DOCS / "credit_schemes_w9" / "runs"


def claims(s: Screen, rec: dict[tuple[str, int], dict[str, Any]], seeds: int) -> list[dict[str, Any]]:
    """Per scheme the three readings: the mean over seeds, the t-interval over seeds, the
    prompt-clustered interval and the two-level bootstrap, and a verdict by the bootstrap
    (consistent / contradicted when it lies on one side of 0, else not resolved; fewer than 3
    seeds: too few seeds). The t-interval over 3 seeds says how close three numbers fell, not how
    sure the difference is (docs/bench/credit_schemes_w9/audit.md)."""
    rows = []
    for scheme, paper in PAPERS.items():
        row: dict[str, Any] = {"paper": paper, "scheme": scheme}
        v2 = {}
        for k in range(seeds):
            a, o = V2_RECORDS / f"{scheme}_w9" / f"seed_{k}.json", V2_RECORDS / "outcome_w9" / f"seed_{k}.json"
            if a.is_file() and o.is_file():
                ra, ro = json.loads(a.read_text()), json.loads(o.read_text())
                if c := contrast([(ra, 1), (ro, -1)], s.iterations):
                    v2[k] = c
        pairs = {
            "v3": (f"{scheme}_rollout_w9", "outcome_w9"),
            "v4": (f"{scheme}_rollout_w9_k4", "outcome_w9_k4"),
        }
        for name, rows_of in (("v2", v2), *((n, None) for n in pairs)):
            if rows_of is None:
                arm, ref = pairs[name]
                rows_of = paired(rec, [(arm, 1), (ref, -1)], seeds, s.iterations)
            if not rows_of:
                row[name] = None
                continue
            v = pooled(rows_of)
            b = v["bootstrap"]
            verdict = (
                "too few seeds"
                if v["n"] < 3
                else "consistent"
                if b["lo"] > 0
                else "contradicted"
                if b["hi"] < 0
                else "not resolved"
            )
            row[name] = v | {"verdict": verdict}
        rows.append(row)
    return rows


def claims_md(rows: list[dict[str, Any]], iterations: int) -> str:
    from bench._lib.stats import ci

    def cell(v: dict[str, Any] | None) -> str:
        if v is None:
            return "not measured yet | "
        seeds = ci(v["seeds"]) if v["seeds"]["lo"] == v["seeds"]["lo"] else f"{v['seeds']['mean']:+.003f}"
        boot = ci(v["bootstrap"]) if v["bootstrap"]["lo"] == v["bootstrap"]["lo"] else "n/a"
        return f"{boot} (two-level; seeds t {seeds}, {v['n']} seeds) | {v['verdict']}"

    L = [
        "| paper | claim | v2: paper's completion, 1 step | verdict | v3: rollout, 1 step | verdict "
        "| v4: rollout, K = 4, clip 1e-4 | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        L.append(
            f"| {r['paper']} | higher reward than Flow-GRPO after {iterations} iterations (its optimizer alike) "
            f"| {cell(r['v2'])} | {cell(r['v3'])} | {cell(r['v4'])} |"
        )
    return "\n".join(L) + "\n"


def clip_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over iterations: the clip fraction of each optimizer step of an iteration, the share of
    rows with no gradient after the first step, and per trained step after the first."""

    def mean_list(key: str) -> list[float]:
        lists = [r[key] for r in rows if r.get(key)]
        if not lists:
            return []
        n = max(len(x) for x in lists)
        cols = [[x[i] for x in lists if i < len(x) and x[i] is not None] for i in range(n)]
        return [sum(c) / len(c) if c else float("nan") for c in cols]

    later = [r["zero_grad_frac_later"] for r in rows if r.get("zero_grad_frac_later") is not None]
    return {
        "clip_frac_by_part": mean_list("clip_frac_by_part"),
        "zero_grad_frac_by_part": mean_list("zero_grad_frac_by_part"),
        "clip_frac_later_by_step": mean_list("clip_frac_later_by_step"),
        "zero_grad_frac_later": sum(later) / len(later) if later else float("nan"),
    }


def summary_md(a: dict[str, Any]) -> str:
    from bench._lib.stats import ci, fmt

    def iv(v: dict[str, float]) -> str:
        return ci(v) if v.get("lo") == v.get("lo") else fmt(v["mean"]) + " (one seed)"

    N = a["iterations"]
    L = [f"# Credit where the PPO clip binds: {N} iterations, W = 9 unless named", ""]
    L += [
        "## Arms",
        "",
        "| arm | seeds | held-out gain per seed | NFEs / it | s / it | clip fraction by optimizer step "
        "| no gradient, later steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, v in a["arms"].items():
        gains = ", ".join(f"{fmt(x)} (s{k})" for k, x in v["gain"].items())
        c = v["clip"]
        parts = " / ".join(fmt(x, 2, sign=False) for x in c["clip_frac_by_part"]) or "n/a"
        cost = f"{v['nfe_per_iteration']:.0f} | {v['seconds_per_iteration']:.1f}"
        zero = fmt(c["zero_grad_frac_later"], 2, sign=False)
        L.append(f"| {arm} | {len(v['seeds'])} | {gains} | {cost} | {parts} | {zero} |")
    L += ["", "## Each optimizer setting minus the one-step recipe (same seed, equal trajectories and NFEs)", ""]
    L += ["| contrast | seeds | over seeds (t) | clustered by prompt | two-level bootstrap |", "|---|---|---|---|---|"]
    for name, v in a["vs_one_step"].items():
        boot = ci(v["bootstrap"]) if v["bootstrap"]["lo"] == v["bootstrap"]["lo"] else "n/a"
        L.append(f"| {name} | {v['n']} | {iv(v['seeds'])} | {ci(v['prompts'])} | {boot} |")
    for key, what in (
        ("k2_vs_k4", "K = 2 minus K = 4 (clip 1e-4, W = 9)"),
        ("k2_vs_k4_w3", "K = 2 minus K = 4 (clip 1e-4, W = 3)"),
        ("clip_at_k4", "at K = 4, clip 1e-4 minus clip 0.01 (W = 9)"),
    ):
        if v := a.get(key):
            L += ["", f"Outcome {what}: {iv(v['seeds'])} over {v['n']} seeds, {ci(v['prompts'])} by prompt."]
    L += ["", "## The decision: (scheme - outcome) at K = 4, clip 1e-4, minus the same at K = 1", ""]
    L += [
        "| scheme | seeds | scheme - outcome at K = 4 | DiD over seeds (t) | DiD by prompt "
        "| credit matters where the clip binds |",
        "|---|---|---|---|---|---|",
    ]
    for scheme, v in a["credit"].items():
        k4 = v.get("at_k4")
        k4s = f"{iv(k4['seeds'])} ({k4['n']} seeds)" if k4 else "n/a"
        if "seeds" in v:
            verdict = "yes" if v["matters"] else ("no (interval below 0)" if v["seeds"]["hi"] < 0 else "not shown")
            L.append(f"| {scheme} | {v['n']} | {k4s} | {iv(v['seeds'])} | {ci(v['prompts'])} | {verdict} |")
        else:
            L.append(f"| {scheme} | 0 | {k4s} | waits for its one-step runs | | |")
    o = a.get("oracle") or {}
    L += ["", f"## The oracle where the clip binds ({ORACLE_ITERATIONS} iterations, Monte-Carlo true advantages)", ""]
    if "did" in o:
        L += ["| contrast | seeds | over seeds (t) | by prompt |", "|---|---|---|---|"]
        L.append(f"| (oracle - outcome) at K = 4 minus at K = 1 | {o['did']['n']} | {iv(o['did']['seeds'])} | "
                 f"{ci(o['did']['prompts'])} |")  # fmt: skip
        if "at_k4" in o:
            L.append(f"| oracle - outcome, both at K = 4 | {o['at_k4']['n']} | {iv(o['at_k4']['seeds'])} | "
                     f"{ci(o['at_k4']['prompts'])} |")  # fmt: skip
    elif N != FULL["iterations"]:  # the oracle pairs with the K = 4 arm's records at the screen's length
        L.append(f"Read with the screen's {FULL['iterations']} iterations (`summary.md`), not at {N}.")
    else:
        L.append(
            f"Not run yet: `bench/credit_schemes_clip/clip.py` trains `{ORACLE_ARM}` after the other arms "
            f"({ORACLE_SEEDS} seeds)."
        )
    if a.get("vs_shipped"):
        L += ["", "## Against the shipped recipe (outcome_w3, one step) at equal transformer NFEs", ""]
        L += ["| contrast | seeds | outcome_w3 read at (its NFEs / the arm's) | two-level bootstrap | over seeds (t) |"]
        L += ["|---|---|---|---|---|"]
        for name, v in a["vs_shipped"].items():
            at = ", ".join(f"{i} ({r:.2f}x)" for i, r in v["read_at"])
            boot = ci(v["bootstrap"]) if v["bootstrap"]["lo"] == v["bootstrap"]["lo"] else "n/a"
            L.append(f"| {name} | {v['n']} | {at} | {boot} | {iv(v['seeds'])} |")
    if a.get("claims"):
        L += ["", "## Claims v4", "", claims_md(a["claims"], N)]
    L += [
        "",
        "Seconds an iteration are as timed, beside other work (2 runs at once, tests): they do not compare "
        "across arms; transformer NFEs do (every arm here costs the same NFEs an iteration within 2 %).",
    ]
    return "\n".join(L) + "\n"


def main() -> None:
    a = screen_arguments(__doc__.split("\n\n")[0], [*ARMS, *ONE_STEP, ORACLE_ARM]).parse_args()
    s = settings(a)
    seeds = a.seeds or (1 if a.quick else 6)
    if not a.report_only:
        if jobs := queue(seeds, a.arms):
            s.run(jobs, a.jobs, extra=update_diagnostics)
        if not a.quick and (not a.arms or ORACLE_ARM in a.arms):  # the oracle where the clip binds, a run at a time
            from bench._lib.oracle import ORACLE
            from stepgrpo_core.registry import allow

            allow(ORACLE)
            for seed in range(min(seeds, ORACLE_SEEDS)):
                train_oracle(s, seed)
    analysis = analyse(s, seeds)
    # another length (the 300-iteration check of the shipped window) is read into files of its own
    tag = "" if s.iterations == (QUICK if a.quick else FULL)["iterations"] else f"_{s.iterations}"
    s.report(analysis, summary_md(analysis), tag)


if __name__ == "__main__":
    main()
