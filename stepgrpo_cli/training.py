"""`stepgrpo train`, `demo`, `config show`, `deploy`, `calibrate`, `pretrain`: the commands that start
training or set it up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from stepgrpo_cli import shell
from stepgrpo_cli.shell import ConfigOpt, RunDirOpt, RunIdOpt, SetOpt, VerboseOpt


def train(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    run_id: RunIdOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Train: iterations of rollout -> complete -> score -> credit -> update, evaluated before and after."""
    from stepgrpo.flows import api
    from stepgrpo.reporting.live import VERBOSE_ENV, interactive
    from stepgrpo.reporting.report import print_summary

    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    elif interactive():  # the live bar: Prefect's run lines stay in its UI (set before Prefect is imported)
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    try:
        out = shell.call_flow(api.train, config, overrides=set_ or [], run_dir=run_dir, run_id=run_id)
    except api.Interrupted as stopped:
        shell.err_console.print(
            "interrupted; the run keeps every stage it finished. Resume it with:\n  "
            + shell.resume_command(stopped.run_dir),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    print_summary(out.run_dir, out.tracking_uri, [e.record() for e in out.evaluations])


def demo(
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """The CPU demo: the shipped shapes model learns its reward with Flow-GRPO (the shipped `demo`
    config: 100 iterations, a few minutes), then the base and trained held-out rewards."""
    from stepgrpo.paths import SHIPPED_CONFIGS

    train(config=SHIPPED_CONFIGS / "demo.yaml", set_=set_, run_dir=None, run_id=run_id, verbose=verbose)


config_app = typer.Typer(
    cls=shell.Group, help="The config: every field, its value and description.", no_args_is_help=True
)


@config_app.command("list", cls=shell.Command)
def config_list() -> None:
    """The shipped recipes, one line each: `--config NAME` trains one; `*` marks where to start."""
    from stepgrpo.config import START_HERE, shipped_recipes

    for name, about in shipped_recipes():
        mark = "*" if name == START_HERE[0] else " "
        shell.console.print(f"{mark} {name:28s} {about}", highlight=False, soft_wrap=True)
    shell.console.print(f"\n* start here: {START_HERE[0]}, {START_HERE[1]}", highlight=False, soft_wrap=True)


@config_app.command("variants", cls=shell.Command)
def config_variants(
    markdown: Annotated[
        bool, typer.Option("--markdown", help="As the Markdown table of docs/METHODS.md.", metavar="")
    ] = False,
    papers: Annotated[
        bool,
        typer.Option("--papers", help="The papers, each beside what implements it (docs/METHODS.md).", metavar=""),
    ] = False,
) -> None:
    """Every family a config names: the built-in kernels, completion methods, credit schemes,
    objectives and rewards, the optimizer presets and the evaluation protocols: how a config names
    each, its options, its paper, what it does (read from the registries, the only lists)."""
    from rich.table import Table

    from stepgrpo.families import families
    from stepgrpo_core.variants import core_registries, markdown_table, papers_table

    if papers:
        print(papers_table(families()), end="")
        return
    if markdown:
        print(markdown_table(core_registries()), end="")
        return
    table = Table("family", "name", "options", "paper", "what it does", show_lines=False)
    for heading, registry in families().items():
        for name in registry.names():
            d = registry.describe(name)
            options = ", ".join(f"{k}={v}" for k, v in d["options"].items())
            table.add_row(heading, d["pattern"], options, d["paper"] or "", d["summary"])
    shell.console.print(table)


@config_app.command("show", cls=shell.Command)
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved config (--config, then --set) as YAML, each field under its description."""
    from stepgrpo.config import describe, load_config

    cfg = shell.call(load_config, config, set_ or [])
    print(describe(cfg))


def deploy(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="YAML config: the run form's defaults (train, calibrate).", metavar="NAME|FILE"
        ),
    ] = None,
    set_: SetOpt = None,
    name: Annotated[
        str | None, typer.Option(help="Deployment name (default: the config file's stem).", metavar="NAME")
    ] = None,
    pool: Annotated[str, typer.Option(help="Prefect work pool (a process pool).", metavar="POOL")] = "stepgrpo",
    flow: Annotated[
        str,
        typer.Option(help="The flow: train, calibrate, evaluate, rescore, credit or credit-quality.", metavar="FLOW"),
    ] = "train",
) -> None:
    """Register a deployment that runs in this directory: train (or calibrate) with CONFIG's values in
    its run form, or an offline flow (needs PREFECT_API_URL)."""
    from stepgrpo.config import load_config
    from stepgrpo_cli.deployments import FLOWS

    if flow in FLOWS and config is None:
        shell.err_console.print(f"[bold red]error:[/] --flow {flow} needs --config: its run form holds that recipe")
        raise typer.Exit(1)
    cfg = shell.call(load_config, config, set_ or []) if config is not None else None
    if not os.environ.get("PREFECT_API_URL"):
        shell.err_console.print(
            "[bold red]error:[/] a deployment lives on a Prefect server: start one (`stepgrpo server start`, or "
            "`prefect server start` and set PREFECT_API_URL; docs/PIPELINE.md)"
        )
        raise typer.Exit(1)
    from stepgrpo_cli.deployments import deploy_flow

    label = name or (config.stem if config is not None else flow)
    deployment = shell.call(deploy_flow, cfg, label, pool, str(config) if config else None, flow)
    holds = f"its run form holds {config}" if config is not None else "its run form asks for the run"
    shell.console.print(f"deployment {flow}/{label} ({deployment}) on pool {pool}, runs in {Path.cwd()}: {holds}")


def calibrate(
    config: ConfigOpt = None, set_: SetOpt = None, run_dir: RunDirOpt = None, run_id: RunIdOpt = None
) -> None:
    """DenseGRPO psi calibration into a run (then `train` with the same config and run id)."""
    from stepgrpo.flows import api

    psi, path = shell.call_flow(api.calibrate, config, overrides=set_ or [], run_dir=run_dir, run_id=run_id)
    shell.console.print(f"psi: {[round(p, 4) for p in psi]}\nrun directory: {path}")


def pretrain(ctx: typer.Context) -> None:
    """Pretrain the shipped `shapes` model into a new directory (`stepgrpo pretrain --help`: the options)."""
    from stepgrpo.pretraining.pretrain import main

    shell.call(main, list(ctx.args))
