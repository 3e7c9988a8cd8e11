"""`bench/credit_schemes/credit_schemes.py` at tiny settings (`--quick`): every configuration trains through the
real `stepgrpo train`, the equal-compute evaluations of `outcome` run through `stepgrpo evaluate`,
and the report (tables, claims, CSVs, plots) is built from the run directories. The `--gpu`
preset shares every line but its settings; its settings are checked here too."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "models" / "shapes" / "model_index.json").is_file(), reason="needs the shipped model")
def test_the_credit_scheme_benchmark_runs_and_reports_from_its_runs(tmp_path, server):
    # one Prefect server for its 10 `stepgrpo train` runs (else each starts a temporary one)
    env = {**server, "STEPGRPO_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.credit_schemes.credit_schemes", "--quick", "--jobs", "2"]
    cmd += ["--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("summary.md", "claims.md", "heldout.csv", "curves.csv", "gains.csv", "ablations.csv", "heldout.png"):
        assert (tmp_path / name).is_file(), name
    a = json.loads((tmp_path / "analysis.json").read_text())

    # every scheme after the same iterations, each paired with outcome of its seed
    eq = a["equal_trajectories"]
    assert set(eq) == {"outcome", "stepwise", "dense", "turning_point"}
    assert all(len(e["per_seed"]) == 2 for e in eq.values())
    # completions cost NFEs: outcome gets more iterations at equal compute, and they were evaluated
    for name in ("stepwise", "dense", "turning_point"):
        nfe = a["equal_compute"][name]["nfe"]
        assert all(x["outcome_iterations"] > 2 for x in nfe["per_seed"]), nfe
        assert all(x["outcome_reward"] == x["outcome_reward"] for x in nfe["per_seed"])  # not NaN
        assert nfe["cost_fraction"]["mean"] >= 1.0 or max(x["outcome_iterations"] for x in nfe["per_seed"]) == 6
    held = list(csv.DictReader((tmp_path / "heldout.csv").open()))
    base = {(r["config"], r["seed"]): r["reward"] for r in held if r["iteration"] == "0"}
    for seed in ("0", "1"):  # the base evaluations of one seed are the same samples in every run
        assert len({base[name, seed] for name in eq}) == 1

    # each ablation that ran paired with its base configuration (the quick preset runs the two with
    # analysis code of their own), and every paper's claims in the table
    assert {k: len(e["per_seed"]) for k, e in a["ablations"].items()} == {
        "ddim_sde": 1,
        "psi": 0,
        "substeps2": 0,
        "tweedie": 0,
        "tp_balance": 1,
    }
    papers = {row["paper"] for row in a["claims"]}
    assert {"Stepwise-Flow-GRPO", "TP-GRPO", "DenseGRPO"} <= papers
    verdicts = {row["verdict"].split(" (")[0] for row in a["claims"]}
    assert verdicts <= {"consistent", "contradicted", "not resolved at this scale", "mixed across steps"}
    assert "| paper | claim |" in (tmp_path / "claims.md").read_text()
    assert a["sde_gap"]["stepwise"] and a["sde_gap"]["stepwise_ddim"]

    # a second call reads the finished runs back and trains nothing
    again = subprocess.run(cmd + ["--report-only"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "analysis.json").read_text())["equal_trajectories"] == eq


def test_the_gpu_preset_runs_eight_times_the_trajectories_on_cuda():
    from bench.credit_schemes import credit_schemes

    s = credit_schemes.settings(credit_schemes.parser().parse_args(["--gpu"]))
    sets = dict(o.split("=", 1) for o in s.overrides)
    assert sets["model.device"] == "cuda"
    assert int(sets["run.prompts_per_iteration"]) == 8 * 8  # the CPU recipe's 8 prompts x 8 samples, times 8
    assert s.seeds == [0, 1, 2]
