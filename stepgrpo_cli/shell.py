"""What every `stepgrpo` command shares: its consoles, its option types, and how it runs a flow
and fails (one line naming the problem and its fix; the traceback behind `--verbose`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

console = Console()
err_console = Console(stderr=True)


def _no_value(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # a flag takes no value: its help shows none (Typer's default: `<bool>`)
    return option


class Command(TyperCommand):
    """A command whose help shows what to type (each option's metavar; `--help` no value)."""

    def get_help_option(self, ctx: Any) -> Any:
        return _no_value(super().get_help_option(ctx))


class Group(TyperGroup):
    """A command group whose help shows what to type, as `Command`'s."""

    def get_help_option(self, ctx: Any) -> Any:
        return _no_value(super().get_help_option(ctx))


ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config (default: built-in defaults).", metavar="NAME|FILE")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: key=value (YAML value), repeatable.", metavar="KEY=VALUE"),
]
RunDirOpt = Annotated[
    Path | None, typer.Option("--run-dir", help="The run directory (resumed if it exists).", metavar="DIR")
]
RunIdOpt = Annotated[
    str | None, typer.Option("--run-id", help="Run id under run.runs_root (resumed if it exists).", metavar="ID")
]
RunArg = Annotated[str, typer.Argument(help="A run directory or a run id under runs/.", metavar="RUN")]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help="Prefect's run lines and a failure's traceback on the console too.", metavar=""
    ),
]


def expected_errors() -> tuple[type[BaseException], ...]:
    from stepgrpo.config import ConfigError
    from stepgrpo.errors import StageError
    from stepgrpo.storage.errors import StorageError
    from stepgrpo_core.registry import UnknownNameError

    return (ConfigError, StageError, StorageError, UnknownNameError, FileNotFoundError, ValueError, TypeError, KeyError)


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a flow; on failure print a clear message and exit 1."""
    try:
        from stepgrpo.runtime import environment

        environment.apply()  # the flows apply it again with their config's `scale.threads`
        return fn(*args, **kwargs)
    except typer.Exit:  # a command's own exit, after its own message
        raise
    except expected_errors() as err:
        failed("error", err)
    except Exception as err:  # an unexpected failure: still a message and a non-zero exit
        failed("failed", err)


def failed(label: str, err: BaseException) -> None:
    """A failure as one line naming the problem (and, where stepgrpo knows it, the fix), printed
    after the live bar has closed; the traceback only when asked for (`--verbose`,
    STEPGRPO_VERBOSE=1), which also shows Prefect's own lines; exits 1."""
    from stepgrpo.reporting.live import VERBOSE_ENV

    verbose = os.environ.get(VERBOSE_ENV) == "1"
    if verbose:
        err_console.print_exception(show_locals=False)
    err_console.print(
        f"[bold red]{label}:[/] {type(err).__name__}: {escape(str(err))}", highlight=False, soft_wrap=True
    )
    if not verbose:
        err_console.print(f"[dim](the traceback: run again with --verbose or {VERBOSE_ENV}=1)[/]", highlight=False)
    raise typer.Exit(1) from None


def call_flow(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a command that runs a flow (`stepgrpo.flows.api`), as `call` does. Whatever ends this
    process, what it starts ends with it (`stepgrpo.runtime.reaper`; SIGTERM is an orderly exit
    that stops Prefect's temporary server)."""
    import signal

    from stepgrpo.flows import session
    from stepgrpo.reporting.live import VERBOSE_ENV
    from stepgrpo.runtime import reaper

    # a failure reaches the console as one line (`failed`), not as Prefect's tracebacks
    session.QUIET_FAILURES = os.environ.get(VERBOSE_ENV) != "1"
    reaper.start()
    signal.signal(signal.SIGTERM, terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores it
        signal.signal(signal.SIGINT, terminated)
    session.OWN_TEMPORARY_SERVER = True
    return call(fn, *args, **kwargs)


def call_offline(fn: Any, run: str, *args: Any, **kwargs: Any) -> Any:
    """An offline command on `run` (`rescore`, `credit`, `evaluate`), as `call_flow` runs it; the
    helper that writes its MLflow run starts first, so that it imports MLflow while this process
    imports torch and Prefect (`stepgrpo.reporting.offline`)."""
    from stepgrpo.reporting import offline

    with offline.helper(run):
        return call_flow(fn, run, *args, **kwargs)


def resume_command(path: Path) -> str:
    """This `stepgrpo train` command line, naming the run it made or resumed (by `--run-id`
    unless the line names it already)."""
    import shlex

    args, named = sys.argv[1:], False
    for flag in ("--run-id", "--run-dir"):
        named = named or any(a == flag or a.startswith(f"{flag}=") for a in args)
    program = sys.argv[0] if Path(sys.argv[0]).name == "stepgrpo" else "stepgrpo"
    return shlex.join([program, *args, *([] if named else ["--run-id", path.name])])


def terminated(signum: int, frame: Any) -> None:
    """SIGINT (Ctrl-C) and SIGTERM: noted (`session.INTERRUPTED`), then a KeyboardInterrupt."""
    from stepgrpo.flows import session

    session.INTERRUPTED = True
    raise KeyboardInterrupt(f"signal {signum}")


def where(run: str) -> str:
    """The run directory a command's RUN argument names (for a table's title)."""
    from stepgrpo.storage.run import find_run

    return str(find_run(run))


def options_json(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        err_console.print(f"[bold red]error:[/] --options is not JSON: {err}")
        raise typer.Exit(1) from None
    if not isinstance(value, dict):
        err_console.print("[bold red]error:[/] --options must be a JSON object")
        raise typer.Exit(1)
    return value


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def damaged(items: Any) -> None:
    """Each damaged record (`stepgrpo.inspection.Damaged`) named on stderr."""
    for d in items:
        err_console.print(f"[bold red]damaged:[/] {escape(str(d.path))}: {escape(d.error)}", soft_wrap=True)
