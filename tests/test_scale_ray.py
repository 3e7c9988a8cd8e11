"""Scale-out on a local Ray cluster of 2 workers (docs/SCALING.md): shards store the in-process
bytes, a killed worker's shard is retried, a killed shard is the only one computed again, and
workers that served earlier flows (their models loaded) store the same bytes.
Its own file, so that it runs beside the in-process tests (tests/test_scale.py) on another worker."""

from __future__ import annotations

import pytest
import torch
from scale_fixtures import RAY, _train, lora, reference, stored, tiny  # noqa: F401  (fixtures)

from stepgrpo.errors import StageError
from stepgrpo.storage.run import Run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(prefect_server, tmp_path_factory):
    """One local Ray cluster of 2 CPUs for the file, started in this process as a long-lived driver
    (a notebook, a service) starts it: every flow here runs on it (the flow reuses an initialized
    Ray), so its workers live from flow to flow with what they loaded, and only the killed ones
    start again. Its workers run at niceness 0: at Ray's default 15 they would get the CPU last
    beside the other tests of `pytest -n`. Yields the file its workers read their fault from
    (`STEPGRPO_FAULT=@file`: their environment is fixed when they start)."""
    import ray

    fault = tmp_path_factory.mktemp("ray-fault") / "fault"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        env.setenv("STEPGRPO_FAULT", f"@{fault}")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
        )
    yield fault
    ray.shutdown()


@pytest.fixture
def fault(cluster):
    """`fault(spec)`: the fault of this test's runs on the cluster (none after the test)."""
    yield cluster.write_text
    cluster.unlink(missing_ok=True)


def test_ray_shards_store_the_in_process_bytes_and_a_killed_worker_is_retried(
    harness, tiny, reference, tmp_path, fault
):
    # The rollout shard at row 6 ends its worker process half-way (as kill -9 would), once.
    fault(f"kill:rollout:6:{tmp_path / 'killed'}")
    run_dir = tmp_path / "ray-retried"  # its flow run's name, unique on the session's server
    _train(tiny, run_dir, *RAY)
    assert (tmp_path / "killed").exists()  # the fault fired
    assert stored(run_dir) == stored(reference)
    for i in (0, 1):
        assert torch.equal(lora(run_dir, i), lora(reference, i))
    run = Run.open(run_dir)
    assert run.stage_manifest(0, "rollout")["inputs"]["shards"]["total"] == 4
    # the reward is loaded once per worker process, not once per shard
    shards = [
        s
        for i in (0, 1)
        for s in run.tables.rows_info("rewards", run.tables.rewards_digest(i, "jpeg_compressibility", "1"))["shards"]
    ]
    assert len(shards) == 8 and all(s["reward_loads"] == 1 for s in shards)
    assert len({s["pid"] for s in shards}) < len(shards)
    # every shard is a Prefect task run of the flow, named, finished (the killed one retried by Ray)
    names = shard_task_runs(run.run_id)
    assert {
        "rollout-shard iter_0 rows 0-5",
        "rollout-shard iter_0 rows 6-11",
        "complete-shard iter_1 rows 18-23",
    } <= set(names), names
    assert names["rollout-shard iter_0 rows 6-11"] == ["COMPLETED"]


def shard_task_runs(run_id: str, timeout: float = 30.0) -> dict[str, list[str]]:
    """The task runs of the flow run named `run_id`, by name -> their states (the flow reports its
    task runs as events: wait until the server holds a finished one for each)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            (flow_run,) = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id])),
                sort=FlowRunSort.START_TIME_DESC,
                limit=1,
            )
            this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
            names: dict[str, list[str]] = {}
            for t in client.read_task_runs(flow_run_filter=this_run):
                names.setdefault(t.name, []).append(t.state_type.value if t.state_type else "")
            shards = [v for k, v in names.items() if "-shard " in k]
            if (shards and all(v == ["COMPLETED"] for v in shards)) or time.monotonic() > deadline:
                return names
            time.sleep(0.5)


def test_a_killed_shard_is_the_only_one_computed_again(harness, tiny, reference, tmp_path, fault):
    # No retry: the stage fails when the completion shard at row 12 dies half-way; run it again.
    fault(f"kill:complete:12:{tmp_path / 'killed'}")
    run_dir = tmp_path / "ray"
    with pytest.raises(StageError, match=r"1 of 4 shard\(s\) failed \(rows 12-17\)"):
        _train(tiny, run_dir, *RAY, "scale.shard_retries=0")
    partial = run_dir / "iter_0" / "completions" / ".remaining.zarr.partial"
    assert sorted(p.name for p in (partial / "_shards").glob("shard-*")) == [
        "shard-0000000-0000006.json",
        "shard-0000006-0000012.json",
        "shard-0000018-0000024.json",
    ]
    _train(tiny, run_dir, *RAY, "scale.shard_retries=0")  # the same command again
    run = Run.open(run_dir)
    assert run.stage_manifest(0, "completions/remaining")["inputs"]["shards"]["computed"] == [[12, 18]]
    assert not partial.exists()
    assert stored(run_dir) == stored(reference)


def test_workers_keep_their_models_over_a_run_and_apply_each_iterations_lora(harness, tiny, tmp_path, cluster):
    """Over 3 iterations, each worker process loads each model (policy, decoder, reward) at most
    once, whatever shards and iterations it serves: they stay loaded, and each iteration's LoRA is
    applied to the kept policy (`workspace.policy_at`), not loaded with a new one. (The file's
    workers serve only this tiny model, so a worker that served an earlier test holds it too.)"""
    run_dir = tmp_path / "ray3"
    _train(tiny, run_dir, *RAY, "run.iterations=3", "run.eval_prompts=2", "run.eval_seeds=1")
    run = Run.open(run_dir)
    loads: dict[int, list[dict[str, int]]] = {}  # pid -> its model loads at each shard, in order
    for i in range(3):
        for w in [
            *run.stage_manifest(i, "rollout")["inputs"]["shards"]["workers"],
            *run.stage_manifest(i, "completions/remaining")["inputs"]["shards"]["workers"],
            *run.tables.rows_info("rewards", run.tables.rewards_digest(i, "jpeg_compressibility", "1"))["shards"],
        ]:
            loads.setdefault(w["pid"], []).append(w["loads"])
    assert sum(map(len, loads.values())) == 3 * 12 and len(loads) <= 2  # two worker processes served them all
    for pid, seen in loads.items():
        assert all(n <= 1 for counts in seen for n in counts.values()), f"worker {pid} loaded a model again: {seen}"
    assert any(counts.get("reward") == 1 for seen in loads.values() for counts in seen)
