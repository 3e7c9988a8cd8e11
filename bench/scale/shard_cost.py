"""The fixed cost of one shard on a Ray worker: what the pipeline adds to a shard that does nothing.

    python -m bench.scale.shard_cost [--shards 24] [--out FILE.json]

A flow maps `--shards` shards of an empty shard task (`stepgrpo.tasks.base.shard_task`), with a real
shard's parameters (the run, the config), over a local Ray
cluster of one CPU (`stepgrpo.runtime.workers`, as a stage does), so the shards run one after
another; its seconds per shard are the pipeline's fixed cost of a shard. Beside it: a bare Ray task
that does nothing, one after another on the same cluster. Each measured twice (the first map
warms the worker); the second is reported. Target (issue 28): <= 0.05 s a shard.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench._lib.common import setup_env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=24)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="stepgrpo-shard-cost-"))
    setup_env(out)
    import ray
    from prefect import flow

    from stepgrpo.config import Config, validate_config
    from stepgrpo.runtime.workers import run_shards, workers
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks.base import shard_task

    @shard_task("noop")
    def noop(run: Run, cfg: Config, iteration: int, shard: range, key: str) -> None:
        return None  # a real shard's parameters: the run and the config travel with it

    cfg = validate_config({"scale": {"workers": "ray", "num_workers": 1, "cpus_per_shard": 1}})
    shards = [range(i, i + 1) for i in range(a.shards)]
    run = Run.create(out / "runs", "shard-cost", {})

    @flow(name="shard-cost")
    def measure() -> dict[str, float]:
        with workers(cfg, out):
            seconds = []
            for _ in range(2):
                t = time.perf_counter()
                run_shards(noop, shards, {"run": run, "cfg": cfg, "iteration": 0, "key": "k"}, "noop")
                seconds.append((time.perf_counter() - t) / a.shards)

            @ray.remote(num_cpus=1)
            def bare() -> None:
                return None

            bare_s = []
            for _ in range(2):
                t = time.perf_counter()
                for _ in shards:
                    ray.get(bare.remote())
                bare_s.append((time.perf_counter() - t) / a.shards)
        return {"shard_s": seconds[-1], "bare_ray_task_s": bare_s[-1], "first_map_shard_s": seconds[0]}

    got = measure()
    print(f"{a.shards} empty shards, one at a time on one Ray worker:")
    first = got["first_map_shard_s"]
    print(f"  a shard through the pipeline   {got['shard_s']:.4f} s  (first map, worker starting: {first:.3f} s)")
    print(f"  a bare Ray task                {got['bare_ray_task_s']:.4f} s")
    print(f"  fixed cost of a shard: {got['shard_s'] - got['bare_ray_task_s']:.4f} s beyond Ray's (target <= 0.05 s)")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"shards": a.shards, **got}, indent=1))


if __name__ == "__main__":
    main()
