"""`bench/credit_schemes_clip/clip.py` (credit where the PPO clip binds) read from records made by hand: each arm pairs
with its one-step record of the same seed, the decision is the difference in differences of the
held-out reward, and the clip diagnostics are summarised per optimizer step of a batch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
P, S = 4, 2  # held-out prompts x noise seeds


@pytest.fixture(scope="module")
def clip():
    from bench.credit_schemes_clip import clip

    return clip


def write(clip, s, arm: str, seed: int, gain: float, parts: list[float] | None = None) -> None:
    """A record whose held-out scores rise by `gain` on every sample from the base to the end,
    plus a prompt-dependent wiggle the pairing must cancel."""
    N = s.iterations
    base = [0.5 + 0.01 * (i % P) for i in range(P * S)]
    evals = {
        str(it): {
            "label": "x",
            "prompts": P,
            "seeds": S,
            "reward_mean": 0.0,
            "scores": [b + gain * it / N for b in base],
        }
        for it in (0, N)
    }
    update = (
        [{"clip_frac_by_part": parts, "zero_grad_frac_by_part": parts, "zero_grad_frac_later": 0.1}] if parts else []
    )
    rec = {"argv": s.argv(arm), "nfe": [100] * N, "seconds": [1.0] * N, "evals": evals, "update": update}
    path = s.records / arm / f"seed_{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))


def test_the_decision_is_a_difference_in_differences_paired_by_seed(clip, tmp_path):
    a = argparse.Namespace(quick=True, out=tmp_path, records=None, iterations=None, overrides=[])
    s = clip.settings(a)
    # per seed: outcome K=1 +0.02, dense K=1 +0.01, outcome K=4 +0.03, dense K=4 +0.05 + 0.01 * seed
    for seed in range(3):
        write(clip, s, "outcome_w9", seed, 0.02)
        write(clip, s, "dense_rollout_w9", seed, 0.01)
        write(clip, s, "outcome_w9_k4", seed, 0.03, parts=[0.0, 0.2, 0.3, 0.4])
        write(clip, s, "dense_rollout_w9_k4", seed, 0.05 + 0.01 * seed, parts=[0.0, 0.1, 0.2, 0.3])
    out = clip.analyse(s, seeds=3)
    d = out["credit"]["dense_rollout_w9"]
    # (0.05 + 0.01 k - 0.03) - (0.01 - 0.02) = 0.03 + 0.01 k
    assert [round(v, 6) for v in d["per_seed"].values()] == [0.03, 0.04, 0.05]
    assert d["seeds"]["mean"] == pytest.approx(0.04) and d["seeds"]["lo"] > 0 and d["matters"]
    assert d["prompts"]["mean"] == pytest.approx(0.04)
    assert d["at_k4"]["seeds"]["mean"] == pytest.approx(0.03)  # dense - outcome, both at K = 4
    assert out["vs_one_step"]["outcome_w9_k4 - outcome_w9"]["seeds"]["mean"] == pytest.approx(0.01)
    assert out["arms"]["outcome_w9_k4"]["clip"]["clip_frac_by_part"] == pytest.approx([0.0, 0.2, 0.3, 0.4])
    # a scheme whose one-step arm has no record waits for it, rather than pairing with another arm
    assert "stepwise_rollout_w9" not in out["credit"]
    text = clip.summary_md(out)
    assert "| dense_rollout_w9 | 3 |" in text and "| yes |" in text


def test_a_record_of_other_settings_is_not_read(clip, tmp_path):
    a = argparse.Namespace(quick=True, out=tmp_path, records=None, iterations=None, overrides=[])
    s = clip.settings(a)
    write(clip, s, "outcome_w9_k4", 0, 0.03)
    path = s.records / "outcome_w9_k4" / "seed_0.json"
    rec = json.loads(path.read_text())
    rec["argv"] = [x.replace("optimizer_steps=4", "optimizer_steps=2") for x in rec["argv"]]
    path.write_text(json.dumps(rec))
    assert s.load("outcome_w9_k4", 0) is None


def test_the_two_level_bootstrap_carries_both_spreads(clip):
    from bench._lib.stats import two_level

    assert two_level({0: [0.01] * 5, 1: [0.01] * 5}) == pytest.approx((0.01, 0.01, 0.01))
    m, lo, hi = two_level({0: [0.0, 0.02] * 10, 1: [0.01, 0.03] * 10, 2: [0.02, 0.04] * 10})
    assert m == pytest.approx(0.02) and lo < 0.02 < hi and hi - lo < 0.03
    assert two_level({0: [0.0, 0.02]})[1] != two_level({0: [0.0, 0.02]})[1]  # one seed: no interval (NaN)


def test_the_oracle_where_the_clip_binds_is_read_at_its_own_budget(clip, tmp_path, monkeypatch):
    """The oracle runs 50 iterations (bench/oracle/oracle.py's budget): its difference in differences pairs
    each arm's evaluation after 50, the one-step oracle read from its own records."""
    a = argparse.Namespace(quick=True, out=tmp_path, records=None, iterations=None, overrides=[])
    s = clip.settings(a)
    it = clip.ORACLE_ITERATIONS
    base = [0.5 + 0.01 * (i % P) for i in range(P * S)]

    def record(gain: float) -> dict:
        evals = {str(k): {"prompts": P, "seeds": S, "scores": [b + gain * k / it for b in base]} for k in (0, it)}
        return {"argv": [], "nfe": [100] * it, "seconds": [1.0] * it, "evals": evals}

    one_step = tmp_path / "oracle_one_step"
    monkeypatch.setattr(clip, "ORACLE_ONE_STEP", one_step)
    rec = {}
    for seed in range(3):  # oracle K=4 +0.05, outcome K=4 +0.03, oracle K=1 +0.025, outcome K=1 +0.02
        for folder, gain in ((s.records / clip.ORACLE_ARM, 0.05), (one_step, 0.025)):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"seed_{seed}.json").write_text(json.dumps(record(gain)))
        rec[("outcome_w9_k4", seed)], rec[("outcome_w9", seed)] = record(0.03), record(0.02)
    out = clip.oracle_did(s, rec)
    assert out["did"]["seeds"]["mean"] == pytest.approx((0.05 - 0.03) - (0.025 - 0.02))
    assert out["at_k4"]["seeds"]["mean"] == pytest.approx(0.02) and out["did"]["n"] == 3
