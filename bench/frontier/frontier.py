"""The efficiency frontier on the shipped model: DiffusionNFT and AWM as update objectives
(`update.objective`), with outcome credit (the papers' form) and with step-level credit inside them
(dense@rollout: each (sample, time) row weighted by the advantage of the step at its grid time),
against the best GRPO recipe per unit of compute (`shapes_outcome.yaml`, W3) and dense@rollout at
W9, at equal compute and at equal trajectories.

Every arm is a shipped recipe plus overrides, run as a user runs it (`stepgrpo train`, one torch
thread, `run.eval_seeds=8`: 126 held-out prompts x 8 noise seeds every 25 iterations), 100
iterations. Seed S of an arm sees the prompts and held-out noise of seed S of every other arm and of
the GRPO records already kept (docs/bench/credit_schemes_w9, credit_schemes_cheap), which need no
rerun; the initial noise differs where a recipe gives each image its own (`sampler.shared_x0:
false`), so pairs are by prompt, not by sample.

Compute is counted in forward-equivalent transformer passes (`stepgrpo.reporting.costs`: every
forward of every stage plus 2 a backward row), stored per stage as each run ran them; a GRPO
record stored before that has its passes rebuilt from what its config ran (`rebuilt_passes`: its
NFEs left out the ODE reference, which an earlier reading also left uncharged, 240 passes an
iteration too few).

Probes (the tuning budget every shapes recipe got: two 50-iteration runs on training seed 0, the
rule fixed before them: keep the authors' setting unless the other beats it by more than the
probe's interval half-width, ~0.045):
  nft: beta 1 (the authors' GenEval) against beta 0.1 (their OCR / multi-reward setting)
  awm: the authors' KL weights (1e-3 to the base, 1 to the EMA adapter) against none (the GRPO
       recipes' kl_beta 0)

The decision, fixed before the runs (this file's commit is the pre-registration):
  - an objective beats GRPO per unit of compute if its held-out gain minus outcome_w3's, read at
    equal passes, has a prompt-clustered interval above 0 (t-interval over seeds beside it);
  - step credit helps an objective if (objective + dense@rollout) minus the objective after 100
    iterations (equal trajectories and, at rollout step rewards, equal passes within 2 %) has an
    interval above 0.
  - the papers' speed claims (DiffusionNFT "up to 25x Flow-GRPO", AWM "up to 24x"): the ratio of
    the passes outcome_w3 needs to reach the objective's held-out reward after 100 iterations to
    the passes the objective spent, per seed (the first outcome_w3 evaluation at or above it; a
    lower bound when outcome_w3 never reaches it within its record).

Added after seed 0 of the decision, outside the rule: nft with stepwise@rollout (3 seeds), to test
why dense@rollout hurt inside nft (its per-step normalization; docs/bench/frontier/README.md).

The one update loop's round (rule fixed in this commit, before any of its runs finished): the
GRPO records' passes rebuilt from what their configs ran (the ODE reference the first reading left
uncharged), and three arms of 6 seeds, 100 iterations: `dgpo` (configs/shapes_dgpo.yaml, the
authors' settings, no probe), and `nft_authors` / `awm_authors` (the shipped recipes now: samples
with all-zero advantages trained, AWM's images each from their own noise without an ODE reference).
  - DGPO beats a GRPO recipe (outcome_w3, the clip recipe outcome_w3_k4) per unit of compute if its
    gain minus the recipe's at equal passes has a prompt-clustered interval above 0;
  - the pick between two objectives is read at equal passes (the second at its evaluation nearest
    the first's passes, within 15 %): one is picked over the other only if the interval of the
    difference is above 0; else the two tie and the README says so;
  - the departures matter if `nft_authors - nft` or `awm_authors - awm` (equal trajectories) has an
    interval away from 0; either way the frontier's reading of the objectives uses the authors' arms
    once their 6 seeds are in.

Durable state: one record per finished run (`RECORDS/<arm>/seed_<S>.json`). Resumable.

    .venv/bin/python -m bench.frontier.frontier --probes --jobs 2       # the probes (4 runs, seed 0)
    .venv/bin/python -m bench.frontier.frontier --jobs 2                # the decision (background it)
    .venv/bin/python -m bench.frontier.frontier --arms dgpo             # one arm's seeds
    .venv/bin/python -m bench.frontier.frontier --report-only           # tables from the records so far
    .venv/bin/python -m bench.frontier.frontier --quick --out DIR       # every path at tiny settings
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench._lib.common import ROOT
from bench._lib.compute import (
    at_equal_compute,
    contrast,
    fmt_pooled,
    grpo_passes,
    reference_passes,
)
from bench._lib.runner import Screen, screen, screen_arguments
from bench._lib.stats import pooled

DOCS = ROOT / "docs" / "bench"
RECORDS = DOCS / "frontier" / "runs"
NFT, AWM, DGPO = "configs/shapes_nft.yaml", "configs/shapes_awm.yaml", "configs/shapes_dgpo.yaml"
DENSE = ["completion.method=rollout", "credit.scheme=dense"]
# What the decision's records ran, spelled out since the recipes moved to the authors' ways (samples
# whose advantages are all zero trained; AWM's images each from their own noise, no ODE reference,
# its clip default 1): the records' argv carry these, so they read as what they are.
AS_RECORDED = {
    NFT: ["update.zero_advantage=drop"],
    AWM: [
        "update.zero_advantage=drop",
        "sampler.shared_x0=true",
        "sampler.ode_reference=true",
        "update.options.clip_range=0.0001",
    ],
}

# arm -> (config, overrides)
ARMS: dict[str, tuple[str, list[str]]] = {
    "nft": (NFT, AS_RECORDED[NFT]),
    "awm": (AWM, AS_RECORDED[AWM]),
    "nft_dense_rollout": (NFT, [*AS_RECORDED[NFT], *DENSE]),
    "awm_dense_rollout": (AWM, [*AS_RECORDED[AWM], *DENSE]),
    # after the decision, an explanation to test (not part of the rule): dense normalizes each step's
    # gains to unit scale, so steps that barely change the image weigh as much as the decisive ones;
    # Stepwise-Flow-GRPO's one normalization over all steps keeps their relative scale
    "nft_stepwise_rollout": (NFT, [*AS_RECORDED[NFT], "completion.method=rollout", "credit.scheme=stepwise"]),
    # the one update loop's round: the recipes as their authors run them, and DGPO
    "nft_authors": (NFT, []),
    "awm_authors": (AWM, []),
    "dgpo": (DGPO, []),
}
PROBES: dict[str, tuple[str, list[str]]] = {
    "nft_beta01": (NFT, [*AS_RECORDED[NFT], "update.options.beta=0.1"]),
    "awm_no_kl": (AWM, [*AS_RECORDED[AWM], "update.options.kl_beta=0.0", "update.options.ema_beta=0.0"]),
}
PROBE_OF = {"nft_beta01": "nft", "awm_no_kl": "awm"}
PROBE_ITERATIONS, PROBE_RULE = 50, 0.045
# the GRPO records this compares with: (config, overrides), where they are kept
GRPO: dict[str, tuple[str, list[str], list[Path]]] = {
    "outcome_w3": (
        "configs/shapes_outcome.yaml",
        [],
        # the clip screen's first: it holds the records of seeds 3-5 made longer (400 iterations)
        [
            DOCS / "credit_schemes_clip" / "runs",
            DOCS / "credit_schemes_w9" / "runs",
            DOCS / "credit_schemes_cheap" / "runs",
        ],
    ),
    "dense_rollout_w9": ("configs/shapes_dense_w9.yaml", DENSE[:1], [DOCS / "credit_schemes_cheap" / "runs"]),
    # the best GRPO recipe per NFE the optimizer screen found (configs/shapes_outcome_clip.yaml: four
    # AdamW steps a batch, clip 1e-4), read beside the pre-registered outcome_w3 (added after the rule)
    "outcome_w3_k4": (
        "configs/shapes_outcome.yaml",
        ["optim.optimizer_steps=4", "optim.clip_range=0.0001"],
        [DOCS / "credit_schemes_clip" / "runs"],
    ),
}
# the GRPO recipes read at equal compute (their passes as run, or rebuilt: `grpo_passes`)
AT_EQUAL_COMPUTE = ("outcome_w3", "outcome_w3_k4")
# the recipes as their authors run them against the decision's records (the rule: "the departures")
DEPARTURES = [("nft_authors", "nft"), ("awm_authors", "awm")]
# the objectives read against each other at equal passes (the first read at its evaluations, the
# second at its evaluation nearest in passes): the pick between them rests on these
BETWEEN = [
    ("awm", "nft"),
    ("awm_authors", "nft_authors"),
    ("dgpo", "awm_authors"),
    ("dgpo", "nft_authors"),
    # beside the authors' arms, against the decision's records (6 seeds each)
    ("dgpo", "awm"),
    ("dgpo", "nft"),
]
# the order runs are taken in: seed 0 of the two objectives first (they are also the probes'
# references), then the probes, then the decision's arms seed by seed (a partial screen still pairs)
PHASES: list[tuple[tuple[str, ...], int]] = [
    (("nft", "awm"), 1),
    (("nft_beta01", "awm_no_kl"), 1),
    (("nft", "awm", "nft_dense_rollout", "awm_dense_rollout"), 6),
    (("nft_stepwise_rollout",), 3),
    (("dgpo", "awm_authors", "nft_authors"), 6),
]
CLAIMED = {"nft": ("DiffusionNFT", 25.0), "awm": ("AWM", 24.0), "dgpo": ("DGPO", 20.0)}


def settings(a: argparse.Namespace) -> Screen:
    recipes = {**ARMS, **PROBES} | {arm: v[:2] for arm, v in GRPO.items()}
    kept = {k: v[2] for k, v in GRPO.items()}
    return screen(a, "frontier", recipes, RECORDS, kept, iterations_of={arm: PROBE_ITERATIONS for arm in PROBES})


def queue(seeds: int, probes_only: bool = False, only: list[str] | None = None) -> list[tuple[str, int]]:
    jobs: list[tuple[str, int]] = []
    for arms, n in PHASES[:2] if probes_only else PHASES:
        jobs += [(arm, k) for k in range(min(n, seeds)) for arm in arms if (arm, k) not in jobs]
    return [(arm, k) for arm, k in jobs if only is None or arm in only]


# --------------------------------------------------------------------------------- analysis


def speedup(a: dict[str, Any], o: dict[str, Any], N: int) -> tuple[float, bool] | None:
    """Passes outcome needs to first reach `a`'s held-out reward after N, over `a`'s passes; and
    whether it is a lower bound (outcome never reached it within its record)."""
    e = a["evals"].get(str(N))
    if e is None:
        return None
    target, spent = float(e["reward_mean"]), sum(a["passes"][:N])
    p = grpo_passes(o)
    for i in sorted(int(k) for k in o["evals"] if int(k) > 0):
        if float(o["evals"][str(i)]["reward_mean"]) >= target:
            return sum(p[:i]) / spent, False
    return sum(p) / spent, True


def analyse(s: Screen, seeds: int = 6) -> dict[str, Any]:

    N = s.iterations
    names = [*ARMS, *PROBES, *GRPO]
    rec = {(arm, k): r for arm in names for k in range(seeds) if (r := s.load(arm, k))}
    out: dict[str, Any] = {"iterations": N, "arms": {}, "probes": {}, "equal_trajectories": {}}
    out |= {"equal_compute": {}, "equal_compute_net": {}, "between": {}, "departures": {}, "credit": {}, "speed": {}}
    for arm in [*ARMS, *PROBES]:
        mine = {k: r for (a, k), r in rec.items() if a == arm}
        if not mine:
            continue
        n = PROBE_ITERATIONS if arm in PROBES and not s.quick else N
        gains = {k: c["mean"] for k, r in mine.items() if (c := contrast(r, n, None, 0))}
        out["arms"][arm] = {
            "seeds": sorted(mine),
            "gain": {str(k): v for k, v in gains.items()},
            "passes_per_iteration": statistics.mean(sum(r["passes"][:n]) / n for r in mine.values()),
            "seconds_per_iteration": statistics.mean(statistics.median(r["seconds"][:n]) for r in mine.values()),
        }
    for probe, ref in PROBE_OF.items():
        n = PROBE_ITERATIONS if not s.quick else N
        if (probe, 0) in rec and (ref, 0) in rec and (c := contrast(rec[probe, 0], n, rec[ref, 0], n)):
            from stepgrpo.reporting.report import mean_interval

            m, lo, hi = mean_interval(c["prompts"])
            out["probes"][f"{probe} - {ref}"] = {"mean": m, "lo": lo, "hi": hi, "switch": m > PROBE_RULE}
    for arm in ARMS:
        for ref in GRPO:
            rows = {}
            for k in range(seeds):
                if (arm, k) in rec and (ref, k) in rec and (c := contrast(rec[arm, k], N, rec[ref, k], N)):
                    rows[k] = c
            if rows:
                out["equal_trajectories"][f"{arm} - {ref}"] = pooled(rows)
        # equal compute: the arm at its latest evaluation that the GRPO record reaches in passes
        for ref in AT_EQUAL_COMPUTE:
            if v := at_equal_compute(rec, arm, ref, seeds, s.eval_every, N):
                out["equal_compute"][f"{arm} - {ref}"] = v
            # where some seeds' GRPO records end sooner (the clip recipe's seeds run on to 300 in
            # part): the latest evaluation that those which reach it read, beside
            some = at_equal_compute(rec, arm, ref, seeds, s.eval_every, N, every_seed=False)
            if some and (v is None or some["at"] > v["at"]):
                out["equal_compute"][f"{arm} - {ref} (the seeds whose record reaches)"] = some
            less = (reference_passes(s.argv(arm)), reference_passes(s.argv(ref)))
            if any(less) and (v := at_equal_compute(rec, arm, ref, seeds, s.eval_every, N, less)):
                out["equal_compute_net"][f"{arm} - {ref}"] = v | {"less": list(less)}
        o_rows = {k: sp for k in range(seeds) if (arm, k) in rec and ("outcome_w3", k) in rec
                  if (sp := speedup(rec[arm, k], rec["outcome_w3", k], N))}  # fmt: skip
        if o_rows:
            out["speed"][arm] = {str(k): {"ratio": round(v[0], 3), "lower_bound": v[1]} for k, v in o_rows.items()}
    for arm, ref in BETWEEN:
        if v := at_equal_compute(rec, arm, ref, seeds, s.eval_every, N, every_seed=False):
            out["between"][f"{arm} - {ref}"] = v
    for arm, ref in DEPARTURES:  # the authors' ways against the decision's records, same seeds and trajectories
        rows = {k: c for k in range(seeds) if (arm, k) in rec and (ref, k) in rec
                if (c := contrast(rec[arm, k], N, rec[ref, k], N))}  # fmt: skip
        if rows:
            out["departures"][f"{arm} - {ref}"] = pooled(rows)
    for name, obj, arm in (
        ("nft", "nft", "nft_dense_rollout"),
        ("awm", "awm", "awm_dense_rollout"),
        ("nft, stepwise@rollout", "nft", "nft_stepwise_rollout"),
    ):
        rows = {}
        for k in range(seeds):
            if (arm, k) in rec and (obj, k) in rec and (c := contrast(rec[arm, k], N, rec[obj, k], N)):
                rows[k] = c
        if rows:
            v = pooled(rows)
            out["credit"][name] = v | {"helps": bool(v["prompts"]["lo"] > 0)}
    out["claims"] = claims(out)
    return out


def claims(a: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for obj, (paper, factor) in CLAIMED.items():
        sp = a["speed"].get(obj)
        ec = a["equal_compute"].get(f"{obj} - outcome_w3")
        cr = a["credit"].get(obj)
        if not sp:
            rows.append({"paper": paper, "claim": f"up to {factor:g}x Flow-GRPO", "verdict": "no records yet"})
            continue
        ratios = [v["ratio"] for v in sp.values()]
        bound = any(v["lower_bound"] for v in sp.values())
        speed = f"{min(ratios):.2f}-{max(ratios):.2f}x{' (lower bounds)' if bound else ''} over {len(ratios)} seeds"
        verdict = "consistent" if min(ratios) >= factor else "not reached" if max(ratios) < factor else "mixed"
        if ec:
            p = ec["prompts"]
            gain = f"{p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] at {ec['at']} iterations"
        else:
            gain = "n/a"
        credit = (
            f"{cr['prompts']['mean']:+.3f} [{cr['prompts']['lo']:+.3f}, {cr['prompts']['hi']:+.3f}]" if cr else "n/a"
        )
        rows.append(
            {
                "paper": paper,
                "claim": f"up to {factor:g}x Flow-GRPO",
                "speed": speed,
                "verdict": verdict,
                "equal_compute": gain,
                "step_credit": credit,
            }
        )
    return rows


def summary_md(a: dict[str, Any]) -> str:
    N = a["iterations"]
    lines = [f"### The frontier after {N} iterations (held-out gain over each run's base, 126 prompts x 8 seeds)", ""]
    lines += ["| arm | seeds | gain per seed | passes / iteration | s / iteration (median) |", "|---|---|---|---|---|"]
    for arm, v in a["arms"].items():
        g = ", ".join(f"{x:+.3f}" for x in v["gain"].values())
        lines.append(
            f"| {arm} | {len(v['seeds'])} | {g} | {v['passes_per_iteration']:.0f} | {v['seconds_per_iteration']:.2f} |"
        )
    lines += ["", "#### Probes (seed 0, 50 iterations; switch if the difference exceeds +0.045)", ""]
    for name, v in a["probes"].items():
        verdict = "switch" if v["switch"] else "keep the authors' setting"
        lines.append(f"- {name}: {v['mean']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]: {verdict}")
    lines += ["", "#### Equal trajectories (both after the same iterations; prompt-clustered interval)", ""]
    lines += [f"- {k}: {fmt_pooled(v)}" for k, v in a["equal_trajectories"].items()]
    for key, title in (
        ("equal_compute", "the GRPO record read at the evaluation nearest the arm's passes, within 15 %"),
        ("equal_compute_net", "the same, the diagnostic ODE reference not charged to either side"),
    ):
        lines += ["", f"#### Equal compute ({title})", ""]
        for k, v in a[key].items():
            at = ", ".join(str(i) for i, _ in v["outcome_read_at"])
            less = f" (less {v['less'][0]} and {v['less'][1]} passes an iteration)" if "less" in v else ""
            lines.append(
                f"- {k}{less}, the arm at {v['at']} iterations (GRPO at {at}): {fmt_pooled(v)}; "
                f"beats it: {'yes' if v['beats'] else 'no'}"
            )
    lines += ["", "#### The objectives against each other at equal passes (the second read nearest, within 15 %)", ""]
    for k, v in a["between"].items():
        at = ", ".join(str(i) for i, _ in v["outcome_read_at"])
        lines.append(f"- {k}, the first at {v['at']} iterations (the second at {at}): {fmt_pooled(v)}")
    lines += ["", "#### The authors' ways against the decision's records (equal trajectories, same seeds)", ""]
    lines += [f"- {k}: {fmt_pooled(v)}" for k, v in a["departures"].items()]
    lines += ["", "#### Step credit inside the objective ((objective + dense@rollout) - objective; last: stepwise)", ""]
    for k, v in a["credit"].items():
        lines.append(f"- {k}: {fmt_pooled(v)}; helps: {'yes' if v['helps'] else 'not shown'}")
    lines += ["", "#### Claims: the frontier rows", ""]
    lines += ["| paper | claim | passes ratio to reach its reward | verdict | gain at equal compute | step credit |"]
    lines += ["|---|---|---|---|---|---|"]
    for r in a["claims"]:
        lines.append(
            f"| {r['paper']} | {r['claim']} | {r.get('speed', 'n/a')} | {r['verdict']} | "
            f"{r.get('equal_compute', 'n/a')} | {r.get('step_credit', 'n/a')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = screen_arguments(__doc__.split("\n\n")[0], [*ARMS, *PROBES])
    ap.add_argument("--probes", action="store_true", help="only seed 0 of nft and awm and the two probes")
    a = ap.parse_args()
    s = settings(a)
    seeds = a.seeds or (1 if a.quick else 6)
    if not a.report_only:
        s.run(queue(seeds, a.probes, a.arms), a.jobs)
    analysis = analyse(s, seeds)
    s.report(analysis, summary_md(analysis))


if __name__ == "__main__":
    main()
