"""No orphans: the processes a command starts end with it, however it ends (Linux).

A command that runs a flow starts helpers it does not own the code of: Prefect's temporary server,
a local Ray cluster, the update's ranks. On Ctrl-C and SIGTERM they are stopped by their owners'
exit handlers (`stepgrpo_cli` turns SIGTERM into an orderly exit). A kill -9 of the command runs
no handler at all, so `start()` launches a watchdog process first: it keeps the list of the
command's descendants (read from `/proc` four times a second) and, when the command is gone (the pipe
it holds closes, whatever killed it), terminates every recorded descendant that is still the same
process (same start time), then kills those that ignore it.

    python -m stepgrpo.runtime.reaper PID FD    # the watchdog (started by `start`)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.25  # how often the watchdog refreshes the list of descendants (one started since is missed)
GRACE_S = 5.0  # how long a descendant has to exit after SIGTERM before SIGKILL

_started: list[int] = []  # the pid of this process whose watchdog runs (at most one)
_keep: list[int] = []  # the pipe's write end, open for the life of this process


def start() -> None:
    """Start this process's watchdog (once; Linux only, elsewhere nothing)."""
    if not sys.platform.startswith("linux") or os.getpid() in _started:
        return
    read, write = os.pipe()  # this process holds `write` until it dies; non-inheritable by children
    subprocess.Popen(
        [sys.executable, "-m", "stepgrpo.runtime.reaper", str(os.getpid()), str(read)],
        pass_fds=(read,),
        start_new_session=True,  # a kill of the command's process group leaves it to clean up
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read)
    _started.append(os.getpid())
    _keep.append(write)


def start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> dict[int, str]:
    """Every descendant of `pid` and its start time."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                when = start_time(child)
                if when is not None and child not in found:
                    found[child] = when
                    todo.append(child)
    return found


def watch(pid: int, fd: int) -> None:
    """Record `pid`'s descendants until `fd` reaches EOF (`pid` died), then end them."""
    recorded: dict[int, str] = {}
    while True:
        recorded.update(descendants(pid))
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 1):
            break
    alive = {p: t for p, t in recorded.items() if p != os.getpid() and start_time(p) == t}
    for p in alive:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(start_time(p) == t for p, t in alive.items()):
        time.sleep(0.1)
    for p, t in alive.items():
        if start_time(p) == t:
            _signal(p, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
