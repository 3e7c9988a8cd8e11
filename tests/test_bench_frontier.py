"""`bench/frontier/frontier.py` (DiffusionNFT and AWM against GRPO) read from records made by hand:
gains pair by prompt within each run, GRPO records that predate backward counts get their passes
from their NFEs, equal compute reads the GRPO record at its evaluation nearest the arm's passes,
and the speed claim is the ratio of passes to the same held-out reward."""

from __future__ import annotations

import argparse
import json

import pytest

P, S, N = 4, 2, 100


@pytest.fixture(scope="module")
def frontier():
    from bench.frontier import frontier

    return frontier


def record(argv: list[str], gains: dict[int, float], per_iteration: int, key: str = "passes") -> dict:
    base = [0.5 + 0.01 * (i % P) for i in range(P * S)]  # a prompt-dependent base the pairing cancels
    evals = {
        str(it): {"label": "x", "prompts": P, "seeds": S, "reward_mean": 0.5 + 0.015 + g,
                  "scores": [b + g for b in base]}
        for it, g in gains.items()
    }  # fmt: skip
    n = max(gains)
    return {"argv": argv, key: [per_iteration] * n, "seconds": [1.0] * n, "evals": evals}


def test_the_frontier_pairs_by_prompt_and_reads_grpo_at_equal_passes(frontier, tmp_path):
    s = frontier.settings(
        argparse.Namespace(quick=False, out=tmp_path, iterations=None, records=tmp_path / "runs", overrides=[])
    )
    s.kept = {"outcome_w3": [tmp_path / "grpo"]}
    # GRPO: 808 NFEs an iteration stored = the rollout's 640 + 168 update forwards (56 kept x 3
    # steps), the ODE reference's 80 not in them -> 808 + 80 + 2 x 168 = 1224 passes
    grpo = record(s.argv("outcome_w3"), {i: 0.001 * i for i in range(0, 401, 25)}, 808, key="nfe")
    assert frontier.grpo_passes(grpo)[0] == 808 + 80 + 2 * 168 == 1224
    for k in range(2):
        (tmp_path / "grpo" / "outcome_w3").mkdir(parents=True, exist_ok=True)
        (tmp_path / "grpo" / "outcome_w3" / f"seed_{k}.json").write_text(json.dumps(grpo))
        for arm, gain in (("nft", 0.2), ("nft_dense_rollout", 0.25)):
            r = record(s.argv(arm), {0: 0.0, 25: gain / 4, 50: gain / 2, 75: 0.75 * gain, 100: gain}, 2952)
            (tmp_path / "runs" / arm).mkdir(parents=True, exist_ok=True)
            (tmp_path / "runs" / arm / f"seed_{k}.json").write_text(json.dumps(r))
    a = frontier.analyse(s, seeds=2)
    assert a["arms"]["nft"]["gain"] == {"0": pytest.approx(0.2), "1": pytest.approx(0.2)}
    # 100 nft iterations = 295,200 passes = 241 GRPO iterations (1224 each): read at 250 (+3.7 %),
    # where GRPO gained 0.25
    ec = a["equal_compute"]["nft - outcome_w3"]
    assert ec["at"] == 100 and ec["outcome_read_at"][0] == [250, pytest.approx(250 * 1224 / 295200, abs=1e-3)]
    assert ec["prompts"]["mean"] == pytest.approx(0.2 - 0.25) and not ec["beats"]
    # without the ODE reference (a diagnostic: nft's ODE rollout is its own, GRPO's 8 groups x 10
    # steps) GRPO's 1144 passes an iteration reach nft's 100 iterations at 258: read at 250
    assert [frontier.reference_passes(s.argv(a)) for a in ("nft", "awm", "outcome_w3")] == [0, 80, 80]
    assert [frontier.reference_passes(s.argv(a)) for a in ("nft_authors", "awm_authors", "dgpo")] == [0, 0, 0]
    net = a["equal_compute_net"]["nft - outcome_w3"]
    assert net["less"] == [0, 80] and net["outcome_read_at"][0] == [250, pytest.approx(250 * 1144 / 295200, abs=1e-3)]
    assert net["prompts"]["mean"] == pytest.approx(0.2 - 0.25)
    assert a["equal_trajectories"]["nft - outcome_w3"]["prompts"]["mean"] == pytest.approx(0.2 - 0.1)
    assert a["credit"]["nft"]["prompts"]["mean"] == pytest.approx(0.05)
    # GRPO first reaches nft's reward (0.2 over its base) at 200 iterations: 200 x 1224 / 295,200
    assert a["speed"]["nft"]["0"] == {"ratio": pytest.approx(200 * 1224 / 295200, abs=1e-3), "lower_bound": False}
    (row,) = [r for r in a["claims"] if r["paper"] == "DiffusionNFT"]
    assert row["verdict"] == "not reached" and "0.83-0.83x" in row["speed"]
    assert "DiffusionNFT" in frontier.summary_md(a)


def test_equal_compute_where_one_seed_s_grpo_record_ends_sooner(frontier):
    """Every seed read at the latest evaluation all reach; beside it, the seeds that reach the last."""
    arm = record([], {0: 0.0, 25: 0.05, 50: 0.1, 75: 0.15, 100: 0.2}, 2952)
    long = record([], {i: 0.001 * i for i in range(0, 401, 25)}, 984)
    short = record([], {i: 0.001 * i for i in range(0, 201, 25)}, 984)
    rec = {("nft", 0): arm, ("nft", 1): arm, ("outcome_w3", 0): long, ("outcome_w3", 1): short}
    # 100 nft iterations = 300 GRPO iterations, which seed 1's record lacks; 75 = 225, read at 200 (-11 %)
    every = frontier.at_equal_compute(rec, "nft", "outcome_w3", 2, 25, 100)
    assert every["at"] == 75 and [r[0] for r in every["outcome_read_at"]] == [225, 200]
    some = frontier.at_equal_compute(rec, "nft", "outcome_w3", 2, 25, 100, every_seed=False)
    assert some["at"] == 100 and some["outcome_read_at"] == [[300, 1.0]] and list(some["per_seed"]) == ["0"]


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["outcome_w3", "outcome_w3_k4"])
def test_a_grpo_record_s_rebuilt_passes_equal_one_iteration_run_again(arm, frontier, harness, tmp_path):
    """Iteration 0 of the recipe a kept GRPO record ran, run again through the pipeline (seed 0: the
    same prompts, noise and update), spends the passes the record's rebuild charges, counted stage
    by stage as they ran (`stepgrpo.reporting.costs`: rollout, ODE reference, update, backward)."""
    from bench._lib.common import ROOT
    from stepgrpo.flows.train import train
    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.run import Run

    s = frontier.settings(
        argparse.Namespace(quick=False, out=tmp_path, iterations=None, records=tmp_path / "runs", overrides=[])
    )
    s.kept = {k: v[2] for k, v in frontier.GRPO.items()}
    record = json.loads(s.record_path(arm, 0).read_text())
    assert "passes" not in record  # made before passes were stored: rebuilt
    argv = s.argv(arm)
    sets = [x for x in argv[1:] if not x.startswith(("run.iterations=", "run.eval"))]
    quick = ["run.iterations=1", "run.eval_every=0", "run.eval_prompts=1", "run.eval_seeds=1", "scale.threads=1"]
    train(config_path=str(ROOT / argv[0]), overrides=[*sets, *quick, "run.seed=0"], run_dir=str(tmp_path / "run"))
    (ran,) = iteration_costs(Run.open(tmp_path / "run"))
    assert ran["nfe_stages"]["ode_reference"] == 80
    assert ran["passes"] == frontier.grpo_passes(record)[0]
