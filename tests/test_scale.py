"""Scale-out (docs/SCALING.md), in this process: a failed shard is redone alone, the data-parallel
update matches the one-process update, a reward behind HTTP scores what the local reward scores,
and the in-process path never imports Ray. The Ray workers' tests are tests/test_scale_ray.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from scale_fixtures import RAY, SHARDED, _train, lora, reference, stored, tiny  # noqa: F401  (fixtures)

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.paths import REPO_ROOT
from stepgrpo.storage.run import Run
from stepgrpo.tasks import bind

pytestmark = pytest.mark.slow


def test_in_process_shards_resume_the_same_way(harness, tiny, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("STEPGRPO_FAULT", f"raise:rollout:6:{tmp_path / 'failed'}")
    run_dir = tmp_path / "process"
    with pytest.raises(Exception, match="STEPGRPO_FAULT"):
        _train(tiny, run_dir, *SHARDED, "scale.stage_retries=0")
    _train(tiny, run_dir, *SHARDED)
    assert Run.open(run_dir).stage_manifest(0, "rollout")["inputs"]["shards"]["computed"] == [
        [6, 12],
        [12, 18],
        [18, 24],
    ]
    assert stored(run_dir) == stored(reference)


def test_a_failed_stage_is_retried_by_prefect_and_the_retry_keeps_its_finished_shards(
    harness, tiny, reference, tmp_path, monkeypatch
):
    # The same fault as above, with the default `scale.stage_retries`: one command finishes the run.
    monkeypatch.setenv("STEPGRPO_FAULT", f"raise:rollout:6:{tmp_path / 'failed'}")
    run_dir = tmp_path / "retried"
    _train(tiny, run_dir, *SHARDED, "scale.stage_retry_delay_s=0.5")  # the default waits 10 s
    assert (tmp_path / "failed").exists()  # the fault fired
    stages = bind(Run.open(run_dir), load_config(None, [*tiny, "scale.stage_retry_delay_s=0.5"]))
    assert (stages.rollout.retries, stages.rollout.retry_delay_seconds) == (1, 0.5)
    assert Run.open(run_dir).stage_manifest(0, "rollout")["inputs"]["shards"]["computed"] == [
        [6, 12],
        [12, 18],
        [18, 24],
    ]
    assert stored(run_dir) == stored(reference)


def test_the_two_process_update_matches_the_one_process_update_and_a_killed_rank_reruns_to_the_same_bytes(
    harness, tiny, reference, tmp_path, monkeypatch
):
    """On the same inputs: the reference run with its last checkpoint removed, resumed with two
    update processes (the update of iteration 1 loads iteration 0's AdamW state). A fresh
    two-process run drifts from the reference after its first update: its weights differ in the
    8th digit, and the next rollout's 8-bit images (what the reward scores) amplify that. A copy
    whose last rank dies mid-update fails the stage, publishes nothing, and its rerun computes the
    two-process update's bytes."""
    import shutil
    import socket

    runs = {}
    for name in ("killed", "two-processes"):
        runs[name] = tmp_path / name
        shutil.copytree(reference, runs[name])
        shutil.rmtree(runs[name] / "checkpoints" / "iter_1")
    run_dir = runs["two-processes"]
    _train(tiny, run_dir, "scale.update_processes=2")
    run = Run.open(run_dir)
    assert run.stage_manifest(1, "checkpoint")["inputs"]["processes"] == 2
    assert "processes" not in run.stage_manifest(0, "checkpoint")["inputs"]  # reused, not recomputed
    a, b = lora(reference, 1), lora(run_dir, 1)
    assert not torch.equal(a, lora(reference, 0))  # iteration 1 moved the weights
    assert float((a - b).norm() / a.norm()) < 1e-6
    ref_state = json.loads((reference / "checkpoints" / "iter_1" / "state.json").read_text())["update"]
    state = json.loads((run_dir / "checkpoints" / "iter_1" / "state.json").read_text())["update"]
    assert state["trained_trajectories"] == ref_state["trained_trajectories"]
    assert state["loss"] == pytest.approx(ref_state["loss"], rel=1e-4, abs=1e-7)
    assert state["grad_norm"] == pytest.approx(ref_state["grad_norm"], rel=1e-4)

    monkeypatch.setenv("STEPGRPO_FAULT", f"kill:update:1:{tmp_path / 'fired'}")  # the last rank dies, once
    with pytest.raises(
        Exception, match=rf"update over 2 processes failed \(rank 1 on {socket.gethostname()}, exit 137"
    ):
        _train(tiny, runs["killed"], "scale.update_processes=2")
    assert (tmp_path / "fired").exists() and run_stage_missing(runs["killed"], 1)  # nothing half-published
    _train(tiny, runs["killed"], "scale.update_processes=2")  # the rerun: a new group
    assert torch.equal(lora(runs["killed"], 1), lora(run_dir, 1))


def test_kept_ranks_load_the_policy_once_over_a_run_and_match_the_in_process_update(harness, tiny, reference, tmp_path):
    """`scale.update_processes=2` over 3 iterations: the same two rank processes compute every
    update, each loading the policy once (later updates apply the previous checkpoint's LoRA to
    it); the first update, on the reference's inputs, is the in-process update within 1e-6."""
    run_dir = tmp_path / "kept"
    _train(tiny, run_dir, "scale.update_processes=2", "run.iterations=3", "run.eval_prompts=2", "run.eval_seeds=1")
    run = Run.open(run_dir)
    ranks = [run.stage_manifest(i, "checkpoint")["inputs"]["ranks"] for i in range(3)]
    assert all(len(r) == 2 for r in ranks)
    assert [[w["pid"] for w in r] for r in ranks] == [[w["pid"] for w in ranks[0]]] * 3  # the same processes
    assert all(w["loads"].get("policy") == 1 for r in ranks for w in r)  # loaded once, kept
    a, b = lora(reference, 0), lora(run_dir, 0)
    assert float((a - b).norm() / a.norm()) < 1e-6


def run_stage_missing(run_dir, iteration: int) -> bool:
    return Run.open(run_dir).stage_manifest(iteration, "checkpoint") is None


def test_shards_must_hold_whole_model_calls(tiny, tmp_path):
    from stepgrpo.checks import check_config
    from stepgrpo.config import load_config

    cfg = load_config(None, [*tiny, "scale.groups_per_shard=3"])
    with pytest.raises(StageError, match=r"groups_per_shard=3 would split a model call: one call takes 2 group"):
        check_config(cfg)


# ------------------------------------------------------------------ a reward behind HTTP


@pytest.fixture
def served():
    from stepgrpo.rewards import build_reward
    from stepgrpo.rewards.service import serve

    server = serve(build_reward("shapes"), port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_http_reward_scores_what_the_local_reward_scores(served):
    from stepgrpo.images import from_uint8
    from stepgrpo.rewards import build_reward, reward_identity
    from stepgrpo.shapes import data

    rng = np.random.default_rng(0)
    specs = [data.all_specs()[i] for i in rng.integers(0, 900, 12)]
    images = from_uint8(np.stack([data.render(s, rng) for s in specs]))
    images[6:] = torch.rand(6, *images.shape[1:], generator=torch.Generator().manual_seed(0))  # not on the 8-bit grid
    prompts, metadata = [data.prompt_of(s) for s in specs], specs
    local = build_reward("shapes")
    spec = {"name": "http", "options": {"url": served, "name": local.name, "version": local.version, "batch": 5}}
    assert reward_identity(spec) == (local.name, local.version)  # declared: no request made
    remote = build_reward(spec)
    a, b = local(images, prompts, metadata), remote(images, prompts, metadata)
    assert torch.equal(a.scores, b.scores)
    assert torch.equal(a.strict, b.strict)
    assert a.sub.keys() == b.sub.keys() and all(
        torch.allclose(a.sub[n], b.sub[n], rtol=0, atol=0, equal_nan=True) for n in a.sub
    )


def test_the_http_reward_refuses_a_server_serving_another_reward(served):
    from stepgrpo.rewards import build_reward

    remote = build_reward({"name": "http", "options": {"url": served, "name": "pickscore", "version": "1"}})
    with pytest.raises(RuntimeError, match="serves shapes v.*but the config declares pickscore v1"):
        remote(torch.zeros(1, 3, 8, 8), ["a red circle"], [{}])


def test_the_http_reward_names_an_unreachable_server():
    from stepgrpo.rewards import build_reward

    options = {"url": "http://127.0.0.1:9", "name": "x", "version": "1", "backoff": 0.01}  # tried 4 times in 0.07 s
    remote = build_reward({"name": "http", "options": options})
    with pytest.raises(RuntimeError, match="cannot be reached.*stepgrpo reward-server"):
        remote(torch.zeros(1, 3, 8, 8), ["a red circle"], [{}])


def test_the_in_process_path_never_imports_ray(tiny, tmp_path, server):
    script = f"""
import sys
from stepgrpo.flows.train import train
train(overrides={[*tiny, "run.iterations=1", "run.prompts_per_iteration=2"]!r}, run_dir={str(tmp_path / "run")!r})
print("RAY" if any(m == "ray" or m.startswith(("ray.", "prefect_ray")) for m in sys.modules) else "NO RAY")
"""
    env_keys = ("PATH", "HOME", "PREFECT_SERVER_ANALYTICS_ENABLED", "MLFLOW_DISABLE_TELEMETRY", "PREFECT_HOME")
    env_keys += ("PREFECT_API_URL", "STEPGRPO_CACHE_DIR")  # the session's server and the tests' cache
    env = {k: server[k] for k in env_keys if k in server}
    env.update(STEPGRPO_PROGRESS="0")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "NO RAY"


def test_a_node_that_cannot_see_the_run_directory_stops_the_run(tmp_path, monkeypatch):
    """`check_shared` on a cluster whose one node reads nothing at the probe's path (as a node
    without the shared filesystem would): Ray's calls are replaced, the check's logic is real."""
    import ray

    from stepgrpo.runtime.workers import check_shared

    class Remote:
        def options(self, **_):
            return self

        def remote(self, path):
            return path

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": "ab" * 28, "NodeManagerAddress": "10.0.0.7"}])
    monkeypatch.setattr(ray, "remote", lambda **_: lambda fn: Remote())
    monkeypatch.setattr(ray, "get", lambda refs: [None for _ in refs])  # the node found no file there
    with pytest.raises(StageError, match=r"not visible from Ray node 10.0.0.7.*filesystem every node mounts"):
        check_shared(tmp_path)
    assert not list(tmp_path.glob(".probe-*"))  # the probe is removed either way


def test_ranks_share_a_gpu_through_gloo():
    """NCCL refuses two ranks on one device: ranks that share a GPU (more ranks than the node's GPUs,
    or a Ray bundle of less than one GPU) sum through gloo; a GPU each takes NCCL; CPUs take gloo."""
    from stepgrpo.loops.update import group_backend

    assert group_backend(gpu=True, gpus_per_rank=1.0) == "nccl"
    assert group_backend(gpu=True, gpus_per_rank=2.0) == "nccl"
    assert group_backend(gpu=True, gpus_per_rank=0.5) == "gloo"  # 2 ranks on 1 GPU, as bench/scale/scale.py ran it
    assert group_backend(gpu=False, gpus_per_rank=0.0) == "gloo"
