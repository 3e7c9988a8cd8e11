"""`bench._lib.common.setup_env`: a benchmark's `--out` holds everything it makes, its Prefect home too."""

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
from bench._lib import common
common.setup_env(Path({str(out)!r}))
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


def test_the_statistics_helpers_say_what_they_compute():
    from bench._lib.common import first_reach, mean_ci, moving_average

    m, lo, hi = mean_ci([0.1, 0.2, 0.3, float("nan")])  # NaN skipped: three seeds
    assert m == pytest.approx(0.2) and lo < 0.2 < hi
    assert hi - m == pytest.approx(4.302653 * 0.1 / 3**0.5, rel=1e-5)  # t(0.975, 2 dof) x s / sqrt(n)
    assert mean_ci([0.4])[0] == 0.4 and mean_ci([0.4])[1] != mean_ci([0.4])[1]  # one value: no interval
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert first_reach([0.1, 0.5, 0.4, 0.9], 0.45) == 2 and first_reach([0.1], 0.5) is None


def test_a_record_is_written_whole_and_names_paths_from_the_repository(tmp_path):
    import numpy as np

    from bench._lib.common import ROOT, relative, write_json

    path = tmp_path / "deep" / "record.json"
    write_json(path, {"b": np.float32(0.5), "a": np.arange(3)})
    assert json.loads(path.read_text()) == {"a": [0, 1, 2], "b": 0.5}
    assert not list(path.parent.glob("*.tmp"))  # written beside, then renamed over
    assert relative(ROOT / "docs" / "METHODS.md") == "docs/METHODS.md" and relative(tmp_path) == str(tmp_path)
