"""`stepgrpo rescore`, `credit`, `credit-quality`, `evaluate`: commands on a stored run's trajectories
(no new rollout)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from stepgrpo_cli import shell
from stepgrpo_cli.shell import RunArg, SetOpt


def rescore(
    run: RunArg,
    reward: Annotated[
        str,
        typer.Option(
            help="Reward: a built-in name, an installed plug-in, or package.module:attribute.", metavar="NAME"
        ),
    ],
    options: Annotated[str | None, typer.Option(help="Reward options as JSON.", metavar="JSON")] = None,
    iteration: Annotated[
        list[int] | None,
        typer.Option("--iteration", help="Only these iterations (repeatable; default all).", metavar="N"),
    ] = None,
) -> None:
    """Score the stored trajectories of RUN with another reward (no transformer call)."""
    from stepgrpo.flows import api

    parsed = shell.options_json(options)
    scores = shell.call_offline(api.rescore, run, reward, options=parsed, iterations=iteration or None)
    table = Table("iteration", "reward", "version", "mean", "strict", "images", title=f"rescored {shell.where(run)}")
    for s in scores:
        table.add_row(
            str(s.iteration),
            s.reward_name,
            s.reward_version,
            f"{s.reward_mean:.4f}",
            shell.fmt(s.reward_strict),
            s.images,
        )
    shell.console.print(table)


def credit(
    run: RunArg,
    scheme: Annotated[
        str,
        typer.Option(
            help="Credit scheme (`stepgrpo config variants` lists them), a plug-in, or package.module:attribute.",
            metavar="NAME",
        ),
    ],
    options: Annotated[str | None, typer.Option(help="Scheme options as JSON.", metavar="JSON")] = None,
    reward: Annotated[
        str | None, typer.Option(help="Which stored reward to use (default: the run's).", metavar="NAME")
    ] = None,
) -> None:
    """Recompute the advantages of RUN with another scheme, from its stored rewards only."""
    from stepgrpo.flows import api

    parsed = shell.options_json(options)
    advantages = shell.call_offline(api.credit, run, scheme, options=parsed, reward=reward)
    table = Table(
        "iteration",
        "scheme",
        "adv std",
        "|adv| max",
        "zero-std groups",
        "turning points",
        title=f"credit {shell.where(run)}",
    )
    for a in advantages:
        table.add_row(
            str(a.iteration),
            a.scheme,
            f"{a.adv_std:.4f}",
            f"{a.adv_abs_max:.3f}",
            f"{a.zero_std_ratio:.2f}",
            str(a.turning_points),
        )
    shell.console.print(table)


def credit_quality(
    run: RunArg,
    iteration: Annotated[
        int | None, typer.Option(help="The stored iteration to judge (default: the latest scored one).", metavar="N")
    ] = None,
    continuations: Annotated[
        int,
        typer.Option(
            help="SDE continuations M per state (even: two halves measure the Monte-Carlo noise).", metavar="N"
        ),
    ] = 8,
    scheme: Annotated[
        list[str] | None,
        typer.Option(
            "--scheme", help="A scheme to judge (repeatable; default every registered scheme).", metavar="NAME"
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the continuations (recorded).", metavar="N")] = 0,
    method: Annotated[
        list[str] | None,
        typer.Option(
            "--method",
            help="A completion method whose step rewards are judged too, e.g. rollout, tweedie, substeps:2 "
            "(repeatable; default the run's own alone).",
            metavar="METHOD",
        ),
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Judge every credit scheme on a stored iteration of RUN against Monte-Carlo true advantages."""
    from stepgrpo.flows import api

    out = shell.call_flow(
        api.credit_quality,
        run,
        iteration=iteration,
        continuations=continuations,
        schemes=scheme or None,
        seed=seed,
        overrides=set_ or [],
        methods=method or None,
    )
    shell.console.print(quality_tables(out.result.record() | {"record": str(out.record), "run_dir": str(out.run_dir)}))


def quality_tables(out: dict[str, Any]) -> Any:
    """The check's two tables: per trained step, and the gradient check per scheme."""
    from rich.console import Group

    schemes = out["schemes"]
    steps = Table(
        "k",
        "A* var share",
        "rel A*",
        *[f"corr {s[:8]}" for s in schemes],
        "corr R,V",
        "var R/V",
        title=f"credit quality of {Path(out['run_dir']).name} iteration {out['iteration']}, M = {out['continuations']}",
    )
    for row in out["steps"]:
        steps.add_row(
            str(row["step"]),
            shell.fmt(row["share"], 2),
            shell.fmt(row["reliability"], 2),
            *[shell.fmt(row.get(f"corr/{s}"), 2) for s in schemes],
            shell.fmt(row["r_corr"], 2),
            # no corrected correlation: V has no readable within-group spread there (a group's
            # members share x_0 at step 0), so neither has the ratio
            shell.fmt(row["r_var_ratio"] if row["r_corr"] is not None else None, 1),
        )
    grad = Table(
        "scheme", "weights", "cosine", "95 % interval", "raw", "- outcome", "95 % interval", title="gradient check"
    )
    for label, check in out["gradient"].items():
        for row in check["rows"]:
            grad.add_row(
                row["scheme"],
                label,
                shell.fmt(row["cosine"], 3),
                f"[{shell.fmt(row['low'], 2)}, {shell.fmt(row['high'], 2)}]",
                shell.fmt(row["raw"], 3),
                shell.fmt(row.get("diff"), 3),
                f"[{shell.fmt(row.get('diff_low'), 2)}, {shell.fmt(row.get('diff_high'), 2)}]"
                if row.get("diff") is not None
                else "",
            )
    rel = ", ".join(f"{k} {shell.fmt(v['reliability'], 2)}" for k, v in out["gradient"].items())
    costs = "; ".join(f"{m} {c['nfe_per_trajectory']:.1f}" for m, c in (out.get("methods") or {}).items())
    notes = (
        f"reliability of G(A*): {rel}; {out['score_rows']} scored rows, {out['nfe']} NFEs, "
        f"{out['seconds']:.0f} s; record {out['record']}"
        + (f"; step rewards' NFEs a trajectory: {costs}" if costs else "")
    )
    return Group(steps, grad, *([f"skipped: {'; '.join(out['skipped'])}"] if out["skipped"] else []), notes)


def evaluate(
    run: RunArg,
    iteration: Annotated[
        int | None, typer.Option(help="Checkpoint iteration (default latest; -1 base model).", metavar="N")
    ] = None,
    set_: SetOpt = None,
    protocol: Annotated[
        str | None,
        typer.Option(
            help="A paper's evaluation protocol (`stepgrpo config variants` lists them; shapes on a CPU): its "
            "pinned prompts, samples, seeds, settings, scorer and aggregation, with an evidence bundle in the run's "
            "evidence/.",
            metavar="NAME",
        ),
    ] = None,
    images: Annotated[
        bool, typer.Option("--images", help="Keep the protocol's images in its evidence bundle.", metavar="")
    ] = False,
) -> None:
    """Held-out reward of RUN's policy and an image grid (--protocol: as a paper measures it)."""
    from stepgrpo.flows import api

    if protocol is not None:
        res = shell.call_offline(
            api.evaluate_protocol, run, protocol, iteration=iteration, overrides=list(set_ or []), images=images
        )
        r = res["report"]["results"]
        lines = [f"{protocol} ({res['report']['label']}): {r['headline']['name']} {r['headline']['value']:.4f}"]
        for task, t in (r.get("tasks") or {}).items():
            lines.append(f"  {task}: {t['accuracy']:.4f} ({t['images']} images)")
        for key in ("image_mean", "score_mean", "strict_mean"):
            if key in r:
                lines.append(f"  {key.replace('_', ' ')}: {r[key]:.4f}")
        lines.append(f"evidence: {res['bundle']} (stepgrpo inspect {shlex.quote(str(run))} --verify checks it)")
        shell.console.print("\n".join(lines))
        return
    out = shell.call_offline(api.evaluate, run, iteration=iteration, overrides=list(set_ or []))
    shell.console.print(
        f"held-out {out.reward_name} ({out.label}): {out.reward_mean:.4f}"
        + (f", strict {out.reward_strict:.4f}" if out.reward_strict is not None else "")
        + f"\nimages: {out.grid}"
    )
