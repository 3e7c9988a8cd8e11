"""The `stepgrpo` console script, above the flows it runs (`stepgrpo_cli.app`)."""

from __future__ import annotations

from stepgrpo_cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """The console script: the command, then the process ends as soon as the command and every exit
    handler (Prefect's log flush, the temporary server's stop, `logging`'s) have finished.

    The interpreter's own teardown after that, freeing the modules of torch, Prefect, pandas and
    the rest one by one, takes about a second on a small CPU and does nothing a finished command
    needs: every file a command writes is closed by the command itself, and no stage is published
    at exit. So the last exit handler (registered first, it runs last) ends the process with the
    command's status instead."""
    import atexit
    import os
    import sys

    status = [1]

    def end_now() -> None:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream
                pass
        os._exit(status[0])

    atexit.register(end_now)  # of the handlers registered before it (importing the app), `logging`'s: run above
    try:
        app()
    except SystemExit as done:
        code = done.code
        status[0] = code if isinstance(code, int) else 0 if code is None else 1
        raise
    except KeyboardInterrupt:
        status[0] = 130
        raise
