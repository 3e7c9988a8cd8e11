"""`stepgrpo prompts`: the papers' evaluation prompt files, pinned by source and hash
(`stepgrpo.prompts.pinned`): list them, fetch one into the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stepgrpo_cli import shell

prompts_app = typer.Typer(
    cls=shell.Group, help="The papers' evaluation prompt files, pinned by source and hash.", no_args_is_help=True
)


@prompts_app.command("list", cls=shell.Command)
def prompts_list() -> None:
    """Each pinned file: the name a config gives it (`pinned:NAME`), its prompts, source and whether it is cached."""
    from stepgrpo.prompts.pinned import PINNED, PREFIX, cached_path

    for name, f in PINNED.items():
        state = "cached" if cached_path(name).is_file() else "not fetched"
        shell.console.print(
            f"{PREFIX + name:26s} {f.prompts:5d} prompts  {state:11s}  {f.source}  ({f.about})",
            highlight=False,
            soft_wrap=True,
        )


@prompts_app.command("fetch", cls=shell.Command)
def prompts_fetch(
    name: Annotated[str, typer.Argument(help="A pinned file (`stepgrpo prompts list`).", metavar="NAME")],
    source: Annotated[
        Path | None,
        typer.Option("--from", help="A copy you have, instead of downloading (checked by its hash).", metavar="FILE"),
    ] = None,
) -> None:
    """Put a pinned prompt file into the cache, downloaded from its pinned commit or copied from a file
    you have; refused unless its bytes hash to the pinned value."""
    from stepgrpo.prompts import pinned

    path = shell.call(pinned.fetch, name.removeprefix(pinned.PREFIX), source)
    shell.console.print(f"{pinned.PREFIX}{name.removeprefix(pinned.PREFIX)}: {path} (sha256 verified)")
