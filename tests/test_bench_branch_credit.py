"""`bench/branch_credit/branch_credit.py` (TempFlow-GRPO's branched rollouts against outcome and AWM)
read from records made by hand: gains pair by prompt, the GRPO records' passes are rebuilt, and the
arm is read against each reference at equal passes."""

from __future__ import annotations

import argparse
import json

import pytest

P, S = 4, 2


def record(argv: list[str], gains: dict[int, float], per_iteration: int, key: str = "passes") -> dict:
    base = [0.5 + 0.01 * (i % P) for i in range(P * S)]
    evals = {
        str(it): {"label": "x", "prompts": P, "seeds": S, "reward_mean": 0.5 + g, "scores": [b + g for b in base]}
        for it, g in gains.items()
    }
    n = max(gains)
    return {"argv": argv, key: [per_iteration] * n, "seconds": [1.0] * n, "evals": evals}


def test_sibling_credit_is_read_against_outcome_at_equal_passes(tmp_path):
    from bench.branch_credit import branch_credit as bc

    s = bc.settings(argparse.Namespace(quick=False, out=tmp_path, iterations=None, records=tmp_path / "runs"))
    s.kept = {"outcome_w3": [tmp_path / "grpo"]}
    # outcome_w3: 808 NFEs stored an iteration -> 1224 passes rebuilt; tempflow 612 passes an iteration:
    # its 100 iterations (61,200) are outcome's 50
    grpo = record(s.argv("outcome_w3"), {i: 0.001 * i for i in range(0, 401, 25)}, 808, key="nfe")
    arm = record(s.argv("tempflow"), {0: 0.0, 25: 0.02, 50: 0.04, 75: 0.06, 100: 0.08}, 612)
    for k in range(2):
        for name, r, root in (("outcome_w3", grpo, tmp_path / "grpo"), ("tempflow", arm, tmp_path / "runs")):
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / f"seed_{k}.json").write_text(json.dumps(r))
    a = bc.analyse(s, seeds=2)
    assert a["arms"]["tempflow"]["passes_per_iteration"] == 612
    eq = a["equal_passes"]["tempflow - outcome_w3"]
    assert eq["at"] == 100 and eq["outcome_read_at"][0] == [50, 1.0]
    assert eq["prompts"]["mean"] == pytest.approx(0.08 - 0.05) and eq["beats"] is True  # every prompt +0.03
    assert a["equal_trajectories"]["tempflow - outcome_w3"]["prompts"]["mean"] == pytest.approx(0.08 - 0.1)
    assert "tempflow - outcome_w3" in bc.summary_md(a)
