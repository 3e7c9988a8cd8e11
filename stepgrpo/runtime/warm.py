"""A warm process that imports a rank's code once and forks each rank from it (Linux).

A rank process of the update (`python -m stepgrpo.loops.update`) spends ~4-5 s of CPU importing
torch, diffusers, transformers and peft before it computes anything; `RankPool` starts n of them
for a run, and a process that trains several runs (the Python API, a notebook) starts them again
for each. `Warm` imports them once, in a process of its own kept by the launching process, and
forks every later rank from it: a rank then starts in ~0.1 s. The rank runs exactly what
`python -m <module> <args>` runs (`runpy`, as `__main__`), with the launcher's current environment,
working directory and `sys.path`, its stdin, its log as stdout and stderr, and the pipe of its
answers; its exit status comes back as a child's would (`WarmChild`, the `Popen` calls `RankPool`
makes).

A forked process inherits no other thread and no CUDA context: the warm process runs no torch
operation, asks torch for devices through NVML only (`PYTORCH_NVML_BASED_CUDA_CHECK`), and refuses
to fork (the pool then starts plain processes) if anything it imported initialized CUDA. It is
kept for launches from the same environment (executable, working directory, variables), replaced
when that changes, dies with the launching process (`PR_SET_PDEATHSIG`, as every rank does with
it), and ends when the launcher closes it, after its ranks have ended.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from stepgrpo.runtime.parallel import ANSWER_ENV, PARENT_ENV

_MAX = 1 << 20  # a request's bytes (its environment included)
_FDS = 3  # a rank's stdin, its log, the write end of its answers


def available() -> bool:
    """Ranks can be forked from a warm process here: Linux (its death signal and fd passing)."""
    return sys.platform.startswith("linux") and os.environ.get("STEPGRPO_WARM_RANKS", "1") != "0"


class Warm:
    """The launcher's side: one warm process that imported `preload` (module names)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.preload, self.key, self.dead = preload, _key(), False
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # its own output: imports' warnings, a failure's traceback
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", PARENT_ENV: str(os.getpid())}  # die_with_parent
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), *preload],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        ready = self._receive()
        if self.dead:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"the warm process of the update's ranks failed to start:\n{tail}")
        self.refused: str | None = ready.get("refused")

    def start(self, argv: list[str], env: dict[str, str], stdin: int, log: int, answers: int) -> WarmChild:
        """Fork the rank `argv` (`[python, "-m", module, *args]`, run in the launcher's working
        directory) with the environment `env`, and `stdin`, `log` (stdout and stderr) and `answers`."""
        if argv[:2] != [sys.executable, "-m"] or len(argv) < 3:
            raise ValueError(f"a warm process runs `python -m module ...` ranks, not {argv[:3]}")
        with self._lock:
            socket.send_fds(self._sock, [json.dumps({"argv": argv[2:], "env": env}).encode()], [stdin, log, answers])
            while not self.dead:
                message = self._receive()
                if "pid" in message:
                    return WarmChild(self, message["pid"])
        raise RuntimeError(f"the warm process of the update's ranks ended (exit {self._proc.poll()})")

    def _receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message (an exit is recorded and returned too); {} on timeout or when the warm
        process is gone (`dead`: its ranks died with it)."""
        if self.dead or not select.select([self._sock], [], [], timeout)[0]:
            return {}
        data = self._sock.recv(_MAX)
        if not data:
            self.dead = True
            return {}
        message = json.loads(data)
        if "exit" in message:
            self._exits[message["exit"]] = message["status"]
        return message

    def exit_of(self, pid: int, timeout: float = 0.0) -> int | None:
        """Rank `pid`'s exit status, waiting at most `timeout` seconds for it (-9, as killed, when
        the warm process is gone: its ranks die with it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0 and not select.select([self._sock], [], [], 0)[0]:
                    return None
                self._receive(max(left, 0.0))
            return self._exits.get(pid, -signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """End the warm process once its ranks have ended (it stops reading, then waits for them)."""
        self._sock.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


class WarmChild:
    """A forked rank, with the part of `subprocess.Popen` that `RankPool` uses."""

    def __init__(self, warm: Warm, pid: int) -> None:
        self.warm, self.pid = warm, pid
        self.returncode: int | None = None
        self.stdin: Any = None  # set by the pool: the write end of the rank's stdin

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.warm.exit_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.warm.exit_of(self.pid, 1e9 if timeout is None else timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not yet reaped by the warm process: the pid is still this rank's
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_kept: Warm | None = None


def _key() -> tuple:
    """What a rank's start-up depends on: the interpreter, the working directory (`sys.path[0]` of
    `python -m`) and the environment (PYTHONPATH, and what the imported libraries read at import),
    but for stepgrpo's own variables, read when used (a rank gets them as they are now), and
    pytest's name of the test that runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPGRPO_") and k != "PYTEST_CURRENT_TEST"}
    return (sys.executable, os.getcwd(), tuple(sorted(env.items())))


def kept(preload: tuple[str, ...]) -> Warm | None:
    """This process's warm process for `preload` from its present environment (started, or the one
    started before if nothing a rank depends on changed since); None where ranks are not forked."""
    global _kept
    if not available():
        return None
    if _kept is not None and (_kept.key != _key() or _kept.preload != preload or not (_kept.alive or _kept.refused)):
        _kept.close()
        _kept = None
    if _kept is None:
        _kept = Warm(preload)
        atexit.register(_kept.close)
    return None if _kept.refused else _kept


# ---- the warm process ----


def _serve(fd: int, preload: list[str]) -> None:
    import importlib

    from stepgrpo.runtime.parallel import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    die_with_parent()
    sock = socket.socket(fileno=fd)
    for name in preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sock.send(json.dumps({"refused": "CUDA was initialized while importing the ranks' modules"}).encode())
        return
    if threading.active_count() > 1:
        sock.send(json.dumps({"refused": "importing the ranks' modules started threads"}).encode())
        return
    sock.send(b"{}")
    children: set[int] = set()
    reading = True
    while reading or children:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                if reading:
                    sock.send(json.dumps({"exit": pid, "status": os.waitstatus_to_exitcode(status)}).encode())
        if not reading:
            time.sleep(0.05)
            continue
        if not select.select([sock], [], [], 0.05)[0]:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX, _FDS)
        if not data:  # the launcher closed us: wait for the ranks it started, then end
            reading = False
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _run(json.loads(data), fds)
        for f in fds:
            os.close(f)
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())


def _run(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked rank: become `python -m <module> <args>` in the launcher's environment; never returns."""
    import runpy
    import traceback

    status = 1
    try:
        stdin, log, answers = fds
        os.dup2(stdin, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(stdin)
        os.close(log)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PARENT_ENV] = str(os.getppid())  # this warm process: the rank dies with it
        os.environ[ANSWER_ENV] = str(answers)
        os.dup(answers)  # the pipe stays open to the end, as a process's fds do (not closed with a module's globals)
        module, *args = request["argv"]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()  # the rank's own (`end_at_exit` among them: it ends the process there)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":  # the warm process (`Warm`), its code as the module, not as `__main__`
    from stepgrpo.runtime import warm

    warm._serve(int(sys.argv[1]), sys.argv[2:])
