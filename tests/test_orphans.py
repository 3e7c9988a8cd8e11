"""No orphans: what a command starts (Prefect's temporary server, helpers in sessions of their own)
ends with it, on SIGTERM and on a kill -9 of the command alone (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

COMMAND = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from stepgrpo.flows import session
    from stepgrpo_cli.shell import call_flow

    def hold() -> None:
        helper = subprocess.Popen(["sleep", "600"], start_new_session=True)  # out of the command's group
        print("ready", helper.pid, flush=True)
        time.sleep(600)

    def command(path):  # as a CLI command runs its flow: its own temporary server, the run's lock
        with session.prefect_server():
            from prefect import flow

            session.owned_run(path, flow(hold))

    call_flow(command, sys.argv[1])
    """
)


def _descendants(pid: int) -> set[int]:
    from stepgrpo.runtime.reaper import descendants

    return set(descendants(pid))


def _alive(pid: int) -> bool:
    from stepgrpo.runtime.reaper import start_time

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return start_time(pid) is not None and state not in ("Z", "X")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill -9"])
def test_a_command_leaves_no_process_behind(tmp_path, sig, prefect_home):
    env = dict(os.environ, PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)  # its own temporary server
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND, str(tmp_path / "run")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line.startswith("ready"):
            line = command.stdout.readline()
            assert line or command.poll() is None, "the command ended early"
            assert time.monotonic() < deadline
        helper = int(line.split()[1])
        time.sleep(1.0)  # the watchdog reads the command's descendants four times a second
        started = _descendants(command.pid) | {helper}
        assert len(started) >= 3  # the watchdog, the temporary server, the helper
        os.kill(command.pid, sig)
        command.wait(timeout=60)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in started):
            assert time.monotonic() < deadline, [p for p in started if _alive(p)]
            time.sleep(0.2)
    finally:
        if command.poll() is None:
            command.kill()
