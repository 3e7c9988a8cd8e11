"""bench/credit_quality.py's reading of stored checks: the table, the verdicts, the plot (no model)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
credit_quality = pytest.importorskip("credit_quality")


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
