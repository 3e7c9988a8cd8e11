"""A Prefect server the user keeps running (`stepgrpo server start|stop|status`).

Without one, every command that runs a flow starts Prefect's temporary server for itself: 4-12 s
of start-up and ~15 s of CPU each time, most of a re-score or a re-credit of a small run. A kept
server is started once, outlives the command that started it (its own session), and is found by
every later command of the same Prefect home: `use_kept()` points this process at it
(`PREFECT_API_URL`) before Prefect is imported. It is the same server `prefect server start`
runs, on the same database, so its UI shows every run.

Its record, `<PREFECT_HOME>/stepgrpo-server.json` (url, pid and the process's start time), is
written only once the server answers, and is trusted only while that very process lives and
answers: a stale record (a reboot, a killed server) is ignored and replaced.

    STEPGRPO_KEPT_SERVER=0    # never look for a kept server (the test suite sets it)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD = "stepgrpo-server.json"
LOG = "stepgrpo-server.log"
DISABLE_ENV = "STEPGRPO_KEPT_SERVER"
START_TIMEOUT_S = 180.0  # a first start migrates the database: tens of seconds on a slow disk
STOP_GRACE_S = 15.0


class ServerError(RuntimeError):
    """A kept server could not be started or stopped; the message says why and what to do."""


def prefect_home() -> Path:
    """Prefect's home, as Prefect resolves it (`PREFECT_HOME`, else `~/.prefect`), without importing Prefect."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def healthy(url: str, timeout: float = 1.0) -> bool:
    """The server at API `url` answers its health check."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def _start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: field 22 of /proc/PID/stat), "" where that cannot be read,
    None if it is gone or has exited (a zombie no one has reaped yet)."""
    if not sys.platform.startswith("linux"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def running() -> dict[str, Any] | None:
    """The kept server of this Prefect home (its record), if that process lives and answers; else None."""
    try:
        record = json.loads((prefect_home() / RECORD).read_text())
        pid, url, started = int(record["pid"]), str(record["url"]), str(record["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _start_time(pid) != started or not healthy(url):
        return None
    return record


def kept_url() -> str | None:
    """The kept server's API URL, if there is one and the user has not chosen a server (`PREFECT_API_URL`)."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get(DISABLE_ENV) == "0":
        return None
    record = running()
    return None if record is None else record["url"]


def use_kept() -> str | None:
    """Point this process's Prefect at the kept server (`kept_url`); returns its API URL. Call
    before Prefect is imported (Prefect reads its settings once, at import)."""
    url = kept_url()
    if url is not None:
        os.environ["PREFECT_API_URL"] = url
    return url


def start(host: str = "127.0.0.1", port: int = 4200) -> tuple[dict[str, Any], bool]:
    """Start a kept server on `host:port` and wait until it answers; returns its record and
    whether it was started now (False: one was already running, and is returned)."""
    if (record := running()) is not None:
        return record, False
    url = f"http://{_connect_host(host)}:{port}/api"
    if healthy(url):
        raise ServerError(
            f"a server already answers at {url} (not one `stepgrpo server start` recorded): use it with "
            f"`export PREFECT_API_URL={url}`, or start a kept server on another port (--port)"
        )
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    command = prefect_command()
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    # the UI asks /ui-settings where the API is: this server's own address, not Prefect's default :4200
    env.update(PREFECT_UI_API_URL=url, PREFECT_SERVER_API_HOST=host, PREFECT_SERVER_API_PORT=str(port))
    with (home / LOG).open("ab") as log:
        proc = subprocess.Popen(
            [*command, "server", "start", "--host", host, "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives this command, and a Ctrl-C of its terminal
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc.pid)
            tail = (home / LOG).read_text(errors="replace")[-1500:]
            raise ServerError(
                f"the Prefect server did not start on {host}:{port} (is the port taken? try --port); "
                f"its log, {home / LOG}, ends:\n{tail}"
            )
        time.sleep(0.25)
    record = {"url": url, "ui": url.removesuffix("/api"), "pid": proc.pid, "started": _start_time(proc.pid) or ""}
    tmp = home / f".{RECORD}.{proc.pid}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, home / RECORD)  # recorded only once it answers
    return record, True


def stop() -> dict[str, Any] | None:
    """Stop the kept server of this Prefect home; returns its record, None if none was running."""
    record = running()
    (prefect_home() / RECORD).unlink(missing_ok=True)
    if record is not None:
        _end(int(record["pid"]))
    return record


@contextlib.contextmanager
def temporary() -> Iterator[str]:
    """A server for one command: the one Prefect starts by itself when no server is set (its
    command: the API without the UI, the services of a temporary server), but in a session of its
    own, so that a Ctrl-C in the terminal reaches the command and not its server: the flow reports
    its interruption and the command says how to resume before the server stops. Yields its API
    URL (also set as `PREFECT_API_URL` meanwhile, for the command's own subprocesses)."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # not imported here: Prefect reads its settings at import
    if spec is None or spec.origin is None:
        raise ServerError("Prefect is not installed in this Python environment")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent)]
        + ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
        + ["--log-level", "error", "--lifespan", "on"],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or START_TIMEOUT_S)
        deadline = time.monotonic() + timeout
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServerError(
                    f"Prefect's temporary server did not start within {timeout:.0f} s (exit code {proc.poll()}); "
                    "start one with `stepgrpo server start`, or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
                )
            time.sleep(0.2)
        before = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            if before is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = before
    finally:
        try:
            _drain()
        finally:
            _end(proc.pid)


def prefect_command() -> list[str]:
    """Prefect's console script beside this interpreter, or `python -m prefect` where there is none
    (Prefect installed with `pip --target`)."""
    script = Path(sys.executable).with_name("prefect")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "prefect"]


def _drain() -> None:
    """Send this process's buffered Prefect logs and events now, while its server is up (after,
    they would retry against a closed port for a minute before the process could exit)."""
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


def _end(pid: int) -> None:
    """SIGTERM the server's process group (the server and its workers), SIGKILL after the grace."""
    started = _start_time(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            if _start_time(pid) != started:
                return
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it where this process started it
            except ChildProcessError:
                pass
            time.sleep(0.1)


def _connect_host(host: str) -> str:
    """The address a client on this machine uses for a server listening on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
