"""What an iteration of step-level credit from the rollout's own predictions costs against outcome's,
measured in one run: transformer NFEs and seconds per stage (`stepgrpo inspect --json`).

    .venv/bin/python -m bench.credit_schemes_cheap.cheap_cost   # W = 9: outcome, dense@rollout, dense@remaining
    .venv/bin/python -m bench.credit_schemes_cheap.cheap_cost --quick       # every path at tiny settings

The arms are trained in turns, `--chunk` iterations at a time (each run extended by the same command
with more `run.iterations`), so a load that comes and goes falls on all of them alike; one torch
thread. Prints each arm's median NFEs and seconds an iteration, per stage, and the ratios to outcome;
`docs/bench/credit_schemes_cheap/cost.json` keeps them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench._lib.common import ROOT, machine, relative, write_json
from bench._lib.warm import Stepgrpo

ARMS = {
    "outcome_w9": ["--config", "configs/shapes_outcome_w9.yaml"],
    "dense_rollout_w9": ["--config", "configs/shapes_dense_w9.yaml", "--set", "completion.method=rollout"],
    "dense_w9": ["--config", "configs/shapes_dense_w9.yaml"],
}


def costs(run_dir: Path) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "stepgrpo_cli", "inspect", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["iterations"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cheap_cost")
    a = ap.parse_args()
    sets = ["run.eval_prompts=1", "run.eval_seeds=1", "run.eval_every=1000"]
    if a.quick:
        a.iterations, a.chunk = 2, 1
        sets += ["run.prompts_per_iteration=2", "run.group_size=4", "optim.diagnostics=false"]
    out = a.out.resolve()
    start = machine()
    with Stepgrpo(1, out) as stepgrpo:
        for n in range(a.chunk, a.iterations + 1, a.chunk):
            for arm, args in ARMS.items():
                cmd = ["train", *args, "--run-dir", str(out / arm)]
                cmd += [x for s in [*sets, f"run.iterations={n}"] for x in ("--set", s)]
                if stepgrpo.run(cmd, out / f"{arm}.log") != 0:
                    raise SystemExit(f"{arm} failed; see {relative(out / f'{arm}.log')}")
    result = {"machine": {"start": start, "end": machine()}, "iterations": a.iterations, "arms": {}}
    for arm in ARMS:
        its = costs(out / arm)[1:]  # the first iteration pays the process's one-time costs
        stages = sorted({k for it in its for k in it["seconds_stages"]})
        result["arms"][arm] = {
            "nfe": statistics.median(it["nfe"] for it in its),
            "seconds": statistics.median(it["seconds"] for it in its),
            "seconds_stages": {k: statistics.median(it["seconds_stages"].get(k, 0.0) for it in its) for k in stages},
            "nfe_stages": {
                k: statistics.median(it["nfe_stages"].get(k, 0) for it in its) for k in its[0]["nfe_stages"]
            },
        }
    base = result["arms"]["outcome_w9"]
    for arm, r in result["arms"].items():
        r["nfe_ratio"] = r["nfe"] / base["nfe"]
        r["seconds_ratio"] = r["seconds"] / base["seconds"]
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["seconds_stages"].items())
        print(
            f"{arm}: {r['nfe']:.0f} NFEs ({r['nfe_ratio']:.2f}x outcome), {r['seconds']:.2f} s an iteration "
            f"({r['seconds_ratio']:.2f}x; {stages})"
        )
    if not a.quick:
        write_json(ROOT / "docs" / "bench" / "credit_schemes_cheap" / "cost.json", result)
    write_json(out / "cost.json", result)


if __name__ == "__main__":
    main()
