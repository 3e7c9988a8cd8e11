"""The oracle bound: how much could any step-level credit buy in training on this model?

    .venv/bin/python -m bench.oracle.oracle                  # 3 seeds at W = 9, resumable; then the report
    .venv/bin/python -m bench.oracle.oracle --report-only    # the report from the recorded runs
    .venv/bin/python -m bench.oracle.oracle --quick --out /tmp/o   # every path at tiny settings (a test runs it)

Trains `configs/shapes_outcome_w9.yaml` with oracle credit (`bench/_lib/oracle.py`: every trained step
credited with its Monte-Carlo true advantage from `--continuations` SDE continuations of each state,
common random numbers) for `--iterations`, seed `S` seeing the same prompts and noise as seed `S`
of every arm of `python -m bench.credit_schemes_w9.w9` and `bench.credit_schemes_cheap.cheap`, and compares it at equal
trajectories with those arms' records (held-out gain over the base, paired by seed; BENCHMARKS
section 10). Each finished run is kept as a record under docs/bench/credit_schemes_oracle/runs/
(the same format as the comparisons'), the report beside it (`summary.md`, `oracle.csv`).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from bench._lib import window as _w9
from bench._lib.common import ROOT, relative, write_json
from bench._lib.oracle import ORACLE, PRESETS, train, value_name

RECORDS = ROOT / "docs" / "bench" / "credit_schemes_oracle" / "runs"
# the arms compared at equal trajectories: (records of, arm)
ARMS = (
    ("credit_schemes_w9", "outcome_w9"),
    ("credit_schemes_w9", "dense_w9"),
    ("credit_schemes_cheap", "dense_rollout_w9"),
)


def report(p: dict[str, Any], records: Path, compared: Path) -> dict[str, Any]:
    """Oracle and every compared arm (their records under `compared/<question>/runs`) after
    `iterations`, and the oracle minus each, paired by seed."""
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
            path = compared / regime / "runs" / arm / f"seed_{seed}.json"
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
    ap.add_argument("--records", type=Path, help="where the oracle's records are kept (its reports beside them)")
    a = ap.parse_args()
    p = dict(PRESETS["quick" if a.quick else "full"])
    if a.seeds:
        p["seeds"] = min(p["seeds"], a.seeds)
    out = (a.out or ROOT / "bench" / "out" / "oracle").resolve()
    records = (a.records or (out / "records" / "runs" if a.quick else RECORDS)).resolve()
    compared = out if a.quick else RECORDS.parents[1]  # the other questions' records
    out.mkdir(parents=True, exist_ok=True)
    from stepgrpo_core.registry import allow

    allow(ORACLE)  # the records are read from the oracle's own run directories
    if not a.report_only:
        for seed in [a.only_seed] if a.only_seed is not None else range(p["seeds"]):
            train(p, seed, out, records)
    analysis = report(p, records, compared)
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
