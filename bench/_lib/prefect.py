"""A Prefect server of a script's own (a temporary home, a free port) and calls to its API and CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stepgrpo.runtime.server import prefect_command

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None) -> object:
    """GET `path` (POST `body` as JSON when given) on the server's API; the decoded JSON answer."""
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def call(env: dict[str, str], cwd: Path, *args: str, timeout: float = 3600) -> tuple[str, float]:
    """Run a command; its output and wall seconds, or exit naming it with its output's tail."""
    t0 = time.perf_counter()
    out = subprocess.run(list(args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr, time.perf_counter() - t0


@contextmanager
def local_server(env: dict[str, str], home: Path) -> Iterator[tuple[str, int, dict[str, str]]]:
    """`prefect server start` on a free port with PREFECT_HOME `home`, for the block: yields its API
    URL, port and `env` with PREFECT_API_URL set (the UI is pointed at the same API)."""
    home.mkdir(parents=True, exist_ok=True)  # its SQLite database cannot be opened in a missing folder
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    server_env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": url}
    server = subprocess.Popen(
        [*prefect_command(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                api(url, "/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the Prefect server did not start") from None
                time.sleep(0.5)
        yield url, port, dict(server_env, PREFECT_API_URL=url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
