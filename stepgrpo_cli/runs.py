"""`stepgrpo runs`, `compare`, `prune`, `export`: commands over stored runs (listing, comparing,
thinning, handing on). What `runs` prints is read by `stepgrpo.inspection`; this module only prints it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from stepgrpo_cli import shell
from stepgrpo_cli.shell import RunArg, damaged


def runs(
    root: Annotated[Path, typer.Option(help="Directory holding run directories.", metavar="DIR")] = Path("runs"),
) -> None:
    """List the runs under ROOT: each one's recipe, scheme, status and held-out reward."""
    from stepgrpo.inspection import list_runs

    if not root.is_dir():
        shell.err_console.print(
            f"[bold red]error:[/] --root {escape(str(root))} is not a directory; name the directory that holds "
            "your run directories (the `run.runs_root` of your config, `runs` by default)",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    table = Table(
        "run id",
        "config",
        "scheme",
        "status",
        "created",
        "checkpoints",
        "held-out reward (base -> last)",
        title=str(root),
    )
    for row in list_runs(root):
        damaged(row.damaged)
        if row.error is not None:  # one broken run hides no other
            table.add_row(row.run_id, f"[red]unreadable: {escape(row.error)[:80]}[/]", "", "", "", "", "")
            continue
        r = row.rewards
        reward = (
            f"{r[0].reward_mean:.4f} -> {r[-1].reward_mean:.4f}"
            if len(r) > 1
            else (f"{r[0].reward_mean:.4f}" if r else "")
        )
        table.add_row(
            row.run_id,
            row.config_name,
            escape(row.scheme),
            row.status,
            row.created,
            f"{row.checkpoints}/{max(row.iterations, row.checkpoints)}",  # an extended run: its own length
            reward,
        )
    shell.console.print(table)


def prune(
    run: RunArg,
    keep: Annotated[
        str | None,
        typer.Option(help="all, last or tables (default: the run's storage.keep).", metavar="all|last|tables"),
    ] = None,
    keep_last: Annotated[
        int | None, typer.Option(help="With --keep last: iterations that keep their latents.", metavar="N")
    ] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(help="Keep every N-th checkpoint's weights (0: all; default: the run's).", metavar="N")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go, remove nothing.", metavar="")] = False,
) -> None:
    """Remove the latents (and thinned checkpoints' weights) RUN's retention settings do not keep; say what it freed."""
    shell.call(_prune, run, keep, keep_last, checkpoint_every, dry_run)


def _prune(run: str, keep: str | None, keep_last: int | None, every: int | None, dry_run: bool) -> None:
    from stepgrpo.config import validate_config
    from stepgrpo.runs import apply_retention, owned, retention_plan, stored_config
    from stepgrpo.storage.run import Run, find_run

    path = find_run(run)
    with owned(path):
        r = Run.open(path)
        stored = stored_config(r).storage.model_dump()
        given = {"keep": keep, "keep_last": keep_last, "checkpoint_every": every}
        settings = validate_config({"storage": stored | {k: v for k, v in given.items() if v is not None}}).storage
        if dry_run:
            items = retention_plan(r, settings)
            for i, stage in items:
                shell.console.print(f"would prune iteration {i} {stage}")
            shell.console.print(f"{len(items)} stage(s) would be pruned")
            return
        why = (
            f"stepgrpo prune: keep={settings.keep}, keep_last={settings.keep_last}, "
            f"checkpoint_every={settings.checkpoint_every}"
        )
        report = apply_retention(r, settings, why)
    shell.console.print(f"run {r.run_id}: {report.describe()}")


def compare(
    runs: Annotated[list[str], typer.Argument(help="Run directories or run ids under runs/.", metavar="RUN")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write the chart here (PNG; needs matplotlib: stepgrpo\\[plots]).", metavar="FILE"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the curves as JSON.", metavar="")] = False,
    x: Annotated[
        str | None,
        typer.Option(
            "--x",
            help="The compute axis: passes, nfe or seconds (default: passes where every run has them).",
            metavar="AXIS",
        ),
    ] = None,
) -> None:
    """RUNS at equal compute: each evaluation's held-out reward against the training compute spent
    before it (forward + 2 x backward passes by default), one row a run read at the largest budget
    every run reached (its evaluation there, its paired gain over its base), beside its last; with
    --out, the chart, a colour a recipe."""
    shell.call(_compare, runs, out, as_json, x)


def _compare(runs: list[str], out: Path | None, as_json: bool, x: str | None = None) -> None:
    from stepgrpo.flows.api import compare
    from stepgrpo.reporting.compare import chart
    from stepgrpo.storage.run import Run, find_run

    found = compare(runs, x=x)
    axis, budget, curves, read = found["axis"], found["budget"], found["runs"], found["read"]
    if as_json:
        shell.console.print_json(json.dumps({"axis": axis, "budget": budget, "runs": curves}))
    else:
        table = Table(
            "run", "recipe", f"{axis} (last)", "held-out: base", "last",
            f"at equal {axis} ({budget:g}): evaluation", "reward", "paired gain [95 %]",
            title=f"at equal {axis}: every run read at its last evaluation within {budget:g}",
        )  # fmt: skip
        for c, p in zip(curves, read):
            first, last = c["points"][0], c["points"][-1]
            gain = "" if p is None or p["gain"] is None else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*p["gain"])
            row = [c["run_id"], c["recipe"], f"{last[axis]:g}", f"{first['reward_mean']:.4f}"]
            table.add_row(*row, f"{last['reward_mean']:.4f}", p["label"], f"{p['reward_mean']:.4f}", gain)
        shell.console.print(table)
    if out is not None:
        reward = (Run.open(find_run(runs[0])).config.get("reward") or {}).get("name", "reward")
        shell.console.print(f"chart: {chart(curves, out, reward, axis)}", highlight=False, soft_wrap=True)


def export(
    run: RunArg,
    push_to_hub: Annotated[
        str | None,
        typer.Option(
            "--push-to-hub", help="Upload the export to this hub model repository (owner/name).", metavar="OWNER/NAME"
        ),
    ] = None,
    private: Annotated[bool, typer.Option("--private", help="Make the hub repository private.", metavar="")] = False,
    iteration: Annotated[
        int | None, typer.Option(help="Export this kept checkpoint's weights (default: the last).", metavar="N")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the export here (an earlier --iteration's).", metavar="DIR")
    ] = None,
) -> None:
    """Write RUN's export again (lora/: weights, model card README.md, samples.png, config.yaml; the
    weights rebuilt if lora/ was deleted), or an earlier checkpoint's with --iteration N --out DIR; with
    --push-to-hub upload it (`huggingface_hub`; log in first with `hf auth login`)."""
    shell.call(_export, run, push_to_hub, private, iteration, out)


def _export(run: str, repo: str | None, private: bool, iteration: int | None, out: Path | None) -> None:
    from stepgrpo.flows.api import export

    folder = export(run, iteration=iteration, out=out, push_to_hub=repo, private=private)
    shell.console.print(f"export: {folder} (model card {folder / 'README.md'})", highlight=False, soft_wrap=True)
    if repo is not None:
        shell.console.print(f"uploaded to the hub repository {repo}", highlight=False, soft_wrap=True)
