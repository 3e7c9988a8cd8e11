"""`bench/_common.setup_env`: a benchmark's `--out` holds everything it makes, its Prefect home too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess (the setting changes its environment and directory)

ROOT = Path(__file__).resolve().parents[1]


def test_a_benchmark_keeps_its_prefect_home_under_its_out_directory(tmp_path):
    out = tmp_path / "new" / "costs"  # nothing of it exists yet
    script = f"""
import json, os
from pathlib import Path
from bench import _common
_common.setup_env(Path({str(out)!r}))
print(json.dumps({{k: os.environ[k] for k in ("PREFECT_HOME", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_HOME"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )  # from the repository, as `python -m bench.<question>.<script>` runs
    assert done.returncode == 0, done.stderr[-3000:]
    settings = json.loads(done.stdout.strip().splitlines()[-1])
    assert settings["PREFECT_HOME"] == str(out / "prefect-home")
    assert float(settings["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]) >= 60
    assert out.is_dir()
