"""The papers' regime (the SDE on steps 0-8 of 10, those 9 steps trained), outcome credit against each
step-level scheme with enough seeds to decide: the screen two questions run, `python -m
bench.credit_schemes_w9.w9` (completions as each paper computes them) and `python -m
bench.credit_schemes_cheap.cheap` (DenseGRPO's credit from the rollout's own x0 predictions).

Arms (`ARMS`): `outcome_w9`, `dense_w9`, `stepwise_w9`, `turning_point_w9` (configs/shapes_<scheme>_w9.yaml,
each scheme with its paper's completion) and the shipped early-window recipe `outcome_w3` as the
reference. Seed `S` of every arm sees the same prompts and initial noise in every iteration, and
its held-out evaluations (126 prompts x 8 noise seeds) the same prompts and noise as its base, so
any two arms of a seed pair sample by sample; intervals treat the prompt as the unit
(`stepgrpo.reporting.report.paired_gain`), and pooled intervals the training seed.

Budgets: equal trajectories (every arm after `--iterations`) and equal compute: an outcome arm
runs longer and is read at its first evaluated iteration whose cumulative transformer NFEs (or
training seconds) reach the step-level arm's after `--iterations` (so outcome gets at least the
same compute; the table gives the ratio).

Before its training result, each arm has a prediction: `stepgrpo credit-quality` on iteration 0 of
its first seed (the base policy, nothing trained yet), judging the arm's scheme and outcome on the
same rows.

The durable state is small: one record per finished run (`<records>/<arm>/seed_<S>.json`: its
argv, per-iteration costs, rewards and held-out scores) and one per check, kept under
docs/bench/credit_schemes_w9/runs, so the comparison resumes from them in another checkout; the
run directories (`--out`) are scratch. A record is written only after its run finished.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._lib.common import ROOT, machine, mean_ci, relative, write_json
from bench._lib.runner import covers, record_of, run_seed
from bench._lib.warm import Stepgrpo

# arm -> (config, scheme, completion its scheme's paper uses)
ARMS: dict[str, tuple[str, str]] = {
    "outcome_w9": ("configs/shapes_outcome_w9.yaml", "outcome"),
    "dense_w9": ("configs/shapes_dense_w9.yaml", "dense"),
    "stepwise_w9": ("configs/shapes_stepwise_w9.yaml", "stepwise"),
    "turning_point_w9": ("configs/shapes_turning_point_w9.yaml", "turning_point"),
    "outcome_w3": ("configs/shapes_outcome.yaml", "outcome"),
    # the cheap regime: DenseGRPO's credit from the rollout's own x0 predictions (0 extra NFEs)
    "dense_rollout_w9": ("configs/shapes_dense_w9.yaml", "dense"),
}
# overrides an arm adds to its config (the cheap arms: their completion)
ARM_SETS: dict[str, list[str]] = {"dense_rollout_w9": ["completion.method=rollout"]}
OUTCOMES = ("outcome_w9", "outcome_w3")  # the two outcome recipes every step-level arm is compared with
STEP_LEVEL = ("dense_w9", "stepwise_w9", "turning_point_w9", "dense_rollout_w9")
PAPERS = {
    "stepwise_w9": ("Stepwise-Flow-GRPO", "reaches Flow-GRPO's reward in 2-3x fewer iterations", 0.5),
    "turning_point_w9": ("TP-GRPO", "reaches Flow-GRPO's reward in about a third of the steps", 0.4),
    "dense_w9": ("DenseGRPO", None, None),
    "dense_rollout_w9": ("DenseGRPO", None, None),
}
RECORDS = ROOT / "docs" / "bench" / "credit_schemes_w9" / "runs"
# the tiny settings of every `--quick` run (2 prompts x 4 samples, a one-seed held-out set)
QUICK_SET = [
    "run.prompts_per_iteration=2",
    "run.group_size=4",
    "run.eval_prompts=8",
    "run.eval_seeds=1",
    "optim.diagnostics=false",
]
PRESETS: dict[str, dict[str, Any]] = {
    # the comparison of docs/bench/credit_schemes_w9/README.md: ~13 core-hours, resumable
    "full": {
        "iterations": 100,
        "eval_every": 25,
        # long enough to reach a step-level arm's cost after 100 iterations
        # (its NFEs are ~3.4x outcome_w9's, ~4.9x outcome_w3's)
        "outcome_iterations": {"outcome_w9": 350, "outcome_w3": 500},
        "seeds": {"outcome_w9": 6, "dense_w9": 6, "stepwise_w9": 3, "turning_point_w9": 3, "outcome_w3": 3},
        "continuations": 8,
        "records": "credit_schemes_w9",
        "set": ["run.eval_seeds=8"],
    },
    # the cheap regime (docs/BENCHMARKS.md section 10): step-level credit at outcome's cost, DenseGRPO on
    # the rollout's own x0 predictions against both outcome recipes, 6 paired seeds. outcome_w9's
    # records (and outcome_w3's seeds 0-2, 500 iterations) are the papers' regime's (`borrow`); a cheap
    # arm's NFEs are ~1x outcome_w9's and ~1.5x outcome_w3's (equal NFEs: outcome_w3 after ~150
    # iterations), its seconds ~2x outcome_w3's on an idle core: 175 iterations of outcome_w3 reach the
    # NFEs with a margin, the seconds only on an idle machine (the table flags an outcome arm short of them)
    "cheap": {
        "iterations": 100,
        "eval_every": 25,
        "outcome_iterations": {"outcome_w9": 350, "outcome_w3": 175},
        "seeds": {"outcome_w9": 6, "dense_rollout_w9": 6, "outcome_w3": 6},
        "continuations": 8,
        "records": "credit_schemes_cheap",
        "borrow": "credit_schemes_w9",
        "set": ["run.eval_seeds=8"],
    },
    # every path of the cheap regime at tiny settings: a test runs it
    "cheap_quick": {
        "iterations": 2,
        "eval_every": 1,
        "outcome_iterations": {"outcome_w9": 4, "outcome_w3": 4},
        "seeds": {"outcome_w9": 1, "dense_rollout_w9": 1, "outcome_w3": 1},
        "continuations": 2,
        "records": "credit_schemes_cheap_quick",
        "set": QUICK_SET,
    },
    # a CUDA GPU: outcome against dense at W9 with 8x the trajectories an iteration (64 prompts x 8),
    # every run at once, on the tiny model (its batches take milliseconds there: the CPU side sets the
    # pace). Sized to about 5 minutes of one H200: 20 iterations of 512 trajectories (1.6x the
    # trajectories of the CPU arms' 100 iterations, in a fifth of the optimizer steps); outcome to the
    # step-level arms' cost (x3.4)
    "gpu": {
        "iterations": 20,
        "eval_every": 10,
        "outcome_iterations": {"outcome_w9": 70, "outcome_w3": 100},
        "seeds": {"outcome_w9": 2, "dense_w9": 2, "stepwise_w9": 0, "turning_point_w9": 0, "outcome_w3": 0},
        "continuations": 8,
        "jobs": 4,
        "records": "credit_schemes_w9_gpu",
        "set": [
            "run.eval_seeds=8",
            "model.device=cuda",
            "model.max_batch=1024",
            "run.prompts_per_iteration=64",
            "optim.micro_batch=512",
        ],
    },
    # every path at tiny settings: a test runs it
    "quick": {
        "iterations": 2,
        "eval_every": 1,
        "outcome_iterations": {"outcome_w9": 4, "outcome_w3": 4},
        "seeds": {"outcome_w9": 2, "dense_w9": 2, "stepwise_w9": 1, "turning_point_w9": 1, "outcome_w3": 1},
        "continuations": 2,
        "records": "credit_schemes_w9_quick",
        "set": QUICK_SET,
    },
}


@dataclass
class W9:
    iterations: int
    eval_every: int
    outcome_iterations: dict[str, int]
    seeds: dict[str, int]  # arm -> number of seeds (0 .. n-1)
    continuations: int
    overrides: list[str]
    jobs: int
    out: Path  # run directories (scratch)
    records: Path  # the durable records
    borrow: Path | None = None  # another regime's records, read for the arms both share

    def arm_seeds(self, arm: str) -> list[int]:
        return list(range(self.seeds.get(arm, 0)))

    def arms(self) -> list[str]:
        return [arm for arm in ARMS if self.seeds.get(arm, 0)]

    def overrides_of(self, arm: str) -> list[str]:
        n = self.outcome_iterations.get(arm, self.iterations)
        return [*self.overrides, *ARM_SETS.get(arm, []), f"run.iterations={n}", f"run.eval_every={self.eval_every}"]

    def argv(self, arm: str) -> list[str]:
        return [ARMS[arm][0], *self.overrides_of(arm)]

    def record_path(self, arm: str, seed: int) -> Path:
        """Where the record of `(arm, seed)` is: this regime's own, else a borrowed one that covers it."""
        own = self.records / arm / f"seed_{seed}.json"
        if self.borrow is not None and not own.is_file():
            other = self.borrow / arm / f"seed_{seed}.json"
            if other.is_file() and covers(json.loads(other.read_text())["argv"], self.argv(arm)):
                return other
        return own

    def check_path(self, arm: str) -> Path:
        return self.records / arm / "check_seed_0.json"


def settings(a: Any) -> W9:
    name = "quick" if a.quick else "gpu" if a.gpu else "full"
    if getattr(a, "regime", "w9") == "cheap":
        name = "cheap_quick" if a.quick else "cheap"
    p = PRESETS[name]
    seeds = dict(p["seeds"])
    if a.seeds:  # --seeds N: at most N seeds per arm
        seeds = {k: min(v, max(a.seeds) + 1) for k, v in seeds.items()}
    return W9(
        iterations=a.iterations or p["iterations"],
        eval_every=a.eval_every or p["eval_every"],
        outcome_iterations=dict(p["outcome_iterations"]),
        seeds=seeds,
        continuations=p["continuations"],
        overrides=list(p.get("set", [])) + a.overrides,
        jobs=a.jobs or p.get("jobs", 1),
        out=(a.out or ROOT / "bench" / "out" / f"credit_schemes_w9{'' if name == 'full' else '_' + name}").resolve(),
        records=(
            a.records or (a.out / "records" if a.quick and a.out else RECORDS.parents[1] / p["records"] / "runs")
        ).resolve(),
        borrow=(RECORDS.parents[1] / p["borrow"] / "runs").resolve() if p.get("borrow") else None,
    )


# --------------------------------------------------------------------------------- running


def train_one(s: W9, arm: str, seed: int, stepgrpo: Stepgrpo) -> None:
    """Train one (arm, seed) unless its record exists; then its record (and, for seed 0, the check)."""
    path = s.record_path(arm, seed)
    if path.is_file() and covers(json.loads(path.read_text())["argv"], s.argv(arm)):
        return
    out = (s.out / arm).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if seed == 0:  # the prediction first, from the first iteration alone
        check(s, arm, out, stepgrpo)
    t0 = time.perf_counter()
    done = run_seed(ARMS[arm][0], seed, s.overrides_of(arm), out, stepgrpo)
    write_json(path, record_of(done["run_dir"], s.argv(arm)))
    print(f"{arm} seed {seed}: recorded after {time.perf_counter() - t0:.0f} s", flush=True)


def check(s: W9, arm: str, out: Path, stepgrpo: Stepgrpo) -> None:
    """`stepgrpo credit-quality` on iteration 0 of the arm's seed-0 run (one iteration trained in
    a run directory of its own: the same prompts, noise and base policy as the arm's iteration 0)."""
    path = s.check_path(arm)
    if path.is_file():
        return
    scheme = ARMS[arm][1]
    run_dir = out / "check_seed_0"
    # one iteration, its held-out evaluations cut to one prompt: the check reads the iteration only
    sets = [*s.overrides_of(arm), "run.iterations=1", "run.seed=0", "run.eval_prompts=1", "run.eval_seeds=1"]
    steps = [
        ["train", "--config", ARMS[arm][0], "--run-dir", str(run_dir), *[x for o in sets for x in ("--set", o)]],
        ["credit-quality", str(run_dir), "--iteration", "0", "--continuations", str(s.continuations)]
        + [x for name in dict.fromkeys(("outcome", scheme)) for x in ("--scheme", name)],
    ]
    for i, args in enumerate(steps):
        log = out / f"check-{i}.log"
        rc = stepgrpo.run(args, log)
        if rc != 0:
            raise SystemExit(f"`stepgrpo {args[0]}` for the {arm} check exited {rc}; see {relative(log)}")
    (found,) = sorted((run_dir / "credit_quality").glob("iter_0-*.json"))
    c = json.loads(found.read_text())
    write_json(
        path,
        {"arm": arm, "scheme": scheme, **{k: c[k] for k in ("continuations", "groups", "gradient", "nfe", "seconds")}},
    )
    print(f"{arm}: credit-quality check of iteration 0 recorded ({c['seconds']:.0f} s)", flush=True)


def queue(s: W9) -> list[tuple[str, int]]:
    """Seed-major: every arm of seed 0 before any of seed 1, so a stopped comparison holds whole
    pairs; the costly step-level arms first within a seed."""
    order = ("dense_rollout_w9", "dense_w9", "outcome_w9", "stepwise_w9", "turning_point_w9", "outcome_w3")
    return [(arm, seed) for seed in range(max(s.seeds.values())) for arm in order if seed < s.seeds.get(arm, 0)]


# --------------------------------------------------------------------------------- analysis


@dataclass
class Rec:
    arm: str
    seed: int
    nfe: list[int]
    seconds: list[float]
    setup_seconds: float
    evals: dict[int, dict[str, Any]]

    def cost(self, n: int, per: str) -> float:
        if per == "nfe":
            return float(sum(self.nfe[:n]))
        return self.setup_seconds + n * float(statistics.median(self.seconds))  # robust to other load a while


COST = Path(__file__).resolve().parents[2] / "docs" / "bench" / "credit_schemes_cheap" / "cost.json"
SECONDS_NOTE = (
    "a cheap arm's seconds are outcome_w9's own seconds an iteration (same seed) times the ratio "
    "bench/credit_schemes_cheap/cheap_cost.py measured with both trained in turns in one run (cost.json): "
    "its runs shared "
    "the machine with other benchmarks, the borrowed outcome records did not"
)


def load(s: W9, arm: str, seed: int) -> Rec | None:
    path = s.record_path(arm, seed)
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    if not covers(r["argv"], s.argv(arm)):
        return None  # a record of other settings
    evals = {int(k): v for k, v in r["evals"].items()}
    seconds = r["seconds"]
    if s.borrow is not None and arm in ARM_SETS and COST.is_file():  # SECONDS_NOTE
        outcome = load(s, "outcome_w9", seed)
        ratio = json.loads(COST.read_text())["arms"].get(arm, {}).get("seconds_ratio")
        if outcome is not None and ratio is not None:
            seconds = [ratio * statistics.median(outcome.seconds)] * len(r["seconds"])
    return Rec(arm, seed, r["nfe"], seconds, r["setup_seconds"], evals)


def gain(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, float]:
    from bench._lib.stats import paired

    return paired(a, b)


EQUAL_WITHIN = 0.05  # an evaluation within 5 % of the arm's cost counts as equal compute


def matched(o: Rec, cost: float, per: str) -> int:
    """Outcome's evaluated iteration at the arm's cumulative `cost`: the one nearest to it when that
    is within `EQUAL_WITHIN` (an arm that costs what outcome costs an iteration is read at the same
    iteration, not one evaluation later), else the first whose cost reaches it (its last if none)."""
    its = sorted(i for i in o.evals if i > 0)
    near = min(its, key=lambda i: abs(o.cost(i, per) - cost))
    if abs(o.cost(near, per) - cost) <= EQUAL_WITHIN * cost:
        return near
    return next((i for i in its if o.cost(i, per) >= cost), its[-1])


def over(values: list[float]) -> dict[str, float]:
    m, lo, hi = mean_ci(values)
    return {"mean": m, "lo": lo, "hi": hi, "n": len(values)}


def analyse(runs: dict[tuple[str, int], Rec], s: W9) -> dict[str, Any]:
    N = s.iterations
    out: dict[str, Any] = {"iterations": N, "arms": {}, "vs": {}}
    any_run = next(iter(runs.values()))
    out["pairs"] = len(any_run.evals[0]["scores"])
    for arm in ARMS:
        rows = [
            {
                "seed": r.seed,
                "reward": r.evals[N]["reward_mean"],
                "gain": list(gain(r.evals[0], r.evals[N])),
                "nfe_per_iteration": r.cost(N, "nfe") / N,
                "seconds_per_iteration": statistics.median(r.seconds),
            }
            for (a, _), r in sorted(runs.items())
            if a == arm
        ]
        if rows:
            out["arms"][arm] = {"per_seed": rows, "gain": over([x["gain"][0] for x in rows])}
    for arm in (*STEP_LEVEL, "outcome_w3"):
        for ref in OUTCOMES:
            if arm == ref:
                continue
            seeds = sorted(seed for (a, seed) in runs if a == arm and (ref, seed) in runs)
            if not seeds:
                continue
            entry: dict[str, Any] = {}
            for budget in ("trajectories", "nfe", "seconds"):
                rows = []
                for seed in seeds:
                    r, o = runs[arm, seed], runs[ref, seed]
                    if budget == "trajectories":
                        n = N
                    else:
                        n = matched(o, r.cost(N, budget), budget)
                    d = gain(o.evals[n], r.evals[N])
                    fraction = o.cost(n, budget if budget != "trajectories" else "nfe") / r.cost(
                        N, budget if budget != "trajectories" else "nfe"
                    )
                    # an outcome run that ended before the arm's cost: not equal compute (flagged)
                    short = budget != "trajectories" and fraction < 1 - EQUAL_WITHIN
                    rows.append(
                        {"seed": seed, "outcome_iterations": n, "cost_ratio": fraction, "diff": list(d), "short": short}
                    )
                entry[budget] = {"per_seed": rows, "pooled": over([x["diff"][0] for x in rows])}
            if arm in PAPERS and ref == "outcome_w9" and PAPERS[arm][1]:
                entry["speed"] = speed(runs, arm, ref, seeds, N)
            out["vs"][f"{arm} - {ref}"] = entry
    return out


def speed(runs: dict[tuple[str, int], Rec], arm: str, ref: str, seeds: list[int], N: int) -> dict[str, Any]:
    """Iterations the arm needs to reach outcome's held-out reward after N (linear between its
    evaluations), as a fraction of N, per seed."""
    from bench._lib.stats import crossing

    rows = []
    for seed in seeds:
        r, o = runs[arm, seed], runs[ref, seed]
        target = o.evals[N]["reward_mean"]
        rose = target > r.evals[0]["reward_mean"]
        x = crossing([(float(i), r.evals[i]["reward_mean"]) for i in sorted(r.evals)], target) if rose else None
        rows.append({"seed": seed, "outcome_rose": rose, "ratio": None if x is None else x / N})
    return {"per_seed": rows}


def speed_verdict(e: dict[str, Any], claimed: float) -> str:
    rows = e["per_seed"]
    if not all(x["outcome_rose"] for x in rows):
        return "not resolved at this scale"
    if all(x["ratio"] is not None and x["ratio"] <= claimed for x in rows):
        return "consistent"
    if all(x["ratio"] is None or x["ratio"] > claimed for x in rows):
        return "contradicted"
    return "not resolved at this scale"


def claims(a: dict[str, Any]) -> list[dict[str, str]]:
    from bench._lib.stats import ci, verdict

    N, rows = a["iterations"], []
    for arm, (paper, speed_claim, fraction) in PAPERS.items():
        e = a["vs"].get(f"{arm} - outcome_w9")
        if e is None:
            continue
        for budget, claim in (
            ("trajectories", "higher reward than Flow-GRPO at the same iterations"),
            ("nfe", "higher reward than Flow-GRPO at equal transformer NFEs"),
            ("seconds", "higher reward than Flow-GRPO at equal training seconds"),
        ):
            p = e[budget]["pooled"]
            its = "/".join(str(x["outcome_iterations"]) for x in e[budget]["per_seed"])
            rows.append(
                {
                    "paper": paper,
                    "claim": claim,
                    "measured": f"{arm} after {N} - outcome_w9 after {its}: {ci(p)} over {p['n']} seeds",
                    "verdict": verdict(p)
                    + (" (one training seed)" if p["n"] < 2 else "")
                    + (
                        " (outcome ran short of equal compute)"
                        if any(x["short"] for x in e[budget]["per_seed"])
                        else ""
                    ),
                }
            )
        if speed_claim:
            sp = e["speed"]
            per = ", ".join("-" if x["ratio"] is None else f"{x['ratio']:.2f}" for x in sp["per_seed"])
            rows.append(
                {
                    "paper": paper,
                    "claim": f"{speed_claim} (outcome_w9's after {N})",
                    "measured": f"iterations / outcome's, per seed: {per}",
                    "verdict": speed_verdict(sp, fraction),
                }
            )
    return rows


EARLY_WINDOW = Path(__file__).resolve().parents[2] / "docs" / "bench" / "credit_schemes" / "claims.md"


def claims_v2_md(rows: list[dict[str, str]], early: Path = EARLY_WINDOW) -> str:
    """The claims table, version 2: each claim measured in the papers' regime (`rows`, W = 9) beside
    the same claim in the early window (section 1's table at `early`, W = 3; the speed claims
    against outcome's reward after 100 iterations)."""
    w3: dict[tuple[str, str], tuple[str, str]] = {}
    if early.is_file():
        for line in early.read_text().splitlines()[2:]:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) != 4:
                continue
            paper, claim, measured, verdict = cells
            key = (paper, _base_claim(claim))
            if key not in w3 or "after 100" in claim:  # of the two speed rows, the one at 100 iterations
                w3[key] = (measured, verdict)
    L = [
        "| paper | claim | papers' regime (W = 9): measured | verdict | early window (W = 3): measured | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, v = w3.get((r["paper"], _base_claim(r["claim"])), ("not measured", ""))
        L.append(f"| {r['paper']} | {r['claim']} | {r['measured']} | {r['verdict']} | {m} | {v} |")
    return "\n".join(L) + "\n"


V2 = Path(__file__).resolve().parents[2] / "docs" / "bench" / "credit_schemes_w9" / "claims_v2.md"
CHEAP_ARMS = {"DenseGRPO": "dense_rollout_w9"}  # paper -> its arm with the rollout's own step rewards


def cheap_claims(a: dict[str, Any]) -> list[dict[str, str]]:
    """The claims measured with the cheap estimator (the cheap regime): each paper's cheap arm
    against outcome_w9 (the papers' comparison) and against outcome_w3 (the best outcome recipe
    per NFE, section 8)."""
    from bench._lib.stats import ci, verdict

    N, rows = a["iterations"], []
    for paper, arm in CHEAP_ARMS.items():
        for ref in OUTCOMES:
            e = a["vs"].get(f"{arm} - {ref}")
            if e is None:
                continue
            against = "Flow-GRPO" if ref == "outcome_w9" else "the best outcome recipe, W = 3,"
            for budget, what in (
                ("trajectories", "at the same iterations"),
                ("nfe", "at equal transformer NFEs"),
                ("seconds", "at equal training seconds"),
            ):
                p = e[budget]["pooled"]
                its = "/".join(str(x["outcome_iterations"]) for x in e[budget]["per_seed"])
                short = any(x["short"] for x in e[budget]["per_seed"])
                rows.append(
                    {
                        "paper": paper,
                        "claim": f"higher reward than {against} {what}",
                        "measured": f"{arm} after {N} - {ref} after {its}: {ci(p)} over {p['n']} seeds",
                        "verdict": verdict(p) + (" (outcome ran short of equal compute)" if short else ""),
                    }
                )
    return rows


def claims_v3_md(cheap: list[dict[str, str]], v2: Path = V2) -> str:
    """The claims table, version 3: each claim of version 2 (W = 9, each scheme with its paper's
    completion) beside the same claim with the cheap estimator (step rewards from the rollout's own
    x0 predictions, 0 extra NFEs); the claims against the best outcome recipe (W = 3) added."""
    old: dict[tuple[str, str], tuple[str, str]] = {}
    if v2.is_file():
        for line in v2.read_text().splitlines()[2:]:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) == 6:
                old[(cells[0], _base_claim(cells[1]))] = (cells[2], cells[3])
    new = {(r["paper"], _base_claim(r["claim"])): (r["measured"], r["verdict"]) for r in cheap}
    L = [
        "| paper | claim | v2: the paper's completion (W = 9): measured | verdict "
        "| v3: rollout step rewards (W = 9, 0 extra NFEs): measured | verdict |",
        "|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys([*old, *new]))
    for paper, claim in keys:
        m2, v2_ = old.get((paper, claim), ("not measured", ""))
        m3, v3_ = new.get((paper, claim), ("not measured (the cheap comparison ran DenseGRPO only)", ""))
        L.append(f"| {paper} | {claim} | {m2} | {v2_} | {m3} | {v3_} |")
    return "\n".join(L) + "\n"


def _base_claim(claim: str) -> str:
    """A claim without its parenthetical reference point: `... fewer iterations (outcome's ...)`."""
    return claim.split(" (")[0].strip()


def prediction(s: W9, arm: str) -> str:
    """The arm's credit-quality check: its scheme's corrected gradient cosine, and the difference to
    outcome's on the same rows, with their bootstrap intervals."""
    path = s.check_path(arm)
    if not path.is_file():
        return "n/a"
    c = json.loads(path.read_text())
    from bench._lib.stats import fmt

    rows = {r["scheme"]: r for r in c["gradient"]["uniform"]["rows"]}
    r = rows[c["scheme"]]
    text = f"{fmt(r['cosine'], 2)} [{fmt(r['low'], 2)}, {fmt(r['high'], 2)}]"
    if r.get("diff") is not None:
        text += f"; minus outcome {fmt(r['diff'], 2)} [{fmt(r.get('diff_low'), 2)}, {fmt(r.get('diff_high'), 2)}]"
    return text + f" ({c['groups']} groups, M = {c['continuations']})"


def summary_md(a: dict[str, Any], s: W9, info: dict[str, Any]) -> str:
    from bench._lib.stats import ci, fmt

    N = a["iterations"]
    L = [
        f"settings: {json.dumps(info['settings'])}",
        f"machine: {json.dumps(info['machine'])}",
        "",
        f"### Each arm after {N} iterations: held-out gain over its base (paired, {a['pairs']} samples, "
        "interval by prompt; pooled: t-interval over seeds), and the credit-quality prediction",
        "",
        "| arm | seeds | gain, pooled | gain per seed | NFE / iteration | s / iteration "
        "| predicted gradient cosine (iteration 0) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, e in a["arms"].items():
        per = "; ".join(
            f"{x['seed']}: {fmt(x['gain'][0])} [{fmt(x['gain'][1])}, {fmt(x['gain'][2])}]" for x in e["per_seed"]
        )
        nfe = statistics.mean(x["nfe_per_iteration"] for x in e["per_seed"])
        sec = statistics.mean(x["seconds_per_iteration"] for x in e["per_seed"])
        L.append(
            f"| {arm} | {len(e['per_seed'])} | {ci(e['gain'])} | {per} | {nfe:.0f} | {sec:.1f} | {prediction(s, arm)} |"
        )
    for budget, what in (
        ("trajectories", f"equal trajectories (both after {N} iterations)"),
        (
            "nfe",
            "equal transformer NFEs (outcome read at its evaluation within 5 % of the arm's NFEs, else its first "
            "with more)",
        ),
        ("seconds", "equal training seconds (likewise)" + (f"; {SECONDS_NOTE}" if s.borrow is not None else "")),
    ):
        L += [
            "",
            f"### Step-level minus outcome at {what}",
            "",
            "| comparison | pooled | per seed (outcome's iterations, its cost / the arm's) |",
            "|---|---|---|",
        ]
        for key, e in a["vs"].items():
            rows = e[budget]["per_seed"]
            per = "; ".join(
                f"{x['seed']}: {fmt(x['diff'][0])} [{fmt(x['diff'][1])}, {fmt(x['diff'][2])}] "
                f"({x['outcome_iterations']}, {x['cost_ratio']:.2f}x{', short' if x['short'] else ''})"
                for x in rows
            )
            L.append(f"| {key} | {ci(e[budget]['pooled'])} | {per} |")
    return "\n".join(L) + "\n"


def csv_rows(a: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, e in a["vs"].items():
        arm, ref = key.split(" - ")
        for budget in ("trajectories", "nfe", "seconds"):
            for x in e[budget]["per_seed"]:
                d = x["diff"]
                rows.append(
                    {
                        "arm": arm,
                        "reference": ref,
                        "budget": budget,
                        "seed": x["seed"],
                        "diff": d[0],
                        "lo": d[1],
                        "hi": d[2],
                        "reference_iterations": x["outcome_iterations"],
                        "cost_ratio": x["cost_ratio"],
                        "short": x["short"],
                    }
                )
            p = e[budget]["pooled"]
            rows.append(
                {
                    "arm": arm,
                    "reference": ref,
                    "budget": budget,
                    "seed": "pooled",
                    "diff": p["mean"],
                    "lo": p["lo"],
                    "hi": p["hi"],
                }
            )
    return rows


def plot(runs: dict[tuple[str, int], Rec], s: W9, path: Path) -> None:
    """Held-out gain over the base against cumulative transformer NFEs, each arm's seeds' mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "outcome_w9": "black",
        "outcome_w3": "grey",
        "dense_w9": "tab:orange",
        "stepwise_w9": "tab:blue",
        "turning_point_w9": "tab:green",
        "dense_rollout_w9": "tab:red",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for arm in ARMS:
        rs = [r for (a, _), r in sorted(runs.items()) if a == arm]
        if not rs:
            continue
        its = sorted(set.intersection(*(set(r.evals) for r in rs)))
        g = [statistics.mean(gain(r.evals[0], r.evals[i])[0] if i else 0.0 for r in rs) for i in its]
        axes[0].plot(its, g, marker="o", color=colours[arm], label=f"{arm} ({len(rs)} seeds)")
        axes[1].plot(
            [statistics.mean(r.cost(i, "nfe") for r in rs) / 1e3 for i in its], g, marker="o", color=colours[arm]
        )
    axes[0].set_xlabel("iteration")
    axes[1].set_xlabel("cumulative transformer NFEs (thousands)")
    axes[0].set_ylabel("held-out gain over the base (paired)")
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recorded_machine(report: Path, report_only: bool) -> dict[str, Any] | None:
    """The machine the runs were recorded on, as the last report that ran them says: a report read
    again from the records (`--report-only`) names it, not the machine that read them, so it
    regenerates byte for byte."""
    path = report / "analysis.json"
    return json.loads(path.read_text()).get("machine") if report_only and path.is_file() else None


def main(a: Any) -> None:
    s = settings(a)
    s.out.mkdir(parents=True, exist_ok=True)
    started = machine()
    if not a.report_only:
        with Stepgrpo(s.jobs, s.out) as stepgrpo, ThreadPoolExecutor(max(1, s.jobs)) as pool:
            list(pool.map(lambda job: train_one(s, *job, stepgrpo), queue(s)))
    runs = {job: r for job in queue(s) if (r := load(s, *job)) is not None}
    missing = [f"{arm} seed {seed}" for arm, seed in queue(s) if (arm, seed) not in runs]
    if missing:
        print(f"not finished yet ({len(missing)}): {', '.join(missing)}; reporting what is recorded", flush=True)
    if not runs:
        raise SystemExit("no finished run recorded yet: run without --report-only")
    analysis = analyse(runs, s)
    report = s.records.parent
    info = {
        # what ran, not where its files are (a copy of the records reports the same bytes)
        "settings": {
            k: (relative(v) if isinstance(v, Path) else v) for k, v in vars(s).items() if k not in ("out", "records")
        },
        "machine": recorded_machine(report, a.report_only) or {"start": started, "end": machine()},
    }
    table = claims(analysis)
    from bench._lib.stats import claims_md

    report.mkdir(parents=True, exist_ok=True)
    (report / "summary.md").write_text(summary_md(analysis, s, info))
    (report / "claims.md").write_text(claims_md(table))
    cheap = "dense_rollout_w9" in s.arms()
    if cheap:
        (report / "claims_v3.md").write_text(claims_v3_md(cheap_claims(analysis)))
    else:
        (report / "claims_v2.md").write_text(claims_v2_md(table))
    write_json(report / "analysis.json", {**info, **analysis, "claims": table, "missing": missing})
    import csv

    rows = csv_rows(analysis)
    with (report / "comparison.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    plot(runs, s, report / "heldout.png")
    print((report / "summary.md").read_text())
    claims_file = "claims_v3.md" if cheap else "claims_v2.md"
    print((report / claims_file).read_text())
    print(
        f"wrote {relative(report)}/: summary.md, claims.md, {claims_file}, analysis.json, comparison.csv, heldout.png"
    )


def cli(regime: str, description: str) -> None:
    """The command of the regime `w9` or `cheap` (`python -m bench.credit_schemes_<regime>.<regime>`)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every path at tiny settings")
    mode.add_argument("--gpu", action="store_true", help="8x the trajectories an iteration on a CUDA GPU")
    ap.add_argument("--iterations", type=int, help="iterations of the step-level runs (the equal-trajectory budget)")
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--seeds", type=int, nargs="+")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value on every run")
    ap.add_argument("--jobs", type=int, help="runs at once (one torch thread each)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--records", type=Path, help="where the finished runs' records are kept")
    ap.add_argument("--report-only", action="store_true", help="read the finished runs and report")
    a = ap.parse_args()
    a.regime = regime
    if a.gpu and not a.report_only:
        import torch

        if not torch.cuda.is_available():
            ap.error("--gpu needs a CUDA GPU (torch sees none); on a CPU run the default or --quick")
    main(a)
