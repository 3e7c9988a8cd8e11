"""A kept Prefect server (`stepgrpo server start|stop|status`, `stepgrpo.runtime.server`): started
once, found by later commands of the same Prefect home, trusted only while its own process lives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stepgrpo.runtime import server

STEPGRPO = [sys.executable, "-m", "stepgrpo_cli"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A Prefect home of its own, with the kept-server lookup on and no server chosen."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv(server.DISABLE_ENV, "1")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return tmp_path / "prefect-home"


def _record(home, **fields):
    home.mkdir(parents=True, exist_ok=True)
    (home / server.RECORD).write_text(json.dumps(fields))


def test_a_record_of_a_process_that_is_gone_is_not_trusted(home):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(home, url="http://127.0.0.1:9/api", ui="http://127.0.0.1:9", pid=dead.pid, started="1")
    assert server.running() is None
    assert server.use_kept() is None and "PREFECT_API_URL" not in os.environ


def test_a_record_of_a_live_process_that_does_not_answer_is_not_trusted(home):
    me = os.getpid()
    _record(home, url="http://127.0.0.1:9/api", ui="", pid=me, started=server._start_time(me))
    assert server.running() is None


def test_the_users_server_and_the_off_switch_win_over_a_kept_one(home, monkeypatch):
    monkeypatch.setattr(server, "running", lambda: {"url": "http://127.0.0.1:1/api"})
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    assert server.use_kept() is None and os.environ["PREFECT_API_URL"] == "http://elsewhere:4200/api"
    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv(server.DISABLE_ENV, "0")
    assert server.use_kept() is None and "PREFECT_API_URL" not in os.environ
    monkeypatch.setenv(server.DISABLE_ENV, "1")
    assert server.use_kept() == "http://127.0.0.1:1/api" == os.environ["PREFECT_API_URL"]


FLOW_ON_KEPT = textwrap.dedent(
    """
    from stepgrpo.runtime import server
    url = server.use_kept()
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="kept-probe")
    def probe():
        from prefect.runtime import flow_run
        return flow_run.get_id()

    run_id = probe()
    with get_client(sync_client=True) as client:  # the run is in the kept server's database
        print(url, client.read_flow_run(run_id).name)
    """
)


@pytest.mark.slow
def test_start_status_use_and_stop(home, prefect_home, tmp_path):  # prefect_home: that home, its database made
    from conftest import free_port

    env = dict(os.environ, COLUMNS="250")

    def cli(*args):
        return subprocess.run([*STEPGRPO, *args], env=env, capture_output=True, text=True, timeout=240)

    assert cli("server", "status").returncode == 1
    port = free_port()
    started = cli("server", "start", "--port", str(port))
    assert started.returncode == 0, started.stderr
    record = json.loads((home / server.RECORD).read_text())
    url = f"http://127.0.0.1:{port}/api"
    try:
        assert record["url"] == url and "started:" in started.stdout
        assert server.healthy(url)
        # its UI talks to this server, not to Prefect's default port
        import httpx

        settings = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=30).json()
        assert settings["api_url"] == url
        status = cli("server", "status")
        assert status.returncode == 0 and url in status.stdout
        again = cli("server", "start", "--port", str(port))
        assert again.returncode == 0 and "already running" in again.stdout and str(record["pid"]) in again.stdout

        # a command that runs flows says which server it uses, before its own checks
        cmd = cli("credit", str(tmp_path / "no-such-run"), "--scheme", "outcome")
        assert cmd.returncode == 1 and f"Prefect server: {url} (kept" in cmd.stderr
        # and Prefect itself talks to it (set before Prefect is imported)
        probe = subprocess.run([sys.executable, "-c", FLOW_ON_KEPT], env=env, capture_output=True, text=True)
        assert probe.returncode == 0 and probe.stdout.startswith(url), probe.stderr[-2000:]
    finally:
        stopped = cli("server", "stop")
    assert stopped.returncode == 0 and url in stopped.stdout
    assert not (home / server.RECORD).exists() and not server.healthy(url)
    assert server._start_time(record["pid"]) is None  # the server's process is gone, reaped or not
    assert cli("server", "status").returncode == 1
    assert "no kept Prefect server" in cli("server", "stop").stdout
