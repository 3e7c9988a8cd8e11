"""Scale-out on a local Ray cluster of 2 workers (docs/SCALING.md): shards store the in-process
bytes, a killed worker's shard is retried, a killed shard is the only one computed again, and
workers that served earlier flows (their models loaded) store the same bytes.
Its own file, so that it runs beside the in-process tests (tests/test_scale.py) on another worker."""

from __future__ import annotations

import pytest
import torch
from scale_fixtures import RAY, _train, lora, reference, stored, tiny  # noqa: F401  (fixtures)

from stepgrpo.errors import StageError
from storage.run import Run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(prefect_server, tmp_path_factory):
    """One local Ray cluster of 2 CPUs for the file, started in this process as a long-lived driver
    (a notebook, a service) starts it: every flow here runs on it (prefect-ray reuses an initialized
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
            runtime_env={"env_vars": {"PREFECT_API_URL": prefect_server["url"]}},
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
    run_dir = tmp_path / "ray"
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
