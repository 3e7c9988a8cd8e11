"""The update's ranks on a Ray cluster of two nodes (`ray.cluster_utils.Cluster`, gloo): Ray actors
kept for the run, placed one a node by a placement group; on the same inputs they compute the
one-process update, a rank killed mid-update fails the stage and the rerun (a new group) computes
it (within 1e-6; that a rerun gives an uninterrupted run's very bytes, tests/test_scale.py and
tests/test_scale_sharded.py check on one node), and a placement that would starve the shards is
refused with its fix. Its own file (its own cluster), so that it runs beside the other scale tests
on another worker."""

from __future__ import annotations

import shutil
import socket

import pytest
import torch
from scale_fixtures import SHARDED, _train, lora, reference, tiny  # noqa: F401  (fixtures)

from stepgrpo.errors import StageError
from stepgrpo.storage.run import Run

pytestmark = pytest.mark.slow

# Shards of half a CPU, so that a node that holds a rank (0.1 CPU) still runs one; the ranks one a node.
TWO_NODES = [
    "scale.workers=ray",
    "scale.cpus_per_shard=0.5",
    *SHARDED,
    "scale.update_processes=2",
    "scale.update_placement=strict_spread",
]


@pytest.fixture(scope="module")
def nodes(prefect_server, tmp_path_factory):
    """A head and a worker node of one CPU each, joined by this process as its driver (the flow
    reuses an initialized Ray). Yields the file the nodes' workers read their fault from."""
    import ray
    from ray.cluster_utils import Cluster

    fault = tmp_path_factory.mktemp("nodes-fault") / "fault"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        env.setenv("STEPGRPO_FAULT", f"@{fault}")  # the nodes' processes inherit it
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)  # the workers need no Prefect API: only the flow talks to it
    yield fault
    ray.shutdown()
    cluster.shutdown()


def resumed_at_iteration_1(reference, path):
    """The reference run without its last checkpoint: the next update runs on the reference's inputs."""
    shutil.copytree(reference, path)
    shutil.rmtree(path / "checkpoints" / "iter_1")
    return path


def test_ranks_on_two_nodes_compute_the_one_process_update_and_a_killed_rank_is_rerun(
    harness, tiny, reference, tmp_path, nodes
):
    killed = resumed_at_iteration_1(reference, tmp_path / "killed")
    nodes.write_text(f"kill:update:1:{tmp_path / 'fired'}")  # the last rank dies mid-update, once
    try:
        with pytest.raises(StageError, match=r"update over 2 Ray actors failed \(rank 1 on .*, node "):
            _train(tiny, killed, *TWO_NODES)
    finally:
        nodes.unlink()
    assert (tmp_path / "fired").exists()
    assert Run.open(killed).stage_manifest(1, "checkpoint") is None  # nothing half-published
    assert not list(killed.glob(".update-ranks-*"))  # the rendezvous is cleaned up
    _train(tiny, killed, *TWO_NODES)  # the rerun: a new group, which computes the update whole

    ranks = Run.open(killed).stage_manifest(1, "checkpoint")["inputs"]["ranks"]
    assert len({w["node"] for w in ranks}) == 2  # one rank a node
    assert all(w["loads"].get("policy") == 1 for w in ranks)
    a, b = lora(reference, 1), lora(killed, 1)
    assert not torch.equal(a, lora(reference, 0))  # iteration 1 moved the weights
    assert float((a - b).norm() / a.norm()) < 1e-6  # the one-process update's


def test_the_sharded_update_on_two_nodes_computes_the_one_process_update(harness, tiny, reference, tmp_path, nodes):
    """`scale.update_sharding: fsdp` over Ray actors on two nodes: FSDP2 over the actors' gloo group."""
    run = resumed_at_iteration_1(reference, tmp_path / "sharded")
    _train(tiny, run, *TWO_NODES, "scale.update_sharding=fsdp")
    inputs = Run.open(run).stage_manifest(1, "checkpoint")["inputs"]
    assert inputs["sharding"] == "fsdp" and len({w["node"] for w in inputs["ranks"]}) == 2
    a, b = lora(reference, 1), lora(run, 1)
    assert float((a - b).norm() / a.norm()) < 1e-6


def ray_ranks(make, n: int, cpus: float, shared_dir, **options):
    """`RayRanks` of `n` ranks of `cpus` CPUs, one a node (strict_spread), beside shards of 0.5 CPU."""
    from stepgrpo.runtime.workers import RayRanks

    return RayRanks(
        make,
        n,
        "the update",
        "",
        bundle={"CPU": cpus},
        strategy="strict_spread",
        shard={"CPU": 0.5},
        shared_dir=shared_dir,
        backend="gloo",
        **options,
    )


def test_a_placement_that_leaves_no_room_for_a_shard_is_refused(tmp_path, nodes):
    with pytest.raises(StageError, match=r"no node of the Ray cluster has room for a shard \(0.5 CPU\)"):
        ray_ranks(_never, 2, 0.9, tmp_path)
    assert not list(tmp_path.iterdir())  # its rendezvous directory is gone
    with pytest.raises(StageError, match=r"cannot place 3 rank\(s\) of \{'CPU': 0.1\} \(strict_spread\)"):
        ray_ranks(_never, 3, 0.1, tmp_path, wait_s=1)  # 3 ranks one a node on 2 nodes: never placed


def _never(rank: int, world: int):
    raise AssertionError("no rank starts")


def test_ranks_meet_across_nodes_and_keep_their_state(tmp_path, nodes):
    """The group itself: two actors on two nodes all-reduce, and each keeps what it built."""

    class Summer:  # defined here: Ray sends it by value (the nodes cannot import this file)
        def __init__(self, rank: int, world: int) -> None:
            self.rank, self.calls = rank, 0

        def __call__(self, command):
            import torch.distributed as dist

            self.calls += 1
            t = torch.tensor([command["x"] * (self.rank + 1)])
            dist.all_reduce(t)
            return {"sum": float(t), "calls": self.calls}

    pool = ray_ranks(Summer, 2, 0.1, tmp_path)
    try:
        assert len({w["node"] for w in pool.where}) == 2
        assert pool.where[0]["host"] == socket.gethostname()  # simulated nodes of this machine
        assert pool.run({"x": 1.0}) == [{"sum": 3.0, "calls": 1}] * 2  # 1*1 + 1*2
        assert pool.run({"x": 2.0}) == [{"sum": 6.0, "calls": 2}] * 2
    finally:
        pool.close()
    assert not list(tmp_path.iterdir())
