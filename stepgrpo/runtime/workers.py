"""Where shards run: in this process (the default, no Ray imported) or on Ray workers.

`scale.workers: ray` joins a Ray cluster for the whole flow (a local one of `scale.num_workers`
CPUs started for the run, or the cluster at `scale.address`). Every shard is still a Prefect task
run of the flow, with its name, state and retries in the Prefect UI, but the task run lives in the
flow's process (one thread a shard) and its body sends the shard to a Ray worker as a plain Ray
task with its CPU / GPU request, and waits for it. So a worker runs only the shard: no Prefect
task engine there (it rebuilt Prefect's settings and an API client for every task run), and no
worker ever talks to the Prefect API. Ray keeps a worker process alive between tasks, so the
models a shard loads stay loaded for the next shard on that worker (`stepgrpo.loops.workspace`
caches them per process): a reward model is loaded once per worker, not once per shard.

Before the first shard, every node of the cluster must see the run directory (a probe file
written here is read there): shards write their trajectories' chunks into it directly.

The update's data-parallel ranks on Ray (`RayRanks`) are actors kept for the run, placed by a
placement group over the cluster's nodes: they meet through a `FileStore` in the run directory
(which every node sees; no port is opened for the rendezvous), and die with this process (Ray
ends the actors of a driver that exits).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import shutil
import socket
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from stepgrpo.config import Config
from stepgrpo.errors import StageError


class InProcess:
    """Shards run one after another in this process."""

    def map(self, task: Any, calls: Sequence[dict[str, Any]], what: str, unit: str = "rows") -> None:
        for params in calls:
            task.fn(**params)


class RayWorkers:
    """Shards as Prefect task runs of this process whose bodies run as Ray tasks (`options`: the
    Ray task's CPUs, GPUs and `max_retries`, Ray's retries when its worker dies)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def map(self, task: Any, calls: Sequence[dict[str, Any]], what: str, unit: str = "rows") -> None:
        """Submit every shard, wait for all of them (the finished ones keep their records), then
        raise naming the shards that failed."""
        from prefect.task_runners import ThreadPoolTaskRunner

        on_ray = _on_ray(task, self.options)
        with ThreadPoolTaskRunner(max_workers=max(1, len(calls))) as runner:  # a thread a shard: each waits on Ray
            futures = [runner.submit(on_ray, params) for params in calls]
            failed = []
            for params, future in zip(calls, futures):
                try:
                    future.result()
                except Exception as err:  # a shard's error, or its worker died
                    failed.append((params, err))
        if failed:
            shards = ", ".join(f"{unit} {p['shard'].start}-{p['shard'].stop - 1}" for p, _ in failed)
            first = failed[0][1]
            raise StageError(
                f"{what}: {len(failed)} of {len(calls)} shard(s) failed ({shards}): {type(first).__name__}: {first}; "
                "run the same command again: the finished shards are kept and only these are computed"
            ) from first


def _on_ray(task: Any, options: dict[str, Any]) -> Any:
    """The Prefect task `task` (name, run names, no cache) whose body runs `task.fn` as a Ray task
    and returns its result; a shard's own error is raised as itself."""
    import ray
    from prefect import Task

    remote = ray.remote(_call).options(**options)
    body = ray.put(task.fn)  # sent to the object store once, not with every shard

    @functools.wraps(task.fn)
    def on_ray(*args: Any, **kwargs: Any) -> Any:
        try:
            return ray.get(remote.remote(body, args, kwargs))
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    return Task(
        fn=on_ray,
        name=task.name,
        task_run_name=task.task_run_name,
        cache_policy=task.cache_policy,
        persist_result=False,
    )


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


_current: ContextVar[InProcess | RayWorkers | None] = ContextVar("stepgrpo_workers", default=None)


def current() -> InProcess | RayWorkers:
    """The workers of the running flow (`workers`), in-process outside one."""
    return _current.get() or InProcess()


@contextlib.contextmanager
def workers(cfg: Config, run_dir: str | os.PathLike[str]) -> Iterator[InProcess | RayWorkers]:
    """The flow's workers for `cfg.scale`; Ray is imported only when the config asks for it."""
    if cfg.scale.workers == "process":
        token = _current.set(InProcess())
        try:
            yield current()
        finally:
            _current.reset(token)
        return
    with ray_cluster(cfg):
        check_shared(Path(run_dir))
        options: dict[str, Any] = {"num_cpus": cfg.scale.cpus_per_shard, "max_retries": cfg.scale.shard_retries}
        if cfg.scale.gpus_per_shard:
            options["num_gpus"] = cfg.scale.gpus_per_shard
        token = _current.set(RayWorkers(options))
        try:
            yield current()
        finally:
            _current.reset(token)


def check_ray_installed() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise StageError(
            "scale.workers=ray needs Ray: pip install 'stepgrpo[ray]' (in a checkout: pip install -e '.[ray]'), "
            "or set scale.workers=process"
        ) from None


@contextlib.contextmanager
def ray_cluster(cfg: Config) -> Iterator[None]:
    """This process joined to the configured Ray cluster: one already joined (a notebook or a
    service that called `ray.init`), the cluster at `scale.address`, or a local one started for
    the flow and shut down after it."""
    check_ray_installed()
    import ray

    if ray.is_initialized():
        yield
        return
    address = cfg.scale.address
    if address:
        ray.init(address=address)
    else:
        # the update's kept ranks (`RayRanks`) get CPUs of their own, so that every worker still runs a shard
        ranks = math.ceil(cfg.scale.update_processes * cfg.scale.update_cpus) if cfg.scale.update_processes > 1 else 0
        ray.init(num_cpus=cfg.scale.num_workers + ranks, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


def check_shared(run_dir: Path) -> None:
    """Every alive node of the Ray cluster must read a probe file written into `run_dir` here."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    probe = run_dir / f".probe-{token}.json"
    probe.write_text(f'"{token}"')
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        reader = ray.remote(num_cpus=0)(_read_probe)
        refs = [
            reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                str(probe)
            )
            for n in nodes
        ]
        for node, seen in zip(nodes, ray.get(refs)):
            if seen != f'"{token}"':
                raise StageError(
                    f"the run directory {run_dir} is not visible from Ray node {node.get('NodeManagerAddress')}: "
                    "shards write into it directly; put run.runs_root on a filesystem every node mounts at the "
                    "same path (NFS, Lustre, a shared volume)"
                )
    finally:
        probe.unlink(missing_ok=True)


def _read_probe(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def run_shards(task: Any, shards: Sequence[range], params: dict[str, Any], what: str, unit: str = "rows") -> None:
    """Run `task(**params, shard=r)` for every shard `r` (a range of `unit`) on the flow's workers."""
    if shards:
        current().map(task, [{**params, "shard": r} for r in shards], what, unit)


class RayRanks:
    """`n` ranks of a data-parallel computation as Ray actors kept for the run (`RankPool`'s
    interface: `run`, `broken`, `close`). One placement-group bundle a rank (`bundle`: its CPUs and
    GPUs) placed by `strategy` over the cluster's nodes; rank r's actor joins the torch.distributed
    group (`backend`) through a FileStore in `shared_dir` (a directory every node sees), then builds
    its handler `make(rank, world)` and answers each command with `handler(command)`. A rank that
    fails or dies stops the others (they would wait in the next all-reduce forever) and fails the
    command, naming the rank, its host and node; the pool is then `broken`."""

    def __init__(
        self,
        make: Callable[[int, int], Callable[[dict[str, Any]], dict[str, Any]]],
        n: int,
        what: str,
        hint: str,
        *,
        bundle: dict[str, float],
        strategy: str,
        shard: dict[str, float],
        shared_dir: Path,
        backend: str,
        wait_s: float = 120.0,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.n, self.what, self.hint, self.broken = n, what, hint, False
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = [{} for _ in range(n)]
        bundle = {k: v for k, v in bundle.items() if v}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy.upper())
        self.dir = Path(tempfile.mkdtemp(prefix=".update-ranks-", dir=shared_dir))
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=wait_s)
            if not ready:
                raise StageError(
                    f"{what}: the Ray cluster cannot place {n} rank(s) of {bundle} ({strategy}) within {wait_s:.0f} s; "
                    f"it has {_resources(ray.cluster_resources())}. Lower scale.update_cpus / scale.update_gpus, "
                    "change scale.update_placement, or add nodes"
                )
            self._check_room(bundle, shard)
            actor = ray.remote(_Rank)
            self.actors = [
                actor.options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                ).remote(r, n, str(self.dir / "rendezvous"), backend, make)
                for r in range(n)
            ]
            refs = [a.where.remote() for a in self.actors]
            self._wait(refs)
            self.where = ray.get(refs)
        except BaseException:
            self.close(wait=False)
            raise

    def run(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's answer to `command`, in rank order."""
        import ray

        if self.broken:
            raise StageError(f"{self.what}: its ranks were stopped by an earlier failure")
        refs = [a.run.remote(command) for a in self.actors]
        self._wait(refs)
        return ray.get(refs)

    def _wait(self, refs: list[Any]) -> None:
        import ray

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as err:
                self._fail(refs.index(done[0]), err)

    def _fail(self, r: int, err: Exception) -> None:
        self.broken = True
        self.close(wait=False)
        w = self.where[r] or {}
        at = f"on {w['host']}, node {w['ip']}" if w else "before it started"
        text = str(err).strip().splitlines()
        raise StageError(
            f"{self.what} over {self.n} Ray actors failed (rank {r} {at}): {type(err).__name__}: "
            + "\n".join(text[-15:])
            + f"\n{self.hint}"
        ) from None

    def _check_room(self, bundle: dict[str, float], shard: dict[str, float]) -> None:
        """Some node must still fit a shard beside the ranks it holds: else every later stage would
        wait for resources forever."""
        import ray
        from ray.util.placement_group import placement_group_table

        held = Counter(placement_group_table(self.pg)["bundles_to_node_id"].values())
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            total, k = node.get("Resources", {}), held[node["NodeID"]]
            if all(total.get(name, 0) - k * bundle.get(name, 0) >= need for name, need in shard.items() if need):
                return
        raise StageError(
            f"{self.what}: with its {self.n} rank(s) of {bundle} placed, no node of the Ray cluster has room for a "
            f"shard ({_resources(shard)}), so the next rollout would wait forever. Lower scale.update_cpus / "
            "scale.update_gpus (below 1 GPU a rank shares its GPU with a shard), or scale.cpus_per_shard / "
            "scale.gpus_per_shard, or add nodes"
        )

    def close(self, wait: bool = True) -> None:
        """End the ranks (they hold no work between commands, so `wait` changes nothing) and
        release their placement group and rendezvous directory."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        shutil.rmtree(self.dir, ignore_errors=True)


class _Rank:
    """One rank of `RayRanks` (a Ray actor)."""

    def __init__(self, rank: int, world: int, store: str, backend: str, make: Callable[..., Any]) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.rank = rank
        dist.init_process_group(
            backend, store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(minutes=10)
        )
        self.handler = make(rank, world)

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "node": ctx.get_node_id(),
            "pid": os.getpid(),
        }

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        return self.handler(command)


def _resources(r: dict[str, float]) -> str:
    """CPUs, GPUs and custom resources (not Ray's memory and per-node entries)."""
    shown = {k: v for k, v in r.items() if v and not k.startswith(("node:", "memory", "object_store"))}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"
