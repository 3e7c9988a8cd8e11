"""The oracle bound: how much could any step-level credit buy in training on this model?

    .venv/bin/python bench/oracle/oracle.py                  # 3 seeds at W = 9, resumable; then the report
    .venv/bin/python bench/oracle/oracle.py --report-only    # the report from the recorded runs
    .venv/bin/python bench/oracle/oracle.py --quick --out /tmp/o   # every path at tiny settings (a test runs it)

Trains `configs/shapes_outcome_w9.yaml` with oracle credit (`bench/oracle/_oracle.py`: every trained step
credited with its Monte-Carlo true advantage from `--continuations` SDE continuations of each state,
common random numbers) for `--iterations`, seed `S` seeing the same prompts and noise as seed `S`
of every arm of `bench/credit_schemes/credit_schemes.py --regime w9 / cheap`, and compares it at equal
trajectories with those arms' records (held-out gain over the base, paired by seed; BENCHMARKS
section 10). Each finished run is kept as a record under docs/bench/credit_schemes_oracle/runs/
(the same format as the comparisons'), the report beside it (`summary.md`, `oracle.csv`).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # `python bench/oracle/oracle.py`: the repository, not bench/, first on the path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._common import ROOT, relative, write_json
from bench.credit_schemes_w9 import _w9
from bench.oracle._oracle import ORACLE, value_name

CONFIG = "configs/shapes_outcome_w9.yaml"
RECORDS = ROOT / "docs" / "bench" / "credit_schemes_oracle" / "runs"
PRESETS = {
    "full": {"iterations": 50, "seeds": 3, "continuations": 2, "eval_every": 25, "set": ["run.eval_seeds=8"]},
    "quick": {
        "iterations": 2,
        "seeds": 1,
        "continuations": 2,
        "eval_every": 1,
        "set": _w9.QUICK_SET,
    },
}
# the arms compared at equal trajectories: (records of, arm)
ARMS = (
    ("credit_schemes_w9", "outcome_w9"),
    ("credit_schemes_w9", "dense_w9"),
    ("credit_schemes_cheap", "dense_rollout_w9"),
)


def argv_of(p: dict[str, Any], seed: int) -> list[str]:
    return [CONFIG, str(p["continuations"]), *p["set"], f"run.iterations={p['iterations']}",
            f"run.eval_every={p['eval_every']}", f"run.seed={seed}"]  # fmt: skip


def train(p: dict[str, Any], seed: int, out: Path, records: Path, arm: str = "oracle_w9") -> None:
    """One oracle run (a process of its own with the benchmarks' environment), then its record as
    `records/<arm>/seed_<seed>.json` (another arm: other overrides in `p["set"]`, e.g. the clip screen's
    binding clip)."""
    from bench._prefect import local_server
    from bench._warm import command_env

    path = records / arm / f"seed_{seed}.json"
    argv = argv_of(p, seed)
    if path.is_file() and json.loads(path.read_text())["argv"] == argv:
        return
    run_dir = out / f"seed_{seed}"
    log = out / f"seed_{seed}.log"
    env = command_env(out)
    t0 = time.perf_counter()
    with local_server(env, out / "prefect-home") as (_, _, env):
        cmd = [sys.executable, "-m", "bench.oracle._oracle", CONFIG, str(run_dir), *argv[1:]]
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{arm} seed {seed} exited {rc}; see {relative(log)}")
    record = _w9.record_of(run_dir, argv)
    record["values"] = values_cost(run_dir)
    write_json(path, record)
    print(f"{arm} seed {seed}: recorded after {time.perf_counter() - t0:.0f} s", flush=True)


def values_cost(run_dir: Path) -> dict[str, list[float]]:
    """Per iteration, the continuations' transformer rows and seconds (not in the run's own costs)."""
    from stepgrpo.storage.run import Run

    run = Run.open(run_dir)
    nfe, seconds = [], []
    for i in run.iterations("checkpoint"):
        table = run.tables.read_rewards(i)
        ((name, version),) = {
            (n, v)
            for n, v in zip(table.column("reward_name").to_pylist(), table.column("reward_version").to_pylist())
            if n.endswith("-value")
        }
        info = run.tables.rows_info("rewards", run.tables.rewards_digest(i, name, version))
        nfe.append(info["nfe"])
        seconds.append(info["seconds"])
    return {"nfe": nfe, "seconds": seconds}


def report(p: dict[str, Any], records: Path) -> dict[str, Any]:
    """Oracle and every compared arm after `iterations`, and the oracle minus each, paired by seed."""
    N = p["iterations"]
    oracle = {}
    for seed in range(p["seeds"]):
        path = records / "oracle_w9" / f"seed_{seed}.json"
        if path.is_file():
            oracle[seed] = json.loads(path.read_text())
    if not oracle:
        raise SystemExit("no oracle run recorded yet: run without --report-only")
    arms: dict[str, dict[int, dict[str, Any]]] = {}
    for regime, arm in ARMS:
        for seed in oracle:
            path = records.parents[1] / regime / "runs" / arm / f"seed_{seed}.json"
            if path.is_file():
                r = json.loads(path.read_text())
                if str(N) in r["evals"]:
                    arms.setdefault(arm, {})[seed] = r
    out: dict[str, Any] = {"iterations": N, "continuations": p["continuations"], "arms": {}, "vs": {}}
    for arm, runs in {"oracle_w9": oracle, **arms}.items():
        gains = {s: _w9.gain(r["evals"]["0"], r["evals"][str(N)]) for s, r in sorted(runs.items())}
        out["arms"][arm] = {"per_seed": gains, "pooled": _w9.over([g[0] for g in gains.values()])}
    for arm, runs in arms.items():
        seeds = sorted(set(runs) & set(oracle))
        diffs = {s: _w9.gain(runs[s]["evals"][str(N)], oracle[s]["evals"][str(N)]) for s in seeds}
        out["vs"][f"oracle_w9 - {arm}"] = {"per_seed": diffs, "pooled": _w9.over([d[0] for d in diffs.values()])}
    out["values_nfe_per_iteration"] = [sum(r["values"]["nfe"]) / len(r["values"]["nfe"]) for r in oracle.values()]
    out["run_nfe_per_iteration"] = [sum(r["nfe"]) / len(r["nfe"]) for r in oracle.values()]
    return out


def fmt(m: float, lo: float, hi: float) -> str:
    return f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def summary_md(a: dict[str, Any]) -> str:
    lines = [
        f"Oracle credit at W = 9 (`bench/oracle/oracle.py`), M = {a['continuations']} continuations per state "
        "with common "
        f"random numbers, after {a['iterations']} iterations (64 trajectories each); held-out gain over the base "
        "(126 prompts x 8 noise seeds; per seed the interval is by prompt, pooled the t-interval over seeds).",
        "",
        "| arm | seeds | gain, pooled | per seed |",
        "|---|---|---|---|",
    ]
    for arm, e in a["arms"].items():
        p = e["pooled"]
        per = "; ".join(f"{s}: {fmt(*g)}" for s, g in e["per_seed"].items())
        lines.append(f"| {arm} | {p['n']} | {fmt(p['mean'], p['lo'], p['hi'])} | {per} |")
    lines += ["", "| comparison | pooled | per seed |", "|---|---|---|"]
    for name, e in a["vs"].items():
        p = e["pooled"]
        per = "; ".join(f"{s}: {fmt(*d)}" for s, d in e["per_seed"].items())
        lines.append(f"| {name} | {fmt(p['mean'], p['lo'], p['hi'])} | {per} |")
    v, r = a["values_nfe_per_iteration"], a["run_nfe_per_iteration"]
    lines += [
        "",
        f"Cost: the values take {sum(v) / len(v):.0f} transformer rows an iteration on top of the run's "
        f"{sum(r) / len(r):.0f} (rollout, ODE reference, update).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--seeds", type=int, help="at most this many seeds")
    ap.add_argument("--only-seed", type=int, help="train this seed alone (several processes share the seeds)")
    ap.add_argument("--out", type=Path, help="run directories (scratch)")
    a = ap.parse_args()
    p = dict(PRESETS["quick" if a.quick else "full"])
    if a.seeds:
        p["seeds"] = min(p["seeds"], a.seeds)
    out = (a.out or ROOT / "bench" / "out" / "oracle").resolve()
    records = (out / "records" / "runs" if a.quick else RECORDS).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from stepgrpo_core.registry import allow

    allow(ORACLE)  # the records are read from the oracle's own run directories
    if not a.report_only:
        for seed in [a.only_seed] if a.only_seed is not None else range(p["seeds"]):
            train(p, seed, out, records)
    analysis = report(p, records)
    where = records.parent
    where.mkdir(parents=True, exist_ok=True)
    write_json(where / "analysis.json", analysis)
    (where / "summary.md").write_text(summary_md(analysis))
    with (where / "oracle.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "gain", "low", "high"])
        for arm, e in analysis["arms"].items():
            for s, g in e["per_seed"].items():
                w.writerow([arm, s, *(f"{x:.6f}" for x in g)])
    print((where / "summary.md").read_text())
    print(f"wrote {relative(where)}/: summary.md, oracle.csv, analysis.json ({value_name('shapes')} rows in the runs)")


if __name__ == "__main__":
    main()
