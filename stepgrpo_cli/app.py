"""The `stepgrpo` console script.

    stepgrpo train [--config F] [--set key=value ...] [--run-dir D] [--run-id ID]
    stepgrpo rescore RUN --reward NAME        # new reward rows, no sampling
    stepgrpo credit RUN --scheme NAME         # new advantages from stored rewards
    stepgrpo calibrate [--config F] ...       # DenseGRPO psi into a run
    stepgrpo evaluate RUN [--iteration K]
    stepgrpo pretrain ...                     # build the shipped shapes model
    stepgrpo reward-server --reward NAME      # serve a reward over HTTP (reward `http`)
    stepgrpo credit-quality RUN               # judge the credit schemes on a stored iteration
    stepgrpo deploy --config F                # a Prefect deployment whose run form holds F
    stepgrpo config show [--config F]         # the resolved config, each field described
    stepgrpo runs                             # the runs under runs/
    stepgrpo inspect RUN                      # iterations, stages published, rewards, diagnostics
    stepgrpo compare RUN...                   # runs side by side at equal compute
    stepgrpo prune RUN / export RUN           # thin a run's stored latents / hand on its LoRA
    stepgrpo server start|stop|status         # a Prefect server kept for the commands above
    stepgrpo prompts list|fetch NAME          # the papers' evaluation prompt files, pinned by hash

One module a command group: `training` (train, demo, config, deploy, calibrate, pretrain),
`offline` (rescore, credit, credit-quality, evaluate), `serving` (reward-server, server), `runs`
(runs, compare, prune, export), `inspecting` (inspect), `prompts` (prompts list, fetch); `shell` holds
what they share. This module assembles them.

Every command exits non-zero with a one-paragraph message when its input is wrong (unknown
field, reward, scheme or kernel; missing model; a run of another schema version).
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from stepgrpo_cli import inspecting, offline, prompts, runs, serving, shell, training

app = typer.Typer(
    name="stepgrpo",
    cls=shell.Group,
    help="GRPO fine-tuning of flow-matching text-to-image models with step-level credit, as a cached Prefect pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from stepgrpo import __version__

        shell.console.print(f"stepgrpo {__version__}")
        raise typer.Exit()


# Commands that run a flow, so talk to a Prefect server: a kept one if there is (`stepgrpo server`).
FLOW_COMMANDS = {"train", "rescore", "credit", "credit-quality", "calibrate", "evaluate", "deploy"}


@app.callback()
def _options(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", is_eager=True, callback=_print_version, metavar=""
        ),
    ] = False,
) -> None:
    """Options of `stepgrpo` itself (the app's help text is `app`'s)."""
    if ctx.invoked_subcommand in FLOW_COMMANDS:
        from stepgrpo.runtime import server

        if (url := server.use_kept()) is not None:  # before anything imports Prefect
            shell.err_console.print(
                f"[dim]Prefect server: {url} (kept; `stepgrpo server stop` ends it)[/]", highlight=False
            )
        elif not os.environ.get("PREFECT_API_URL") and shell.err_console.is_terminal:
            shell.err_console.print(
                "[dim]Prefect server: a temporary one for this command (`stepgrpo server start` keeps one running)[/]",
                highlight=False,
            )


app.command(cls=shell.Command)(training.train)
app.command(cls=shell.Command)(training.demo)
app.add_typer(training.config_app, name="config")
app.command(cls=shell.Command)(training.deploy)
app.command(cls=shell.Command)(offline.rescore)
app.command(cls=shell.Command)(offline.credit)
app.command("credit-quality", cls=shell.Command)(offline.credit_quality)
app.command(cls=shell.Command)(training.calibrate)
app.command(cls=shell.Command)(offline.evaluate)
app.command(
    cls=shell.Command,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)(training.pretrain)
app.command("reward-server", cls=shell.Command)(serving.reward_server)
app.add_typer(serving.server_app, name="server")
app.add_typer(prompts.prompts_app, name="prompts")
app.command(cls=shell.Command)(runs.runs)
app.command(cls=shell.Command)(runs.prune)
app.command(cls=shell.Command)(runs.compare)
app.command(cls=shell.Command)(runs.export)
app.command(cls=shell.Command)(inspecting.inspect)
