"""`bench/gpu/gpu.py` runs on the GPU machines only when one is lent; its every code path is kept
working here with `--device cpu --small` (toy sizes), so it does not rot between those runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "models" / "shapes" / "model_index.json").is_file(), reason="needs the shipped model")
def test_gpu_script_runs_end_to_end_on_the_cpu(tmp_path):
    env = {**os.environ, "STEPGRPO_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gpu", "--device", "cpu", "--small", "--out", str(tmp_path)],
        capture_output=True,
        cwd=ROOT,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["status"] == "done"
    assert results["checks"] and all(c["passed"] for c in results["checks"])
    assert "raw" in (tmp_path / "report.txt").read_text()


def test_the_end_to_end_iteration_script_runs_on_the_cpu(tmp_path, server):
    """`bench/gpu/gpu_train.py --small --device cpu`: one `stepgrpo train` iteration of a paper recipe on
    random weights of its architecture, read back per stage (no MFU without a device peak)."""
    env = {**server, "STEPGRPO_THREADS": "1"}  # the tests' Prefect server, not a temporary one
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu.gpu_train",
            "--small",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
        + ["--prompts", "2", "--group", "2", "--recipe", str(ROOT / "configs" / "stepwise_pickscore.yaml")],
        capture_output=True,
        cwd=ROOT,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["trajectories"] == 4 and results["completion"] == "substeps:5"  # the recipe's
    assert all(results["stages"][s]["seconds"] > 0 for s in ("rollout", "complete", "score", "update"))
    assert results["stages"]["complete"]["tflops"] > 0 and results["row_gflops"] > 0
    assert results["stages"]["rollout"]["mfu"] is None  # a CPU has no known peak
