"""bench/storage/storage_sd35.py at a small size: it writes, publishes and verifies both stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_sd35_storage_benchmark_stores_both_stages(tmp_path):
    out = tmp_path / "storage.json"
    cmd = [sys.executable, "-m", "bench.storage.storage_sd35", "--trajectories", "30", "--shard", "12"]
    cmd += ["--dir", str(tmp_path)]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    latents = 2 * 30 * 11 * 16 * 64 * 64 * 2  # rollout states and completion latents, bf16
    assert latents < got["bytes"] < 1.1 * latents
    assert set(got["seconds"]) == {"write", "publish", "verify", "sha256"} and min(got["seconds"].values()) > 0
    assert set(got["digest_formats"]) == {"1", "2"} and min(got["digest_formats"].values()) > 0
    assert "% of the iteration" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["storage.json"]  # its store is removed
