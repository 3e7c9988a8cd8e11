"""The `stepgrpo` console script, above the flows it runs (`stepgrpo_cli.app`)."""

from __future__ import annotations

from stepgrpo_cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """The console script: the command, then the process ends as soon as the command and every exit
    handler (Prefect's log flush, the temporary server's stop, `logging`'s) have finished, without
    the interpreter's teardown (`stepgrpo.runtime.environment.end_at_exit`)."""
    from stepgrpo.runtime.environment import end_at_exit

    status = end_at_exit()
    try:
        app()
    except SystemExit as done:
        code = done.code
        status[0] = code if isinstance(code, int) else 0 if code is None else 1
        raise
    except KeyboardInterrupt:
        status[0] = 130
        raise
