"""`stepgrpo inspect RUN`: a run's iterations, stages, rewards, learning diagnostics, evaluations and
credit-quality checks (read by `stepgrpo.inspection`; this module only prints them), its JSON
(`--json`) and the check of every stored byte (`--verify`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stepgrpo_cli import shell
from stepgrpo_cli.shell import RunArg, damaged, fmt


def inspect(
    run: RunArg,
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every stored byte against its digests.", metavar="")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print the run as JSON: each iteration's NFEs and seconds per stage.", metavar=""),
    ] = False,
    images: Annotated[
        int | None,
        typer.Option(
            "--images", help="Write iteration K's training samples as a captioned grid (PNG); see --out.", metavar="K"
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Where --images writes (default: samples-iter_K.png).", metavar="FILE")
    ] = None,
) -> None:
    """A table of RUN's iterations: stages published and rewards (--verify: check all stored data;
    --images K: iteration K's training samples as a picture)."""
    if verify:
        shell.call(_verify, run)
        return
    if images is not None:
        shell.call(_images, run, images, out)
        return
    shell.call(_inspect_json if as_json else _inspect, run)


def _opened(run: str):  # noqa: ANN202
    from stepgrpo.storage.run import Run, find_run

    return Run.open(find_run(run))


def _images(run: str, iteration: int, out: Path | None) -> None:
    """Iteration `iteration`'s training samples, each with its prompt and reward, as one PNG."""
    from stepgrpo.images import captioned_grid, from_uint8
    from stepgrpo.inspection import training_images

    r = _opened(run)
    pictures, captions = training_images(r, iteration)
    path = out or Path(f"samples-{r.run_id}-iter_{iteration}.png")
    grid = captioned_grid(from_uint8(pictures.transpose(0, 2, 3, 1)), captions)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    shell.console.print(f"{len(captions)} training samples of iteration {iteration}: {path}", highlight=False)


def _inspect_json(run: str) -> None:
    """The run as JSON (`stepgrpo.inspection.run_json`), on stdout, for scripts."""
    from stepgrpo.inspection import run_json

    print(json.dumps(run_json(_opened(run)), indent=1))


def _verify(run: str) -> None:
    """Every published stage, table part, checkpoint and the prompts against their digests; exit 1 if any differs."""
    r = _opened(run)
    problems = r.verify_all()
    for what, error in problems:
        shell.err_console.print(f"[bold red]damaged:[/] {what}: {escape(error)}", highlight=False, soft_wrap=True)
    checked = r.stored_items()
    if problems:
        shell.err_console.print(
            f"{len(problems)} of {len(checked)} stored items do not verify; resume the run with "
            "`stepgrpo train` (same config) to recompute them, or restore them from a copy"
        )
        raise typer.Exit(1)
    shell.console.print(f"run {r.run_id}: {len(checked)} stored items verify")


def _inspect(run: str) -> None:
    from stepgrpo.inspection import evaluations, iteration_rows, quality_checks

    r = _opened(run)
    table = Table(
        "iteration",
        "rollout",
        "completions",
        "rewards (final-sample mean)",
        "advantages",
        "checkpoint",
        title=f"run {r.run_id}",
    )
    for row in iteration_rows(r):
        rollout = "-"
        if row.trajectories is not None:
            rollout = f"{row.trajectories} traj" + (" (pruned)" if row.rollout_pruned else "")
        table.add_row(
            str(row.iteration),
            rollout,
            ", ".join(c + (" (pruned)" if pruned else "") for c, pruned in row.completions) or "-",
            ", ".join(f"{n} v{v}: {m:.4f}" for n, v, m in row.rewards) or "-",
            ", ".join(row.schemes) or "-",
            row.checkpoint or "-",
        )
    shell.console.print(table)
    _diagnostics(r)
    evals, bad = evaluations(r)
    damaged(bad)
    for e in evals:
        shell.console.print(f"held-out reward {e.label}: {e.reward_mean:.4f}")
    checks, bad = quality_checks(r)
    damaged(bad)
    for c in checks:
        parts = []
        for row in c.rows:
            text = f"{row['scheme']} {fmt(row['cosine'], 3)}"
            if row.get("diff") is not None:
                text += f" ({row['diff']:+.3f} [{fmt(row.get('diff_low'), 2)}, {fmt(row.get('diff_high'), 2)}])"
            parts.append(text)
        shell.console.print(
            f"credit quality iter_{c.iteration} (M = {c.continuations}, {c.groups} groups): " + "; ".join(parts),
            soft_wrap=True,
        )


def _diagnostics(r) -> None:  # noqa: ANN001
    """The learning diagnostics of every trained iteration (the update's record, the run's reward)."""
    from stepgrpo.config import ConfigError
    from stepgrpo.inspection import diagnostics
    from stepgrpo.loops.workspace import reward_identity
    from stepgrpo.runs import stored_config
    from stepgrpo_core.registry import PluginError

    try:
        reward = reward_identity(stored_config(r).reward)["name"]
    except (ConfigError, PluginError) as err:  # e.g. a plug-in this command may not import: no reward columns
        shell.console.print(f"(reward columns left out: {escape(str(err))})", soft_wrap=True)
        reward = None
    rows, bad, warning = diagnostics(r, reward)
    damaged(bad)
    table = Table(
        "iter",
        "R SDE",
        "R ODE",
        "grp std",
        "0-std",
        "clip by opt. step",
        "clip later k:frac",
        "0-grad",
        "ratio sd",
        "signal",
        "signal 20 it.",
        "grad energy k:share",
        "|step|",
        "|LoRA-init|",
        title="learning diagnostics",
    )
    for row in rows:
        u, score = row.stats, row.score
        share = " ".join(f"{k}:{v:.2f}" for k, v in zip(u.trained_step_ids, u.grad_energy_share) if v is not None)
        later = " ".join(f"{k}:{v:.2f}" for k, v in zip(u.trained_step_ids, u.clip_frac_later_by_step) if v is not None)
        table.add_row(
            str(row.iteration),
            fmt(score.get("reward_mean")),
            fmt(score.get("ode_reward_mean")),
            fmt(score.get("group_reward_std")),
            fmt(score.get("zero_std_groups"), 2),
            "/".join(fmt(v, 2) for v in u.clip_frac_by_part)
            or f"{fmt(u.clip_frac_first, 3)}/{fmt(u.clip_frac_later, 3)}",
            later or "-",
            fmt(u.zero_grad_frac_later, 3),
            fmt(u.ratio_std, 5),
            fmt(u.signal_cosine, 3),
            fmt(u.signal_cosine_window, 3),
            share or "-",
            fmt(u.update_norm),
            fmt(u.lora_distance),
        )
    if table.row_count:
        # wide: a pipe or a log file would otherwise wrap every row into several lines
        (shell.console if shell.console.is_terminal else Console(width=200)).print(table)
        shell.console.print(
            "R SDE / R ODE: training reward of the SDE samples / of the ODE sample from the same prompt and noise; "
            "grp std: within-group std of R_T (0-std: groups with none); clip by opt. step: the share of rows whose "
            "PPO ratio left the clip range, at each optimizer step of the sampled batch (the first is on-policy: 0), "
            "and after the first per trained step k; 0-grad: the share of later rows the clip gives no gradient; "
            "ratio sd: the PPO ratio's spread; signal: cosine between the gradients of two halves of the batch, "
            "this iteration and summed over ~20 iterations (~0: noise); "
            "|step|: the update's size; |LoRA-init|: distance from the initial LoRA",
            soft_wrap=True,
        )
    if warning:
        shell.console.print(warning)
