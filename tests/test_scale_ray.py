"""Scale-out on a local Ray cluster of 2 workers (docs/SCALING.md): shards store the in-process
bytes, a killed worker's shard is retried, and a killed shard is the only one computed again.
Its own file, so that it runs beside the in-process tests (tests/test_scale.py) on another worker."""

from __future__ import annotations

import pytest
import torch
from scale_fixtures import RAY, _train, lora, reference, stored, tiny  # noqa: F401  (fixtures)

from stepgrpo.errors import StageError
from storage.run import Run

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fair_workers(monkeypatch):
    """Ray starts its workers at niceness 15: beside the other tests of `pytest -n` they would get
    the CPU last (and the file take 2-4x as long). The clusters of this file give them an equal share."""
    monkeypatch.setenv("RAY_worker_niceness", "0")


def test_ray_shards_store_the_in_process_bytes_and_a_killed_worker_is_retried(
    harness, tiny, reference, tmp_path, monkeypatch
):
    # The rollout shard at row 6 ends its worker process half-way (as kill -9 would), once.
    monkeypatch.setenv("STEPGRPO_FAULT", f"kill:rollout:6:{tmp_path / 'killed'}")
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


def test_a_killed_shard_is_the_only_one_computed_again(harness, tiny, reference, tmp_path, monkeypatch):
    # No retry: the stage fails when the completion shard at row 12 dies half-way; run it again.
    monkeypatch.setenv("STEPGRPO_FAULT", f"kill:complete:12:{tmp_path / 'killed'}")
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
