"""Fixtures shared by test modules: one Prefect server for the test session, the tests' cache."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One torch thread in every process of the session unless a test asks for more: `pytest -n 2` runs two
# workers on the machine's cores, beside Ray workers, update ranks and CLI subprocesses, and torch's
# default (a thread per core in each) oversubscribes them; on the tiny models the threads mostly wait
# for each other (the in-process scale run: 37 s of CPU at 2 threads beside a busy process, 22 s at 1).
# Set before torch is imported here, so the subprocesses inherit it; tests that compare bytes still
# pin their threads in the config they run (`scale.threads`).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# A Prefect server a developer keeps running (`stepgrpo server start`) is never the tests' (tests/test_server.py
# turns the lookup on where it is the subject).
os.environ["STEPGRPO_KEPT_SERVER"] = "0"

# A cache of derived files (the empty MLflow store template) of the tests' own, kept between sessions.
os.environ.setdefault("STEPGRPO_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"stepgrpo-tests-cache-{os.getuid()}"))

# The Prefect server that a whole test session shares (`pytest -n`: every worker too), started by the
# first test that needs it and stopped when the session ends (the controller stops it; a watcher stops
# it if the session is killed). Each start costs ~15 s of CPU, a temporary server per process as much.
SERVER_INFO = "prefect-server.json"
# Services no test needs (schedules, automations, stored events, run supervision); off, they halve
# the server's CPU per task run. The task-run recorder stays: it records task runs for the API.
IDLE_SERVICES = (
    "SCHEDULER",
    "TRIGGERS",
    "EVENT_PERSISTER",
    "FOREMAN",
    "LATE_RUNS",
    "PAUSE_EXPIRATIONS",
    "REPOSSESSOR",
    "CANCELLATION_CLEANUP",
    "CLEANUP_RECONCILER",
)
WATCH = """
import os, signal, sys, time
session, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(1)
    try:
        os.kill(session, 0)
    except ProcessLookupError:
        try:
            os.killpg(group, signal.SIGTERM)
        finally:
            sys.exit(0)
"""


def shared(tmp_path_factory, name: str) -> Path:
    """A path every worker of this test session sees (`pytest -n`: the workers' common base)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / name


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _launch_server(root: Path) -> dict[str, str]:
    """Start the session's server in the background: its API URL, PREFECT_HOME and processes."""
    home = root / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="250")
    env.pop("PREFECT_API_URL", None)
    env.update({f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in IDLE_SERVICES})
    log = (root / "prefect-server.log").open("w")
    proc = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    session = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(session), str(proc.pid)], start_new_session=True)
    data = {"url": f"http://127.0.0.1:{port}/api", "home": str(home), "pid": proc.pid, "watcher": watcher.pid}
    (root / SERVER_INFO).write_text(json.dumps(data))
    return data


def _wait_for_server(root: Path, data: dict[str, str]) -> dict[str, str]:
    deadline = time.monotonic() + 180
    while not _healthy(data["url"]):
        alive = True
        try:
            os.kill(int(data["pid"]), 0)
        except ProcessLookupError:
            alive = False
        assert alive and time.monotonic() < deadline, (root / "prefect-server.log").read_text()[-3000:]
        time.sleep(0.5)
    return data


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> dict[str, str]:
    """The session's Prefect server: its API URL and the PREFECT_HOME of its processes."""
    from filelock import FileLock

    root = shared(tmp_path_factory, "prefect")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".lock")):
        info = root / SERVER_INFO
        data = json.loads(info.read_text()) if info.is_file() else _launch_server(root)
        data = _wait_for_server(root, data)
        if not (root / TEMPLATE_DB).is_file():  # before any test has used the server (the lock)
            _copy_db(Path(data["home"]) / "prefect.db", root / TEMPLATE_DB)
        return data


# The session server's database as it was started (migrated, its block types registered), for the
# Prefect homes of tests that start a server of their own: a fresh home's first start migrates its
# database, ~7 s of a 10 s start here; a user's kept home does that once.
TEMPLATE_DB = "template-prefect.db"


def _copy_db(source: Path, target: Path) -> None:
    """A consistent copy of the SQLite database `source` (in use or not), published whole."""
    import sqlite3

    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(partial)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    os.replace(partial, target)


@pytest.fixture
def prefect_home(prefect_server, tmp_path_factory, tmp_path) -> Path:
    """An empty Prefect home of the test's own (`tmp_path/prefect-home`, for a server the test's
    command starts), its database already migrated: a copy of the session server's at its start."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    _copy_db(shared(tmp_path_factory, "prefect") / TEMPLATE_DB, home / "prefect.db")
    return home


def pytest_sessionstart(session):
    """A parallel run (`pytest -n`, as `make test`) that includes the slow tests (those that use the
    server) starts the server now, in the background, so that its ~15 s of start-up overlap the
    workers' start and collection. Any other run starts it when a test first needs it."""
    config = session.config
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        return
    if "not slow" in (config.getoption("markexpr") or ""):
        return
    root = config._tmp_path_factory.getbasetemp() / "prefect"
    root.mkdir(parents=True, exist_ok=True)
    _launch_server(root)


def pytest_sessionfinish(session):
    """The controller (or the one process) stops the session's Prefect server."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    info = factory.getbasetemp() / "prefect" / SERVER_INFO if factory else None
    if info is not None and info.is_file():
        data = json.loads(info.read_text())
        for group in (data["pid"], data["watcher"]):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)


@pytest.fixture(scope="module")
def server(prefect_server):
    """The environment of a process that talks to the session's Prefect server."""
    env = dict(os.environ, PREFECT_HOME=prefect_server["home"], PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.update(COLUMNS="250", PREFECT_API_URL=prefect_server["url"])
    return env


@pytest.fixture(scope="session")
def warm_cli(prefect_server):
    """`stepgrpo` commands against the session's Prefect server, each in a child of one process that
    imported the CLI once (tests/warm_cli.py): what the console script runs, without its ~4 s of
    imports a command. `warm_cli.run(args, cwd, warm_cli.env)`."""
    from warm_cli import WarmCli

    env = dict(os.environ, PREFECT_HOME=prefect_server["home"], PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.update(COLUMNS="250", PREFECT_API_URL=prefect_server["url"])
    warm = WarmCli(env)
    yield warm
    warm.close()


@pytest.fixture(scope="module")
def harness(prefect_server):
    """This process's flows run against the session's Prefect server, without flow-run heartbeats:
    they feed Prefect's zombie-run automations, which the session's server does not run (its
    services are off), and each flow's end waits 0-1 s for the heartbeat thread's sleep (Prefect
    sleeps in steps of 1 s): 36 s of tests/test_flows.py's ~70 flows alone. The heartbeats' own
    setting is tested in tests/test_cli.py."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["url"], PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
        drain()


def drain() -> None:
    """Send this process's buffered Prefect logs and events now, while the server is up (at exit,
    after the session stopped it, they would retry against a closed port for a minute)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def both() -> None:
        with contextlib.suppress(RuntimeError):  # a worker that never started
            done = APILogWorker.instance().drain()
            if inspect.isawaitable(done):
                await done
        done = EventsWorker.drain_all()
        if inspect.isawaitable(done):
            await done

    run_coro_as_sync(both())


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """Plug-ins a test registers (by reference, by entry point) are forgotten after it, so no
    later test sees a name whose module left `sys.path` with the test."""
    from stepgrpo.rewards import REWARDS
    from stepgrpo_core.credit import SCHEMES

    saved = [(r, dict(r._items), dict(r._facts)) for r in (REWARDS, SCHEMES)]
    yield
    for registry, items, facts in saved:
        registry._items, registry._facts = items, facts


# The test files that take longest, longest first (seconds of one worker, setup and teardown included,
# in an idle `make test` on 2 cores: both workers busy, so each file's seconds are those it takes beside
# another; the bench-smoke files' from an earlier `make bench-smoke`). `make test` hands files to its two
# workers in this order (`--no-loadscope-reorder`; xdist's default puts the files with most tests first,
# which left the longest files to run alone at the end); `make bench-smoke`'s files likewise.
LONGEST_FIRST = (
    "test_bench_credit_schemes.py",  # ~125 s (bench-smoke)
    "test_flows.py",  # ~156 s
    "test_scale_nodes.py",  # ~117 s
    "test_docs.py",  # ~108 s
    "test_console.py",  # ~81 s
    "test_bench_gpu.py",  # ~75 s (bench-smoke)
    "test_scale_ray.py",  # ~66 s
    "test_deploy.py",  # ~62 s
    "test_layers.py",  # ~60 s
    "test_packaging.py",  # ~58 s
    "test_flows_resume.py",  # ~47 s
    "test_scale.py",  # ~42 s
    "test_objectives_pipeline.py",  # ~35 s
    "test_scale_sharded.py",  # ~32 s
    "test_branching_pipeline.py",  # ~25 s
    "test_orphans.py",  # ~23 s
    "test_recipes.py",  # ~21 s
    "test_reward_contract.py",  # ~18 s
    "test_server.py",  # ~13 s
    "test_cli.py",  # ~5 s
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
