"""`stepgrpo reward-server` and `stepgrpo server start|stop|status`: the servers a run talks to."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from stepgrpo_cli import shell


def reward_server(
    reward: Annotated[str, typer.Option(help="A registered reward or a `name:weight,...` sum.", metavar="NAME")],
    options: Annotated[str, typer.Option(help="The reward's options as JSON.", metavar="JSON")] = "{}",
    host: Annotated[
        str, typer.Option(help="Address to listen on (0.0.0.0: every interface; needs --token).", metavar="ADDRESS")
    ] = ("127.0.0.1"),
    port: Annotated[int, typer.Option(help="Port to listen on.", metavar="PORT")] = 8100,
    max_batch: Annotated[
        int,
        typer.Option(
            help="Most images of one reward call: concurrent requests are scored together up to it.", metavar="N"
        ),
    ] = 64,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="STEPGRPO_REWARD_TOKEN",
            show_envvar=True,
            help="Shared secret clients send (they read STEPGRPO_REWARD_TOKEN); required beyond the loopback.",
            metavar="TOKEN",
        ),
    ] = None,
    resolution: Annotated[
        int | None,
        typer.Option(
            help="The image side the clients' model makes: other sizes are refused before decoding.", metavar="PIXELS"
        ),
    ] = None,
    max_body_mib: Annotated[
        int | None,
        typer.Option(
            help="Largest request body, MiB (default: --max-batch images of --resolution, 1024 px if unset).",
            metavar="MIB",
        ),
    ] = None,
) -> None:
    """Serve REWARD over HTTP for the `http` reward of runs elsewhere (FastAPI on uvicorn; /docs has
    its OpenAPI page; one log line per request and per reward call)."""
    import logging

    from stepgrpo.rewards import build_reward
    from stepgrpo.rewards.service import ServiceError, serve
    from stepgrpo_core.registry import allow, references_in

    try:
        parsed = json.loads(options)
        allow(*references_in([reward, parsed]))  # this command's own reward (or a weighted sum's parts)
        built = build_reward({"name": reward, "options": parsed} if parsed else reward)
        server = serve(
            built,
            host,
            port,
            max_batch=max_batch,
            token=token,
            resolution=resolution,
            max_body=None if max_body_mib is None else max_body_mib << 20,
            access_log=True,
        )
    except (ServiceError, ValueError, TypeError, KeyError, OSError) as err:
        shell.err_console.print(f"error: {escape(str(err))}")
        raise typer.Exit(1) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shown = f"[{host}]" if ":" in host else host
    shell.console.print(
        f"serving {built.name} v{built.version} on http://{shown}:{server.server_port} "
        f"(API docs at /docs; Ctrl-C stops)"
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


server_app = typer.Typer(
    cls=shell.Group,
    help="A Prefect server kept running for the commands that run flows (else each starts a temporary one).",
    no_args_is_help=True,
)


@server_app.command("start", cls=shell.Command)
def server_start(
    host: Annotated[str, typer.Option(help="Address to listen on.", metavar="ADDRESS")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (the UI is on it too).", metavar="PORT")] = 4200,
) -> None:
    """Start a Prefect server in the background; later commands (train, rescore, credit, ...) use it."""
    from stepgrpo.runtime import server

    try:
        record, started = server.start(host, port)
    except server.ServerError as err:
        shell.err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(1) from None
    shell.console.print(
        f"{'started' if started else 'already running'}: Prefect server {record['url']} (pid {record['pid']}), "
        f"UI {record['ui']}; commands of this Prefect home ({server.prefect_home()}) use it until "
        "`stepgrpo server stop`",
        soft_wrap=True,
        highlight=False,
    )


@server_app.command("stop", cls=shell.Command)
def server_stop() -> None:
    """Stop the kept Prefect server (runs and their records stay in Prefect's database)."""
    from stepgrpo.runtime import server

    record = server.stop()
    shell.console.print(
        f"stopped the Prefect server at {record['url']}" if record else "no kept Prefect server is running"
    )


@server_app.command("status", cls=shell.Command)
def server_status() -> None:
    """Say whether a kept Prefect server runs, and where."""
    from stepgrpo.runtime import server

    record = server.running()
    if record is None:
        shell.console.print("no kept Prefect server: each command that runs a flow starts a temporary one")
        raise typer.Exit(1)
    shell.console.print(f"Prefect server {record['url']} (pid {record['pid']}), UI {record['ui']}", highlight=False)
