"""`python -m bench.credit_schemes_w9.w9` (`bench/_lib/window.py`) read from records
made by hand: the pairing by seed, the equal-compute reading of an outcome arm at its first evaluation with at least
the arm's cost (flagged when it ran short), the claims and the report. Training itself is the same
`stepgrpo train` as the early-window comparison's (tests/test_bench_credit_schemes.py)."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def w9():
    from bench._lib import window as _w9

    return _w9


def settings(w9, tmp_path: Path):
    a = argparse.Namespace(
        quick=True, gpu=False, seeds=None, iterations=2, eval_every=1, overrides=[], jobs=1, out=tmp_path, records=None
    )
    return w9.settings(a)


def test_each_preset_keeps_its_records_apart(w9):
    """The GPU preset (8x the trajectories, outcome against dense) and the quick one never write into
    the CPU comparison's records, which the report and BENCHMARKS read."""

    def of(**flags):
        a = dict(quick=False, gpu=False, seeds=None, iterations=None, eval_every=None, overrides=[], jobs=None)
        return w9.settings(argparse.Namespace(**(a | flags), out=None, records=None))

    full, gpu, quick = of(), of(gpu=True), of(quick=True)
    assert full.records == w9.RECORDS.resolve()
    assert gpu.records.parent.name == "credit_schemes_w9_gpu" and quick.records.parent.name == "credit_schemes_w9_quick"
    assert {full.out, gpu.out, quick.out} == {full.out.parent / f"credit_schemes_w9{x}" for x in ("", "_gpu", "_quick")}
    assert "model.device=cuda" in gpu.overrides and "run.prompts_per_iteration=64" in gpu.overrides
    assert {a for a, n in gpu.seeds.items() if n} == {"outcome_w9", "dense_w9"} and gpu.jobs == 4
    assert gpu.outcome_iterations["outcome_w9"] >= 3.4 * gpu.iterations  # outcome reaches dense's cost


PROMPTS, SEEDS = 3, 2  # 6 held-out samples an evaluation, seed-major


def evaluation(label: str, scores: list[float]) -> dict:
    return {
        "label": label,
        "prompts": PROMPTS,
        "seeds": SEEDS,
        "reward_mean": sum(scores) / len(scores),
        "scores": scores,
    }


def record(s, arm: str, seed: int, nfe: int, evals: dict[int, list[float]]) -> None:
    n = max(evals)
    path = s.record_path(arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "argv": s.argv(arm),
        "nfe": [nfe] * n,
        "seconds": [nfe / 100] * n,
        "setup_seconds": 0.0,
        "train_reward": [0.0] * n,
        "evals": {str(i): evaluation("base" if i == 0 else f"iter_{i - 1}", v) for i, v in evals.items()},
    }
    path.write_text(json.dumps(body))


def test_the_papers_regime_report_pairs_by_seed_and_reads_outcome_at_equal_compute(w9, tmp_path):
    s = settings(w9, tmp_path)
    base = [0.0, 0.2, 0.4, 0.1, 0.3, 0.5]
    plus = lambda d: [x + d for x in base]  # noqa: E731
    for seed in (0, 1):
        # outcome_w9 costs 100 NFEs an iteration and rises by 0.01 an evaluated iteration
        record(s, "outcome_w9", seed, 100, {i: plus(0.01 * i) for i in range(5)})
        # dense_w9 costs 300 an iteration: after 2 it has spent 600, outcome reaches that never (4 x 100)
        record(s, "dense_w9", seed, 300, {0: base, 1: plus(0.05), 2: plus(0.10 + 0.01 * seed)})
    record(s, "stepwise_w9", 0, 150, {0: base, 1: plus(0.0), 2: plus(0.03)})
    record(s, "turning_point_w9", 0, 300, {0: base, 1: plus(0.0), 2: plus(0.0)})
    record(s, "outcome_w3", 0, 50, {i: plus(0.02 * i) for i in range(5)})

    runs = {job: r for job in w9.queue(s) if (r := w9.load(s, *job)) is not None}
    assert len(runs) == 7
    a = w9.analyse(runs, s)
    assert a["pairs"] == PROMPTS * SEEDS
    # every arm's gain over its own base after 2 iterations, per seed and pooled over seeds
    assert [round(x["gain"][0], 6) for x in a["arms"]["dense_w9"]["per_seed"]] == [0.10, 0.11]
    assert a["arms"]["dense_w9"]["gain"]["n"] == 2

    dense = a["vs"]["dense_w9 - outcome_w9"]
    # equal trajectories: both after 2 iterations, paired by seed (a constant shift: a zero-width interval)
    assert [round(x["diff"][0], 6) for x in dense["trajectories"]["per_seed"]] == [0.08, 0.09]
    assert dense["trajectories"]["per_seed"][0]["diff"][1] == pytest.approx(0.08)
    # equal NFEs: outcome never reaches 600 in its 4 iterations: read at its last, and flagged short
    nfe = dense["nfe"]["per_seed"][0]
    assert nfe["outcome_iterations"] == 4 and nfe["cost_ratio"] == pytest.approx(400 / 600) and nfe["short"]
    assert nfe["diff"][0] == pytest.approx(0.10 - 0.04)
    # stepwise spent 300 after 2: outcome's first evaluation with at least that is iteration 3, not short
    step = a["vs"]["stepwise_w9 - outcome_w9"]["nfe"]["per_seed"][0]
    assert step["outcome_iterations"] == 3 and step["cost_ratio"] == 1.0 and not step["short"]
    assert step["diff"][0] == pytest.approx(0.03 - 0.03)
    # the early-window reference is compared on the seeds it has
    assert [x["seed"] for x in a["vs"]["dense_w9 - outcome_w3"]["trajectories"]["per_seed"]] == [0]

    claims = w9.claims(a)
    dense_rows = [r for r in claims if r["paper"] == "DenseGRPO"]
    assert len(dense_rows) == 3  # same iterations, equal NFEs, equal seconds
    assert dense_rows[0]["verdict"] == "consistent"  # +0.08 and +0.09 over 2 seeds: the interval is above 0
    assert "outcome ran short of equal compute" in dense_rows[1]["verdict"]
    assert any("fewer iterations" in r["claim"] for r in claims if r["paper"] == "Stepwise-Flow-GRPO")

    info = {"settings": {}, "machine": {}}
    text = w9.summary_md(a, s, info)
    assert "| dense_w9 - outcome_w9 |" in text and "short" in text
    rows = w9.csv_rows(a)
    path = tmp_path / "comparison.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    pooled = [r for r in csv.DictReader(path.open()) if r["seed"] == "pooled" and r["arm"] == "dense_w9"]
    assert {r["budget"] for r in pooled} == {"trajectories", "nfe", "seconds"}


def test_a_record_of_other_settings_is_not_read(w9, tmp_path):
    s = settings(w9, tmp_path)
    record(s, "dense_w9", 0, 300, {0: [0.0] * 6, 1: [0.0] * 6, 2: [0.0] * 6})
    path = s.record_path("dense_w9", 0)
    body = json.loads(path.read_text())
    body["argv"] = [*body["argv"], "optim.lr=1.0"]
    path.write_text(json.dumps(body))
    assert w9.load(s, "dense_w9", 0) is None  # the run is trained again rather than reported


def test_claims_v2_puts_each_claim_beside_its_early_window_row(w9, tmp_path):
    early = tmp_path / "claims.md"
    early.write_text(
        "| paper | claim | measured here (95 % interval) | verdict |\n|---|---|---|---|\n"
        "| TP-GRPO | higher reward than Flow-GRPO at the same iterations | +0.001 [-0.025, +0.028] | not resolved |\n"
        "| TP-GRPO | reaches Flow-GRPO's reward in about a third of the steps (outcome's reward after 100) | 0.65 | "
        "contradicted |\n"
        "| TP-GRPO | reaches Flow-GRPO's reward in about a third of the steps (outcome's reward at its end) | - | "
        "not resolved |\n"
    )
    rows = [
        {"paper": "TP-GRPO", "claim": "higher reward than Flow-GRPO at the same iterations", "measured": "+0.019",
         "verdict": "consistent"},
        {"paper": "TP-GRPO",
         "claim": "reaches Flow-GRPO's reward in about a third of the steps (outcome_w9's after 100)",
         "measured": "0.82, 0.60", "verdict": "contradicted"},
        {"paper": "DenseGRPO", "claim": "higher reward than Flow-GRPO at equal training seconds", "measured": "-0.04",
         "verdict": "not resolved"},
    ]  # fmt: skip
    lines = w9.claims_v2_md(rows, early).splitlines()
    assert lines[0].startswith("| paper | claim | papers' regime (W = 9)") and len(lines) == 5
    assert lines[2].endswith("| +0.019 | consistent | +0.001 [-0.025, +0.028] | not resolved |")
    assert lines[3].endswith("| 0.82, 0.60 | contradicted | 0.65 | contradicted |")  # the row at 100 iterations
    assert lines[4].endswith("| -0.04 | not resolved | not measured |  |")


def test_the_cheap_regime_borrows_the_outcome_records_that_cover_its_runs(w9, tmp_path):
    """The cheap regime: outcome records of the papers' regime are read where they hold the run asked
    for (the same argv, or more iterations of a constant learning rate); the cheap arm's own are
    written to its own records; claims v3 puts each claim beside version 2's."""
    a = argparse.Namespace(
        quick=False, gpu=False, seeds=None, iterations=2, eval_every=1, overrides=[], jobs=1, out=tmp_path,
        records=tmp_path / "cheap" / "runs", regime="cheap",
    )  # fmt: skip
    s = w9.settings(a)
    s.borrow = tmp_path / "w9" / "runs"
    assert s.arms() == ["outcome_w9", "outcome_w3", "dense_rollout_w9"]
    assert "completion.method=rollout" in s.argv("dense_rollout_w9")
    base = [0.0, 0.2, 0.4, 0.1, 0.3, 0.5]
    plus = lambda d: [x + d for x in base]  # noqa: E731
    # a borrowed outcome_w3 record ran longer (500 iterations where the cheap regime asks for 250)
    more = {**s.outcome_iterations, "outcome_w3": 500}
    longer = w9.W9(**{**vars(s), "records": s.borrow, "borrow": None, "outcome_iterations": more})
    record(longer, "outcome_w3", 0, 50, {i: plus(0.02 * i) for i in range(5)})
    record(longer, "outcome_w9", 0, 100, {i: plus(0.01 * i) for i in range(5)})
    assert s.record_path("outcome_w3", 0).parent.parent == s.borrow  # covered: read from the papers' regime
    assert w9.covers(json.loads(s.record_path("outcome_w3", 0).read_text())["argv"], s.argv("outcome_w3"))
    assert not w9.covers([*s.argv("outcome_w3"), "optim.lr_schedule=cosine"], s.argv("outcome_w3"))
    assert s.record_path("outcome_w3", 1).parent.parent == s.records  # not borrowed: trained here
    record(s, "dense_rollout_w9", 0, 100, {0: base, 1: plus(0.05), 2: plus(0.06)})
    runs = {job: r for job in w9.queue(s) if (r := w9.load(s, *job)) is not None}
    assert set(runs) == {("dense_rollout_w9", 0), ("outcome_w9", 0), ("outcome_w3", 0)}
    analysis = w9.analyse(runs, s)
    nfe = analysis["vs"]["dense_rollout_w9 - outcome_w9"]["nfe"]["per_seed"][0]
    assert nfe["outcome_iterations"] == 2 and not nfe["short"]  # equal NFEs: 200 each
    # an outcome evaluation within 5 % of the arm's cost is the equal-compute point, not the next one
    o = runs["outcome_w9", 0]
    assert w9.matched(o, 0.97 * o.cost(2, "nfe"), "nfe") == 2 and w9.matched(o, 1.03 * o.cost(2, "nfe"), "nfe") == 2
    assert w9.matched(o, 1.2 * o.cost(2, "nfe"), "nfe") == 3
    rows = w9.cheap_claims(analysis)
    assert {r["claim"] for r in rows} >= {
        "higher reward than Flow-GRPO at equal transformer NFEs",
        "higher reward than the best outcome recipe, W = 3, at equal transformer NFEs",
    }
    v2 = tmp_path / "claims_v2.md"
    v2.write_text(
        "| paper | claim | w9 | verdict | w3 | verdict |\n|---|---|---|---|---|---|\n"
        "| DenseGRPO | higher reward than Flow-GRPO at equal transformer NFEs | -0.027 | not resolved | x | y |\n"
    )
    lines = w9.claims_v3_md(rows, v2).splitlines()
    assert "| -0.027 | not resolved | dense_rollout_w9 after 2 - outcome_w9 after 2:" in lines[2]
