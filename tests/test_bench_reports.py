"""Every recorded question's `--report-only` regenerates its kept reports byte for byte: the records
of docs/bench/<question>/runs copied aside, read again by the question's own command, and every report
file it writes compared with the one kept beside the records (the records of other questions that it
reads are read where they are kept)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "bench"

pytestmark = pytest.mark.slow  # a subprocess each

# question -> (its command's module, extra options); the records are `--records <copy>/runs`
QUESTIONS = {
    "credit_schemes_w9": ("bench.credit_schemes_w9.w9", []),
    "credit_schemes_cheap": ("bench.credit_schemes_cheap.cheap", []),
    "credit_schemes_clip": ("bench.credit_schemes_clip.clip", []),
    "credit_schemes_oracle": ("bench.oracle.oracle", []),
    "frontier": ("bench.frontier.frontier", []),
    "branch_credit": ("bench.branch_credit.branch_credit", []),
}


@pytest.mark.parametrize("question", sorted(QUESTIONS))
def test_report_only_regenerates_the_kept_reports_byte_for_byte(question, tmp_path):
    module, extra = QUESTIONS[question]
    copy = tmp_path / question
    shutil.copytree(DOCS / question, copy)  # the reports too: a report read again names the machine that ran
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file()}
    env = {**os.environ, "STEPGRPO_THREADS": "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-m", module, "--report-only", "--records", str(copy / "runs"), *extra]
    cmd += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = sorted(
        p.relative_to(copy) for p in copy.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns
    )
    assert Path("summary.md") in written, f"{module} --report-only did not write its summary: {written}"
    assert not any(p.parts[0] == "runs" for p in written), "a report wrote into the records"
    differ = [str(p) for p in written if (copy / p).read_bytes() != (DOCS / question / p).read_bytes()]
    assert not differ, f"{module} --report-only regenerated other bytes in: {differ}"
