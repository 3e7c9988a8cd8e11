"""Where shards run: in this process (the default, no Ray imported) or on Ray workers.

`scale.workers: ray` enters prefect-ray's `RayTaskRunner` for the whole flow (a local cluster of
`scale.num_workers` CPUs started for the run, or the cluster at `scale.address`): every shard is a
Prefect task run submitted to it with its CPU / GPU request (`remote_options`). Ray keeps a
worker process alive between tasks, so the models a shard loads stay loaded for the next shard on
that worker (`stepgrpo.loops.workspace` caches them per process): a reward model is loaded once per
worker, not once per shard.

Before the first shard, every node of the cluster must see the run directory (a probe file
written here is read there): shards write their trajectories' chunks into it directly.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from stepgrpo.config import Config
from stepgrpo.errors import StageError

LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


class InProcess:
    """Shards run one after another in this process."""

    def map(self, task: Any, calls: Sequence[dict[str, Any]], what: str, unit: str = "rows") -> None:
        for params in calls:
            task.fn(**params)


class RayWorkers:
    """Shards run as Prefect task runs on Ray workers (`prefect_ray.RayTaskRunner`)."""

    def __init__(self, runner: Any, options: dict[str, Any]) -> None:
        self.runner = runner
        self.options = options

    def map(self, task: Any, calls: Sequence[dict[str, Any]], what: str, unit: str = "rows") -> None:
        """Submit every shard, wait for all of them (the finished ones keep their records), then
        raise naming the shards that failed."""
        from prefect_ray.context import remote_options

        with remote_options(**self.options):
            futures = [self.runner.submit(task, params) for params in calls]
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
    with ray_runner(cfg) as runner:
        check_shared(Path(run_dir))
        options: dict[str, Any] = {"num_cpus": cfg.scale.cpus_per_shard, "max_retries": cfg.scale.shard_retries}
        if cfg.scale.gpus_per_shard:
            options["num_gpus"] = cfg.scale.gpus_per_shard
        token = _current.set(RayWorkers(runner, options))
        try:
            yield current()
        finally:
            _current.reset(token)


def check_ray_installed() -> None:
    try:
        import prefect_ray  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        raise StageError(
            "scale.workers=ray needs Ray and prefect-ray: pip install -e '.[ray]' (or set scale.workers=process)"
        ) from None


@contextlib.contextmanager
def ray_runner(cfg: Config) -> Iterator[Any]:
    """prefect-ray's task runner on the configured cluster, told where this flow's Prefect API is."""
    check_ray_installed()
    from prefect_ray import RayTaskRunner

    api = prefect_api_url()
    address = cfg.scale.address
    if address and api and _host(api) in LOOPBACK and _host(address) not in LOOPBACK and address != "auto":
        raise StageError(
            f"scale.address={address!r} is a remote Ray cluster, but this flow's Prefect API is {api} (this "
            "machine only): start a Prefect server the workers can reach and set PREFECT_API_URL to it"
        )
    init: dict[str, Any] = {"runtime_env": {"env_vars": {"PREFECT_API_URL": api}} if api else {}}
    if not address:
        init.update(num_cpus=cfg.scale.num_workers, include_dashboard=False)
    with RayTaskRunner(address=address, init_kwargs=init) as runner:
        yield runner


def prefect_api_url() -> str | None:
    """The Prefect API this process talks to: `PREFECT_API_URL`, or its temporary server's."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        return str(url)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    return server.api_url if server.running else None


def _host(url: str) -> str:
    return urlparse(url if "://" in url else f"x://{url}").hostname or ""


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
