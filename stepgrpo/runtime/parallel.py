"""Rank processes on this node for a data-parallel computation (the update's, `stepgrpo.loops.update`):
start them, let them meet, wait for them, and stop every one when one fails.

Why not torchrun: its rendezvous store listens on every interface without authentication. Here
the ranks meet through a file in a private temporary directory (`torch.distributed.FileStore`:
no port is opened for the rendezvous), gloo's own connections bind to the loopback interface
(`GLOO_SOCKET_IFNAME`, unless the user set it for a cluster), and every rank dies with the
process that launched it (Linux `PR_SET_PDEATHSIG`; the ranks also share its process group), so a
killed command leaves no rank writing into a run that a resumed command now owns.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepgrpo.errors import StageError

PARENT_ENV = "STEPGRPO_UPDATE_PARENT"  # the launcher's pid: a rank exits when it is gone
STORE_ENV = "STEPGRPO_RENDEZVOUS"  # the FileStore the ranks meet through
ANSWER_ENV = "STEPGRPO_ANSWER_FD"  # a kept rank's pipe for its answers (`RankPool`)
POLL_S = 0.05


def loopback_interface() -> str:
    """The name of the loopback interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


class RankPool:
    """`n` ranks of the command `cmd(dir)` started once and kept (`dir`: the pool's private
    directory, for the files they read; removed by `close`): each command (a JSON object) goes to every rank's
    stdin, and `run` returns when every rank has answered on its own pipe (one JSON line). A rank
    that dies or answers an error stops the others and fails the command, naming the rank, its
    host and the tail of its log; the pool is then `broken` and a later command needs a new pool.
    `close()` ends the ranks (their stdin closes; killed if they hang). The ranks meet through a
    FileStore in the private directory (no port is opened for the rendezvous), their collectives
    bind to the loopback interface unless the user chose one, each writes its output to
    `dir/rank<r>.log`, and each dies with this process (`die_with_parent`). With `preload` (the
    modules a rank imports; `cmd` then runs `python -m module ...`), the ranks are forked from a
    process that imported them once and that this process keeps for later pools
    (`stepgrpo.runtime.warm`, Linux): ~0.1 s a rank where a new process spends ~4-5 s of CPU."""

    def __init__(
        self, cmd: Callable[[Path], list[str]], n: int, what: str, hint: str, preload: tuple[str, ...] = ()
    ) -> None:
        self.n, self.what, self.hint, self.broken = n, what, hint, False
        self._tmp = tempfile.TemporaryDirectory(prefix="stepgrpo-ranks-")
        self.dir = Path(self._tmp.name)
        args = cmd(self.dir)
        self._answers: list[int] = []
        self.procs: list[Any] = []  # subprocess.Popen, or a rank forked by the warm process
        base = _rank_env(n, self.dir)
        warm = None
        if preload:
            from stepgrpo.runtime import warm as forks

            warm = forks.kept(preload)
        for r in range(n):
            read, write = os.pipe()
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), ANSWER_ENV: str(write)}
            with open(self.dir / f"rank{r}.log", "wb") as out:
                if warm is not None:  # `python -m module` of `args`, forked with its imports done
                    stdin_read, stdin_write = os.pipe()
                    proc = warm.start(args, env, stdin_read, out.fileno(), write)
                    os.close(stdin_read)
                    proc.stdin = os.fdopen(stdin_write, "wb")
                else:
                    proc = subprocess.Popen(
                        args, env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(write,)
                    )
                self.procs.append(proc)
            os.close(write)
            self._answers.append(read)

    def run(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's answer to `command`, in rank order."""
        if self.broken:
            raise StageError(f"{self.what}: its processes were stopped by an earlier failure")
        line = (json.dumps(command) + "\n").encode()
        for r, proc in enumerate(self.procs):
            try:
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._fail(r)
        buffers = [b""] * self.n
        answers: list[dict[str, Any] | None] = [None] * self.n
        while any(a is None for a in answers):
            waiting = [fd for r, fd in enumerate(self._answers) if answers[r] is None]
            ready, _, _ = select.select(waiting, [], [], POLL_S)
            for fd in ready:
                r = self._answers.index(fd)
                chunk = os.read(fd, 65536)
                if not chunk:  # the rank closed its pipe: it died
                    self._fail(r)
                buffers[r] += chunk
                if buffers[r].endswith(b"\n"):
                    answers[r] = json.loads(buffers[r])
                    if "error" in answers[r]:
                        self._fail(r)
            dead = [r for r, p in enumerate(self.procs) if answers[r] is None and p.poll() is not None]
            if dead:
                self._fail(dead[0])
        return answers  # type: ignore[return-value]

    def _fail(self, r: int) -> None:
        self.broken = True
        for proc in self.procs:  # the others would wait for it in the next all-reduce forever
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        tail = "\n".join((self.dir / f"rank{r}.log").read_text(errors="replace").strip().splitlines()[-15:])
        raise StageError(
            f"{self.what} over {self.n} processes failed (rank {r} on {socket.gethostname()}, "
            f"exit {self.procs[r].returncode}):\n{tail}\n{self.hint}"
        )

    def close(self, wait: bool = True) -> None:
        """End the ranks: their stdin closes and they exit after the command they run (`wait`),
        or they are killed now (an interrupted run: a rank mid-update would finish it first)."""
        if not wait:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._answers:
            os.close(fd)
        self._answers = []
        self._tmp.cleanup()


def answer_pipe() -> Any:
    """A kept rank's pipe for its answers (`RankPool`), as a text file."""
    return os.fdopen(int(os.environ[ANSWER_ENV]), "w")


def _rank_env(n: int, tmp: Path) -> dict[str, str]:
    base = {
        **os.environ,
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        PARENT_ENV: str(os.getpid()),
        STORE_ENV: str(tmp / "rendezvous"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        base.setdefault(var, loopback_interface())
    return base


def init_group(backend: str) -> None:
    """Join the group `RankPool` formed (its FileStore; RANK and WORLD_SIZE from the environment)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.environ[STORE_ENV], world)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world)


def die_with_parent() -> None:
    """This rank is killed when the launching process dies (Linux), and exits now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ.get(PARENT_ENV, os.getppid())):
        os._exit(1)  # the launcher died before the death signal was armed
