"""`stepgrpo` commands (and Python scripts) run the way the console script (and `python script.py`)
runs them, without paying their imports each time.

A process (`python tests/warm_cli.py`, started by `WarmCli`) imports the CLI and what its commands
import (torch, diffusers, Prefect, MLflow) once, then forks a child for each command: the child
takes the command's working directory, stdout and stderr files and stdin from /dev/null, and runs
the CLI's app as the console script does (`stepgrpo_cli.main`), then every exit handler, so the
exit status, the handlers' work and every byte written are the ones a `stepgrpo` process gives. A
child starts in a few hundred milliseconds where a new process spends ~4 s importing. A script
(`WarmCli.python`) runs in a child likewise, as `__main__` with its folder first on `sys.path`.

Settings read at import (Prefect's API URL and home) are the warm process's: `WarmCli.run` refuses
an environment other than the one it was started with (the caller runs a process of its own then).
The warm process forks from one thread and runs no torch operation, so a child inherits no lock
held by another thread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


class WarmCli:
    """One warm process for commands that share the environment `env`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._outputs = Path(tempfile.mkdtemp(prefix="warm-cli-"))
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm CLI process did not start: {ready!r}")

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
        """`stepgrpo *args` in `cwd`: its status and output, as `subprocess.run(..., capture_output=True)`."""
        return self._request({"args": args}, ["stepgrpo", *args], cwd, env, timeout)

    def _request(self, what: dict, argv: list[str], cwd: Path, env: dict[str, str], timeout: float):
        if env != self.env:
            raise ValueError("the warm CLI runs commands in the environment it was started with")
        out, err = self._outputs / "stdout", self._outputs / "stderr"  # not in `cwd`: it may be the checkout
        request = {**what, "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "timeout": timeout}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError("the warm CLI process ended")
        rc = json.loads(answer)["rc"]
        done = subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return done

    def python(self, script: Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
        """`python script` in `cwd` (its folder first on `sys.path`, run as `__main__`), as `run`."""
        return self._request({"script": str(script)}, ["python", str(script)], cwd, env, timeout)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        shutil.rmtree(self._outputs, ignore_errors=True)


def serve() -> None:
    """Import once, then fork a child a command (module doc)."""
    import runpy
    import signal

    import diffusers  # noqa: F401
    import mlflow  # noqa: F401
    import prefect  # noqa: F401
    import torch  # noqa: F401

    import stepgrpo.flows.api  # noqa: F401
    from stepgrpo_cli.app import app

    protocol_out = os.fdopen(os.dup(1), "w")
    print("ready", file=protocol_out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the command
            os.chdir(request["cwd"])
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            signal.alarm(int(request["timeout"]))  # a command that hangs dies (SIGALRM) instead of the suite
            if "script" in request:
                sys.argv = [request["script"]]
                sys.path.insert(0, os.path.dirname(request["script"]))
                os._exit(finished(lambda: runpy.run_path(request["script"], run_name="__main__")))
            sys.argv = ["stepgrpo", *request["args"]]
            os._exit(finished(app))
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=protocol_out, flush=True)


def finished(main) -> int:
    """`main()` (the CLI's app as `stepgrpo_cli.main` runs it, or a script), then the exit handlers
    (the ones imported before the fork among them: a new process registers those too); its status."""
    import atexit
    import traceback

    status = 1
    try:
        main()
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except KeyboardInterrupt:
        status = 130
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return status


if __name__ == "__main__":
    serve()
