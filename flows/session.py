"""How the Python entry (`stepgrpo.flows.api`) runs a flow: the Prefect server it talks to, the
run's lock held while the flow runs, the helper process of an offline command's MLflow run, and
the config a call names. Imports nothing heavy until called (Prefect, MLflow)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepgrpo.config import Config


def config_of(config: Config | Mapping[str, Any] | str | Path | None, overrides: Sequence[str]) -> Config:
    from stepgrpo.config import config_from

    if isinstance(config, str | Path):
        return config_from(None, config, overrides)
    return config_from(config, None, overrides)


# Whether a call with no server to talk to starts a temporary server of its own (`server.temporary`:
# the console script, one command a process, so that a Ctrl-C reaches the command first) or lets
# Prefect start its temporary server (in this process's group; it lives as long as the process).
OWN_TEMPORARY_SERVER = False

# Set by the console script's SIGINT / SIGTERM handler: the run was interrupted, whatever error
# the interrupt surfaced as (`api.train` then raises `Interrupted`, the resume command's cue).
INTERRUPTED = False

# Whether Prefect's console handlers drop its error records (a failed task's and flow's tracebacks,
# ~130 lines over the live bar): the CLI prints a failure as one line instead, and the Prefect UI
# keeps them. Set by the console script unless it runs with --verbose.
QUIET_FAILURES = False


class _NoErrors:
    """A logging filter: Prefect's records below ERROR, and every other logger's records."""

    @staticmethod
    def filter(record: Any) -> bool:
        return record.levelno < 40 or not record.name.startswith("prefect")  # 40: logging.ERROR


def quiet_failures() -> None:
    """Prefect's console handlers drop its error records; other lines still show."""
    import logging

    import prefect.main  # noqa: F401  (sets up Prefect's logging handlers, once per process)

    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):  # the root's: Prefect's console handler
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and _NoErrors not in map(type, handler.filters):
                handler.addFilter(_NoErrors())


# Prefect's own names for the flow-run heartbeat interval; a user who sets one keeps heartbeats everywhere
HEARTBEAT_VARIABLES = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


@contextlib.contextmanager
def prefect_server(heartbeats: bool = True) -> Iterator[None]:
    """Prefect's server for the flow: `PREFECT_API_URL`'s, else a kept one, else a temporary one
    (set in Prefect's settings too, since Prefect may already be imported in this process).

    `heartbeats=False` (the offline commands, seconds long): no flow-run heartbeats unless the user
    set their interval. Prefect's heartbeat thread sleeps in steps of 1 s and the flow's end waits
    for it, which added 0-1 s (0.5 s on average) to every such command; the heartbeats serve
    Prefect's zombie-run automations, which a command of seconds does not need."""
    from stepgrpo.runtime import environment, server

    environment.apply()  # the flows apply it again with their config's `scale.threads`
    with contextlib.ExitStack() as stack:
        url = server.kept_url()
        if url is None and OWN_TEMPORARY_SERVER and not os.environ.get("PREFECT_API_URL"):
            url = stack.enter_context(server.temporary())
        # Prefect imported only now: its process-wide settings, which its events worker reads, then
        # hold the temporary server's address (imported before, they would hold none, and the
        # drain at the server's stop would wait seconds on a server of Prefect's own)
        from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        updates: dict[Any, Any] = {} if url is None else {PREFECT_API_URL: url}
        if not heartbeats and not any(os.environ.get(v) for v in HEARTBEAT_VARIABLES):
            updates[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
        if updates:
            stack.enter_context(temporary_settings(updates=updates))
        if QUIET_FAILURES:
            quiet_failures()
        yield


def offline_log(path: Path) -> contextlib.AbstractContextManager[None]:
    """The MLflow run of an offline command, written by a helper process that imports MLflow while
    the command imports Prefect and torch (`stepgrpo.reporting.offline`). A process that imported
    MLflow already (a notebook that trained a run) has nothing for a helper to overlap: the record
    is written in this process, ~2 s of CPU and a process start less. (The CLI starts its helper
    before any of this, `stepgrpo_cli.shell`; `log` takes that one.)"""
    import sys

    from stepgrpo.reporting import offline

    if "mlflow" in sys.modules:
        return contextlib.nullcontext()
    return offline.helper(path)


def owned_run(path: Path, flow: Any, **kwargs: Any) -> Any:
    """Run `flow` holding the run's lock (taken before its Prefect server starts)."""
    from stepgrpo.runs import owned

    with owned(path):
        return flow(**kwargs)
