"""`stepgrpo` commands in warm processes, for the benchmark scripts that run many of them.

Every new `stepgrpo` process spends ~13 s importing (torch, diffusers, mlflow, Prefect) before it
does any work, and without PREFECT_API_URL it also starts a temporary Prefect server of its own: at
`--quick` settings that is most of a run. `Stepgrpo` keeps `jobs` worker processes
(`python -m bench._lib.warm`) that imported the CLI once, and runs each command in one of them through
the CLI's own entry point (the typer app: the same checks, flows and exit codes as the console
script), with every byte the command writes to stdout and stderr in its log. Without
PREFECT_API_URL, one Prefect server under `out` serves all of them for the pool's life
(`bench/_lib/prefect.py`).

    with Stepgrpo(jobs=2, out=out) as stepgrpo:
        rc = stepgrpo.run(["train", "--config", "configs/shapes_outcome.yaml"], out / "train.log")

Commands of one worker run one after another in one process: what a user's notebook does with the
Python entry, and what the test suite does with the flows in-process (a run's seed, not the
process, fixes its noise and prompts).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def command_env(out: Path) -> dict[str, str]:
    """The environment of a `stepgrpo` command a benchmark runs: one torch thread, no progress
    bars, a Prefect home under `out` (its temporary server's database shared with no other
    process), a generous server start-up timeout (the machine may be busy), no telemetry."""
    return dict(
        os.environ,
        STEPGRPO_THREADS="1",
        STEPGRPO_PROGRESS="0",
        PREFECT_HOME=str(out / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
    )


class Stepgrpo:
    """`jobs` warm processes that run `stepgrpo` commands (see the module's docstring)."""

    def __init__(self, jobs: int, out: Path) -> None:
        self.out = out.resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self._stack = contextlib.ExitStack()
        env = command_env(self.out)
        if not env.get("PREFECT_API_URL"):
            from bench._lib.prefect import local_server

            _, _, env = self._stack.enter_context(local_server(env, self.out / "prefect-home"))
        self._idle: queue.Queue[subprocess.Popen[str]] = queue.Queue()
        for _ in range(max(1, jobs)):
            worker = subprocess.Popen(
                [sys.executable, "-m", "bench._lib.warm"],
                cwd=ROOT,
                env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self._stack.callback(_stop, worker)
            self._idle.put(worker)

    def run(self, args: list[str], log: Path) -> int:
        """`stepgrpo ARGS` in a free worker, its output in `log`; its exit status."""
        worker = self._idle.get()
        try:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps({"args": [str(a) for a in args], "log": str(log)}) + "\n")
            worker.stdin.flush()
            answer = worker.stdout.readline()
            if not answer:
                raise SystemExit(f"a warm stepgrpo worker died running `stepgrpo {' '.join(args)}`; see {log}")
            return int(json.loads(answer)["rc"])
        finally:
            self._idle.put(worker)

    def __enter__(self) -> Stepgrpo:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _stop(worker: subprocess.Popen[str]) -> None:
    """End a worker: its stdin closes, it exits after the command it runs (killed if it hangs)."""
    if worker.stdin:
        worker.stdin.close()
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def serve() -> None:
    """A worker: import the CLI, then run the commands read from stdin (one JSON object a line),
    answering each with its exit status on the stdout it started with; between commands its
    stdout and stderr are its parent's stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import stepgrpo_cli.app  # noqa: F401  (the imports every command would pay)

    for line in sys.stdin:
        job = json.loads(line)
        answers.write(json.dumps({"rc": command(job["args"], job["log"])}) + "\n")
        answers.flush()


def command(args: list[str], log: str) -> int:
    """Run one command with this process's stdout and stderr (the file descriptors: the output of
    Prefect's and rich's handlers too) sent to `log`."""
    from stepgrpo_cli.app import app

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        rc = app(args, prog_name="stepgrpo", standalone_mode=False)
        return int(rc or 0)
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 1
    except Exception:  # a usage error, or a failure the CLI did not turn into an exit status
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


if __name__ == "__main__":
    serve()
