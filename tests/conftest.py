"""Fixtures shared by test modules: a Prefect server of the tests' own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

PREFECT = [sys.executable, "-m", "prefect"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `prefect server start` for the module: the environment whose PREFECT_API_URL points at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", COLUMNS="250")
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "prefect server did not start"
            time.sleep(0.5)
        yield dict(env, PREFECT_API_URL=url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


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
