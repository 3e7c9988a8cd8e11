"""Step credit where a step makes a choice: TempFlow-GRPO's branched rollouts on the shipped model,
against outcome credit and AWM per unit of compute (`sampler.branch_window`, docs/METHODS.md
"Branched rollouts").

Every arm is a shipped recipe plus overrides, run as a user runs it (`stepgrpo train`, one torch
thread, `run.eval_seeds=8`: 126 held-out prompts x 8 noise seeds every 25 iterations). Seed S sees
the prompts and held-out noise of seed S of every kept record it is compared with; the records of
the GRPO recipes and of AWM are the frontier's and the clip screen's (no rerun).

Arms (6 seeds, 100 iterations; 300 for the ones the 100-iteration reading leaves open):
  tempflow     configs/shapes_tempflow.yaml: each group's members share the ODE path from the group's
               x_0 to its branch step (one of steps 0-2, drawn per group), branch there with their
               own noise, ODE after; outcome credit over the group is the sibling advantage at the
               branch step, the only step trained; one AdamW step an iteration (shapes_outcome.yaml's)
  tempflow_k4  the same with the clip recipe's optimizer (four AdamW steps a batch, clip 1e-4)
  tree         configs/shapes_tree.yaml (added after tempflow's first seed, decided by the same rule
               against outcome_w3): each group a binary tree split at steps 0, 1 and 2, every node
               once, BranchGRPO's tree advantage (each node's mean leaf reward normalized over its
               depth), each branch transition trained once
  on jpeg_compressibility, a reward the late steps decide too (added with the tree arm), 3 seeds:
  tempflow_jpeg (branch steps 0-8) and tree_jpeg (splits at 2, 5, 8) against outcome_jpeg (outcome
  credit with every member stochastic on steps 0-8), decided by the same rule
  on jpeg_compressibility, the anchor arms (added after the tempflow and tree arms, before any of
  their runs), 3 seeds: granular_jpeg (configs/shapes_granular.yaml, G2RPO: each group's ODE anchor
  once, two members branching off it at each of steps 1, 3, 5, 7, the ODE after; the sum of each
  member's reward normalized among its two siblings at two granularities, R_T and the one-step x0
  prediction after the branch) and local_jpeg (configs/shapes_local.yaml, Step-GRPO: the same
  rollouts, the x0 prediction's reward alone z-scored among the siblings), each against
  outcome_jpeg by the same rule, and against tempflow_jpeg reported beside; and on shapes, where the
  tempflow and tree arms left the decision open (level per trajectory, the tree ahead per pass by
  little), 6 seeds (added after the jpeg anchor runs started, before any shapes anchor run): granular
  (configs/shapes_granular.yaml: four members off each group's anchor at steps 0 and 1) and local
  (configs/shapes_local.yaml, the same rollouts), against outcome_w3 by the same rule and AWM beside;
  after those lost, one diagnostic seed, not decided: granular_exact (granular with
  `completion.method: remaining`, whose R_{b+1} is R_T: twice the sibling advantage)
  BranchGRPO's own rollout (added after every arm above had run, before any of its runs), 6 seeds
  on shapes (tree_full) and 3 on jpeg_compressibility (tree_full_jpeg): configs/shapes_tree.yaml
  with its authors' layout scaled to 10 steps (binary splits in the first half, at 0, 2 and 4),
  every other step stochastic too (`sampler.tree_sde: [0, 10]`, their sampler's default) and the
  trained transitions after the last split width-pruned to their best and worst half a group
  (`optim.width_pruning: extremes`, `width_keep: 0.5`, their mode 2): against outcome_w3 /
  outcome_jpeg by the same rule, the ODE-between-splits tree (tree / tree_jpeg) reported beside;
  BranchGRPO's claims row reads these arms (its published rollout) where they have run
against outcome_w3 (shapes_outcome.yaml: the same window of steps 0-2, every member SDE on all
three), outcome_w3_k4 (the clip recipe, configs/shapes_outcome_clip.yaml) and AWM (the frontier's
best objective; its records as the frontier ran them).

Compute: forward-equivalent passes per stage as each run spent them (the shared prefix once a
group, the ODE reference included; `stepgrpo.reporting.costs`), the GRPO records' rebuilt from
what their configs ran (`bench/frontier/frontier.py`, `rebuilt_passes`).

The decision, fixed before the runs (this file's commit is the pre-registration):
  - sibling credit beats outcome credit per unit of compute if tempflow's held-out gain minus
    outcome_w3's, read at equal passes (outcome_w3 at its evaluation nearest the arm's passes,
    within 15 %), has a prompt-clustered interval above 0 after 100 iterations; likewise
    tempflow_k4 against outcome_w3_k4 (the same optimizer on both sides);
  - at equal trajectories (both after 100 iterations) the same differences are reported beside,
    not decided on;
  - against AWM at equal passes: reported, and "picks" only with an interval above 0;
  - the verdict names the reward (`shapes`, whose first steps decide the reward); a reward the late
    steps decide too is a separate arm set, not yet run.

Durable state: one record per finished run (`docs/bench/branch_credit/runs/<arm>/seed_<S>.json`).
Resumable.

    .venv/bin/python -m bench.branch_credit.branch_credit --jobs 1           # the decision (background it)
    .venv/bin/python -m bench.branch_credit.branch_credit --report-only      # tables from the records so far
    .venv/bin/python -m bench.branch_credit.branch_credit --quick --out DIR  # every path at tiny settings
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench._lib.common import ROOT
from bench._lib.compute import at_equal_compute, contrast, fmt_pooled, grpo_passes
from bench._lib.runner import Screen, screen, screen_arguments
from bench._lib.stats import pooled

DOCS = ROOT / "docs" / "bench"
RECORDS = DOCS / "branch_credit" / "runs"
TEMPFLOW = "configs/shapes_tempflow.yaml"
CLIP = ["optim.preset=flow_grpo", "optim.optimizer_steps=4", "optim.kl_beta=0.0"]
JPEG = ["reward.name=jpeg_compressibility"]
FULL_TREE = [
    "sampler.branch_tree=[[0,2],[2,2],[4,2]]",
    "sampler.tree_sde=[0,10]",
    "optim.width_pruning=extremes",
    "optim.width_keep=0.5",
]
ARMS: dict[str, tuple[str, list[str]]] = {
    "tempflow": (TEMPFLOW, []),
    "tempflow_k4": (TEMPFLOW, CLIP),
    "tree": ("configs/shapes_tree.yaml", []),  # added after the first tempflow runs, under the same rule
    # a reward the late steps decide too (added with the tree arm, before any of its runs): 3 seeds
    "outcome_jpeg": ("configs/shapes_outcome.yaml", [*JPEG, "sampler.sde_window_size=9"]),
    "tempflow_jpeg": (TEMPFLOW, [*JPEG, "sampler.branch_window=[0,9]"]),
    "tree_jpeg": ("configs/shapes_tree.yaml", [*JPEG, "sampler.branch_tree=[[2,2],[5,2],[8,2]]"]),
    # the anchor arms (G2RPO, Step-GRPO), added after the tempflow and tree arms: on shapes 6 seeds
    "granular": ("configs/shapes_granular.yaml", []),
    "local": ("configs/shapes_local.yaml", []),
    # a diagnostic, not decided (added after the shapes anchor arms lost): granular with the exact
    # completion, R_{b+1} = R_T, so its advantage is twice the sibling advantage; 1 seed
    "granular_exact": ("configs/shapes_granular.yaml", ["completion.method=remaining"]),
    # on jpeg_compressibility 3 seeds
    "granular_jpeg": ("configs/shapes_granular.yaml", [*JPEG, "sampler.branch_anchor=[1,3,5,7]"]),
    "local_jpeg": ("configs/shapes_local.yaml", [*JPEG, "sampler.branch_anchor=[1,3,5,7]"]),
    # BranchGRPO's own rollout and width pruning (added after all of the above had run): shapes 6
    # seeds, jpeg 3
    "tree_full": ("configs/shapes_tree.yaml", FULL_TREE),
    "tree_full_jpeg": ("configs/shapes_tree.yaml", [*JPEG, *FULL_TREE]),
}
SEEDS = {
    "outcome_jpeg": 3,
    "tempflow_jpeg": 3,
    "tree_jpeg": 3,
    "granular_jpeg": 3,
    "local_jpeg": 3,
    "granular_exact": 1,
    "tree_full_jpeg": 3,
}
# the kept records compared with: name -> (config, overrides, where)
REFS: dict[str, tuple[str, list[str], list[Path]]] = {
    "outcome_w3": (
        "configs/shapes_outcome.yaml",
        [],
        [
            DOCS / "credit_schemes_clip" / "runs",
            DOCS / "credit_schemes_w9" / "runs",
            DOCS / "credit_schemes_cheap" / "runs",
        ],
    ),
    "outcome_w3_k4": (
        "configs/shapes_outcome.yaml",
        ["optim.optimizer_steps=4", "optim.clip_range=0.0001"],
        [DOCS / "credit_schemes_clip" / "runs"],
    ),
    "awm": (
        "configs/shapes_awm.yaml",
        [
            "update.zero_advantage=drop",
            "sampler.shared_x0=true",
            "sampler.ode_reference=true",
            "update.options.clip_range=0.0001",
        ],
        [DOCS / "frontier" / "runs"],
    ),
}
# arm -> the references it is decided against at equal passes (the rule above)
AGAINST = {
    "tempflow": ("outcome_w3", "awm"),
    "tempflow_k4": ("outcome_w3_k4", "awm"),
    "tree": ("outcome_w3", "awm"),
    "outcome_jpeg": (),
    "tempflow_jpeg": ("outcome_jpeg",),
    "tree_jpeg": ("outcome_jpeg",),
    "granular": ("outcome_w3", "awm"),
    "granular_exact": ("outcome_w3",),
    "local": ("outcome_w3", "awm"),
    "granular_jpeg": ("outcome_jpeg", "tempflow_jpeg"),
    "local_jpeg": ("outcome_jpeg", "tempflow_jpeg"),
    "tree_full": ("outcome_w3", "tree"),
    "tree_full_jpeg": ("outcome_jpeg", "tree_jpeg"),
}


def settings(a: argparse.Namespace) -> Screen:
    recipes = ARMS | {arm: v[:2] for arm, v in REFS.items()}
    return screen(a, "branch_credit", recipes, RECORDS, kept={k: v[2] for k, v in REFS.items()})


def analyse(s: Screen, seeds: int = 6) -> dict[str, Any]:
    N = s.iterations
    rec = {(a, k): r for a in [*ARMS, *REFS] for k in range(seeds) if (r := s.load(a, k))}
    out: dict[str, Any] = {"iterations": N, "arms": {}, "equal_trajectories": {}, "equal_passes": {}}
    for arm in ARMS:
        mine = {k: r for (a, k), r in rec.items() if a == arm}
        if not mine:
            continue
        gains = {k: c["mean"] for k, r in mine.items() if (c := contrast(r, N, None, 0))}
        out["arms"][arm] = {
            "seeds": sorted(mine),
            "gain": {str(k): v for k, v in gains.items()},
            "passes_per_iteration": sum(sum(grpo_passes(r)[:N]) / N for r in mine.values()) / len(mine),
        }
        for ref in AGAINST[arm]:
            rows = {k: c for k in range(seeds) if (arm, k) in rec and (ref, k) in rec
                    if (c := contrast(rec[arm, k], N, rec[ref, k], N))}  # fmt: skip
            if rows:
                out["equal_trajectories"][f"{arm} - {ref}"] = pooled(rows)
            if v := at_equal_compute(rec, arm, ref, seeds, s.eval_every, N, every_seed=False):
                out["equal_passes"][f"{arm} - {ref}"] = v | {"beats": bool(v["prompts"]["lo"] > 0)}
    refs = {ref for arm in out["arms"] for ref in AGAINST[arm]} | {a for a in ARMS if a in out["arms"]}
    out["passes_per_iteration"] = {
        ref: sum(sum(grpo_passes(r)[:N]) / N for r in mine) / len(mine)
        for ref in sorted(refs)
        if (mine := [r for (a, _), r in rec.items() if a == ref])
    }
    out["claims"] = claims(out)
    out["quality"] = quality(QUALITY)
    return out


# `stepgrpo credit-quality RUN --iteration 0 --continuations 4 --method rollout` on seed 0 of each arm
# (the base policy, before any update), its record kept as `quality/<arm>.json`; the anchor arms'
# (granular and granular_jpeg, whose iteration 0 is local's and local_jpeg's) with `--continuations
# 8` (at 4 the check's reliability on granular_jpeg was 0.37)
QUALITY = RECORDS.parent / "quality"


# the checks of runs whose own completion method is `rollout` (the anchor arms'): their step-reward
# schemes are named as the others' `--method rollout` columns
OWN_ROLLOUT = {"granular", "granular_jpeg"}
STEP_SCHEMES = ("dense", "stepwise", "turning_point")


def quality(folder: Path) -> dict[str, Any]:
    """Each kept check's gradient cosines with the Monte-Carlo true advantages' (uniform step
    weights): per scheme, the cosine with its interval, and the check's reliability."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        g = r["gradient"]["uniform"]
        rename = (lambda s: f"{s}:rollout" if s in STEP_SCHEMES else s) if path.stem in OWN_ROLLOUT else str
        out[path.stem] = {
            "reward": r["reward_name"], "continuations": r["continuations"], "reliability": g["reliability"],
            "schemes": {rename(row["scheme"]): [row["cosine"], row["low"], row["high"]] for row in g["rows"]},
        }  # fmt: skip
    return out


# each paper's own headline claim, what it is read against here, and at what: (paper, claim,
# [(arm, reference)], "trajectories" for a claim of more reward from the same training, "passes"
# for a claim of the same reward for less compute)
CLAIMS = [
    (
        "TempFlow-GRPO (arXiv 2508.04324)",
        "trajectory branching gives precise credit assignment that uniform outcome credit (Flow-GRPO) lacks: "
        "more reward from the same training",
        [("tempflow", "outcome_w3"), ("tempflow_jpeg", "outcome_jpeg")],
        "trajectories",
    ),
    (
        "BranchGRPO (arXiv 2509.06040)",
        "+16 % HPSv2.1 over DanceGRPO with ~55 % less time an iteration (tree rollouts, the tree advantage)",
        # its published rollout (every step stochastic, width pruning) where it has run, else the tree's
        [
            ("tree_full", "outcome_w3"),
            ("tree_full_jpeg", "outcome_jpeg"),
            ("tree", "outcome_w3"),
            ("tree_jpeg", "outcome_jpeg"),
        ],
        "trajectories",
    ),
    (
        "G2RPO (arXiv 2510.01982)",
        "multi-granularity step advantages from an ODE anchor beat Flow-GRPO",
        [("granular", "outcome_w3"), ("granular_jpeg", "outcome_jpeg")],
        "trajectories",
    ),
    (
        "Step-GRPO (arXiv 2605.25661)",
        "about 3.5x fewer GPU-hours than outcome GRPO with the same reward, at k = 2",
        [("local", "outcome_w3"), ("local_jpeg", "outcome_jpeg")],
        "passes",
    ),
]


def claims(a: dict[str, Any]) -> list[dict[str, str]]:
    """Each claim read on this model, per reward: the gain per trajectory and at equal passes (the
    pre-registered intervals, clustered by prompt) and the passes an iteration against the
    reference; a verdict by the interval the claim is about (equal trajectories for more reward from
    the same training, equal passes for the same reward from less compute): above 0 supported,
    below contradicted, else not shown. One reading a reward: its first pair with records."""
    rows = []
    for paper, claim, pairs, per in CLAIMS:
        measured, verdicts, read = [], [], set()
        for arm, ref in pairs:
            v = a["equal_trajectories"].get(f"{arm} - {ref}")
            reward = "jpeg_compressibility" if arm.endswith("_jpeg") else "shapes"
            if v is None or reward in read:
                continue
            read.add(reward)
            p = v["prompts"]
            ratio = a["passes_per_iteration"][arm] / a["passes_per_iteration"][ref]
            text = f"{reward}: {p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] per trajectory"
            if e := a["equal_passes"].get(f"{arm} - {ref}"):
                q = e["prompts"]
                text += f", {q['mean']:+.3f} [{q['lo']:+.3f}, {q['hi']:+.3f}] at equal passes"
                p = q if per == "passes" else p
            elif per == "passes":
                continue
            which = f", {arm}" if arm.startswith("tree") else ""  # BranchGRPO's row reads one of two arms
            measured.append(f"{text} ({ratio:.2f}x the passes an iteration{which})")
            said = "supported" if p["lo"] > 0 else "contradicted" if p["hi"] < 0 else "not shown"
            verdicts.append(f"{said} on {reward}")
        rows.append({
            "paper": paper, "claim": claim, "measured": "; ".join(measured) or "not measured",
            "verdict": "; ".join(verdicts) or "not measured: no records of its arms and their reference",
        })  # fmt: skip
    return rows


def summary_md(a: dict[str, Any]) -> str:
    N = a["iterations"]
    lines = [f"### Branched rollouts after {N} iterations (held-out gain over each run's base)", ""]
    lines += ["| arm | seeds | gain per seed | passes / iteration |", "|---|---|---|---|"]
    for arm, v in a["arms"].items():
        g = ", ".join(f"{x:+.3f}" for x in v["gain"].values())
        lines.append(f"| {arm} | {len(v['seeds'])} | {g} | {v['passes_per_iteration']:.0f} |")
    lines += ["", "#### Equal trajectories (both after the same iterations)", ""]
    lines += [f"- {k}: {fmt_pooled(v)}" for k, v in a["equal_trajectories"].items()]
    lines += ["", "#### Equal passes (the reference at its evaluation nearest the arm's passes, within 15 %)", ""]
    for k, v in a["equal_passes"].items():
        at = ", ".join(str(i) for i, _ in v["outcome_read_at"])
        lines.append(f"- {k}, the arm at {v['at']} iterations (the reference at {at}): {fmt_pooled(v)}; beats it: "
                     f"{'yes' if v['beats'] else 'no'}")  # fmt: skip
    if a.get("quality"):
        schemes = list(dict.fromkeys(s for q in a["quality"].values() for s in q["schemes"]))
        lines += ["", "#### Credit quality at iteration 0 (gradient cosine with the true advantages', seed 0)", ""]
        lines += ["| arm (its run's states) | reward | M | reliability | " + " | ".join(schemes) + " |"]
        lines += ["|---|---|---|---|" + "---|" * len(schemes)]
        for arm, q in a["quality"].items():
            cells = [f"{c[0]:.2f} [{c[1]:.2f}, {c[2]:.2f}]" if (c := q["schemes"].get(s)) else "-" for s in schemes]
            row = f"| {arm} | {q['reward']} | {q['continuations']} | {q['reliability']:.2f} | "
            lines.append(row + " | ".join(cells) + " |")
    lines += ["", "#### Claims: each paper's headline, read on this model", ""]
    lines += [
        "| paper | claim | measured (arm - outcome) | verdict (at what the claim is about) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['paper']} | {r['claim']} | {r['measured']} | {r['verdict']} |" for r in a.get("claims", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    a = screen_arguments(__doc__.split("\n\n")[0], list(ARMS)).parse_args()
    s = settings(a)
    seeds = a.seeds or (1 if a.quick else 6)
    if not a.report_only:
        arms = a.arms or list(ARMS)
        s.run([(arm, k) for k in range(seeds) for arm in arms if k < SEEDS.get(arm, seeds)], a.jobs)
    analysis = analyse(s, seeds)
    s.report(analysis, summary_md(analysis))


if __name__ == "__main__":
    main()
