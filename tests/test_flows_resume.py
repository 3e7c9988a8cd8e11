"""Restart: `kill -9` a training run mid-iteration, rerun the same command, get the same LoRA.

Subprocesses run the real console script (`python -m stepgrpo_cli train ...`) on a tiny
random-weight SD3 pipeline, on the CPU with fixed seeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

KILL_AT = "iter_1/rollout.zarr/_published.json"  # iteration 1 has sampled; its update has not run


@pytest.fixture(scope="module")
def setup(tmp_path_factory, server):
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    root = tmp_path_factory.mktemp("resume")
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(root / "model"))
    # one Prefect server for the three commands (the kill -9 takes the command's group, not the server)
    env = dict(server, MLFLOW_DISABLE_TELEMETRY="true", STEPGRPO_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)  # the default: one store for every run under runs/
    overrides = [
        f"model.path={root / 'model'}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.guidance_scale=2.0",
        "sampler.steps=4",
        "sampler.eval_steps=4",
        "reward.name=jpeg_compressibility",
        "credit.scheme=dense",
        "run.iterations=2",
        "run.prompts_per_iteration=2",
        "run.group_size=4",
        "run.eval_prompts=2",
        "optim.micro_batch=4",
        "optim.lr=1e-3",
        "optim.clip_range=0.05",
        "optim.kl_beta=0.01",
    ]
    return root, env, overrides


def command(run_dir: Path, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "stepgrpo_cli", "train", "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def published(run_dir: Path) -> dict[str, str]:
    """Every published stage manifest's publish time, by path. Not a `.partial` directory's: a kill
    between writing a stage's manifest and the rename that publishes it leaves one there, and the
    resumed run publishes that stage again (it was never published)."""
    return {
        str(p.parent.relative_to(run_dir)): json.loads(p.read_text())["published_at"]
        + json.loads(p.read_text())["digest"]
        for p in run_dir.rglob("_published.json")
        if not any(part.endswith(".partial") for part in p.relative_to(run_dir).parts)
    }


def test_kill_9_mid_iteration_then_resume_is_bit_identical(setup):
    root, env, overrides = setup
    clean = subprocess.run(
        command(root / "runs" / "clean", overrides), env=env, capture_output=True, text=True, timeout=600
    )
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]

    run_dir = root / "runs" / "killed"
    proc = subprocess.Popen(
        command(run_dir, overrides),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / KILL_AT).exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = published(run_dir)
    assert "iter_1/rollout.zarr" in before and "checkpoints/iter_1" not in before, sorted(before)

    resumed = subprocess.run(command(run_dir, overrides), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = published(run_dir)
    assert {k: after[k] for k in before} == before  # nothing published was redone
    assert "checkpoints/iter_1" in after
    assert "base model: " in resumed.stdout and "MLflow store" in resumed.stdout

    for i in range(2):
        a = load_file(str(root / "runs" / "clean" / "checkpoints" / f"iter_{i}" / "lora.safetensors"))
        b = load_file(str(run_dir / "checkpoints" / f"iter_{i}" / "lora.safetensors"))
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].equal(b[name]), (i, name)
    exported = [
        load_file(str(d / "lora" / "pytorch_lora_weights.safetensors")) for d in (root / "runs" / "clean", run_dir)
    ]
    assert all(exported[0][k].equal(exported[1][k]) for k in exported[0])

    # MLflow: one store for both runs; the resumed run continued its MLflow run, one point a step
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    (exp,) = [e for e in client.search_experiments() if e.name == "stepgrpo"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    by_run = {r.data.tags["stepgrpo.run_id"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(by_run) == ["clean", "killed"]  # the resume opened no second MLflow run
    killed = by_run["killed"]
    assert killed.info.status == "FINISHED" and killed.info.run_name == "killed"
    for key, steps in (("reward/mean", [0, 1]), ("seconds/update", [0, 1]), ("eval/mean", [0, 2])):
        history = client.get_metric_history(killed.info.run_id, key)
        assert sorted(m.step for m in history) == steps, (key, history)
        clean_values = {m.step: m.value for m in client.get_metric_history(by_run["clean"].info.run_id, key)}
        if key != "seconds/update":
            assert {m.step: m.value for m in history} == clean_values, key
    images = [a.path for a in client.list_artifacts(killed.info.run_id, "images")]
    assert sorted({int(p.split("+")[2]) for p in images if p.endswith(".png")}) == [0, 2], images
