"""`prefect.yaml`: a local Prefect server, `prefect deploy --all`, and one deployed run through a worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="250")
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "prefect server did not start"
            time.sleep(0.5)
        yield dict(env, PREFECT_API_URL=url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def prefect(env, *args: str, timeout: float = 300) -> str:
    out = subprocess.run([*PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-3000:])
    return out.stdout + out.stderr


def test_prefect_yaml_declares_the_deployments():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert {"train", "evaluate", "rescore"} <= set(by_name)
    assert all(d["work_pool"]["name"] == "stepgrpo" for d in by_name.values())
    assert [s["active"] for s in by_name["train"]["schedules"]] == [False]


def test_deploy_all_and_run_one_deployment_through_a_process_worker(server, tmp_path):
    prefect(server, "work-pool", "create", "stepgrpo", "--type", "process")
    before = (REPO / "prefect.yaml").read_text()
    prefect(server, "--no-prompt", "deploy", "--all")
    assert (REPO / "prefect.yaml").read_text() == before
    listing = prefect(server, "deployment", "ls")
    for name in ("train/train", "evaluate/evaluate", "rescore/rescore", "check/check"):
        assert name in listing, listing
    assert "'active': False" in prefect(server, "deployment", "inspect", "train/train")

    report = tmp_path / "report.json"
    prefect(server, "deployment", "run", "check/check", "--param", f"report={report}")
    worker = prefect(server, "worker", "start", "--pool", "stepgrpo", "--run-once")
    assert report.is_file(), worker[-3000:] + prefect(server, "flow-run", "ls")
    result = json.loads(report.read_text())
    assert result["config"] == "demo" and "turning_point" in result["schemes"] and "shapes" in result["rewards"]
