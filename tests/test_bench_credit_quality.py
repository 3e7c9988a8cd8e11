"""bench/credit_quality/credit_quality.py's reading of stored checks: the table, the verdicts, the plot (no model)."""

import pytest

from bench.credit_quality import credit_quality


def check(diffs):
    rows = [{"scheme": "outcome", "cosine": 0.6, "low": 0.5, "high": 0.7, "raw": 0.5}]
    for scheme, (d, lo, hi) in diffs.items():
        rows.append(
            {"scheme": scheme, "cosine": 0.6 + d, "low": 0.5 + d, "high": 0.7 + d, "raw": 0.5, "diff": d}
            | {"diff_low": lo, "diff_high": hi}
        )
    gradient = {"reliability": 0.8, "half_cosine": 0.67, "rows": rows}
    return {
        "gradient": {"uniform": gradient, "noise": gradient},
        "steps": [{"step": 0, "share": 1.0}],
        "groups": 64,
        "trajectories": 512,
        "continuations": 8,
        "nfe": 100,
        "seconds": 1.0,
    }


def test_the_screen_reads_regimes_off_the_paired_intervals(tmp_path):
    results = [
        {"window": 3, "noise": 0.7, "check": check({"dense": (-0.2, -0.3, -0.1), "stepwise": (0.0, -0.1, 0.1)})},
        {"window": 9, "noise": 0.7, "check": check({"dense": (0.3, 0.2, 0.4), "stepwise": (0.1, 0.05, 0.2)})},
    ]
    screen, steps = credit_quality.rows_of(results)
    assert len(screen) == 2 * 2 * 3 and len(steps) == 2
    text = credit_quality.summary(screen)
    ahead, behind = text.split("Outcome ahead")
    assert "W9 a 0.7 uniform: dense +0.30" in ahead and "W9 a 0.7 uniform: stepwise" in ahead
    assert "W3 a 0.7 uniform: dense -0.20" in behind and "stepwise" not in behind  # a tie is neither
    credit_quality.write_csv(tmp_path / "screen.csv", screen)
    credit_quality.plot(screen, tmp_path / "screen.png")
    assert (tmp_path / "screen.png").stat().st_size > 0
    assert (tmp_path / "screen.csv").read_text().splitlines()[0].startswith("window,noise,weighting,scheme,cosine")


def test_the_method_screen_puts_each_estimator_beside_its_nfes(tmp_path):
    """`--methods`: each scheme x completion method of a stored check as a row with the method's NFEs
    per trajectory (the run's own method named by the scheme alone), a table per window, a plot."""
    c = check({"dense": (0.1, 0.0, 0.2), "dense:rollout": (0.1, 0.0, 0.2), "dense:substeps:2": (0.2, 0.1, 0.3)})
    c["methods"] = {
        "remaining": {"nfe_per_trajectory": 54.0},
        "rollout": {"nfe_per_trajectory": 0.0},
        "substeps:2": {"nfe_per_trajectory": 20.0},
    }
    rows = credit_quality.method_rows([{"window": 9, "noise": 0.7, "check": c}])
    uniform = {(r["scheme"], r["method"]): r for r in rows if r["weighting"] == "uniform"}
    assert uniform["dense", "remaining"]["nfe_per_trajectory"] == 54.0
    assert uniform["dense", "rollout"]["nfe_per_trajectory"] == 0.0
    assert uniform["dense", "substeps:2"]["cosine"] == pytest.approx(0.8)
    assert uniform["outcome", "none (R_T only)"]["nfe_per_trajectory"] == 0
    text = credit_quality.methods_md(rows)
    assert "| `rollout` | 0 | +0.70 [+0.60, +0.80] |" in text and "| `substeps:2` | 20 |" in text
    credit_quality.write_csv(tmp_path / "methods.csv", rows)
    assert "nfe_per_trajectory" in (tmp_path / "methods.csv").read_text().splitlines()[0]
    credit_quality.plot_methods(rows, tmp_path / "methods.png")
    assert (tmp_path / "methods.png").stat().st_size > 0
