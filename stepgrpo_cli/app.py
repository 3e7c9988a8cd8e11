"""The `stepgrpo` console script.

    stepgrpo train [--config F] [--set key=value ...] [--run-dir D] [--run-id ID]
    stepgrpo rescore RUN --reward NAME        # new reward rows, no sampling
    stepgrpo credit RUN --scheme NAME         # new advantages from stored rewards
    stepgrpo calibrate [--config F] ...       # DenseGRPO psi into a run
    stepgrpo evaluate RUN [--iteration K]
    stepgrpo pretrain ...                     # build the shipped shapes model
    stepgrpo reward-server --reward NAME      # serve a reward over HTTP (reward `http`)
    stepgrpo runs                             # the runs under runs/
    stepgrpo inspect RUN                      # iterations, stages published, rewards

Every command exits non-zero with a one-paragraph message when its input is wrong (unknown
field, reward, scheme or kernel; missing model; a run of another schema version).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    name="stepgrpo",
    help="GRPO fine-tuning of flow-matching text-to-image models with step-level credit, as a cached Prefect pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from stepgrpo import __version__

        console.print(f"stepgrpo {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    """Options of `stepgrpo` itself (the app's help text is `app`'s)."""


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: built-in defaults).")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a field: key=value (YAML value), repeatable.")
]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="The run directory (resumed if it exists).")]
RunIdOpt = Annotated[str | None, typer.Option("--run-id", help="Run id under run.runs_root (resumed if it exists).")]
RunArg = Annotated[str, typer.Argument(help="A run directory or a run id under runs/.")]


def _expected_errors() -> tuple[type[BaseException], ...]:
    from stepgrpo.config import ConfigError
    from stepgrpo.errors import StageError
    from stepgrpo_core.registry import UnknownNameError
    from storage.errors import StorageError

    return (ConfigError, StageError, StorageError, UnknownNameError, FileNotFoundError, ValueError, TypeError, KeyError)


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a flow; on failure print a clear message and exit 1."""
    try:
        from stepgrpo.runtime import environment

        environment.apply()  # the flows apply it again with their config's `scale.threads`
        return fn(*args, **kwargs)
    except _expected_errors() as err:
        err_console.print(
            f"[bold red]error:[/] {type(err).__name__}: {escape(str(err))}",
            highlight=False,
            markup=True,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None
    except Exception as err:  # an unexpected failure: still a message and a non-zero exit
        err_console.print(
            f"[bold red]failed:[/] {type(err).__name__}: {escape(str(err))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(1) from None


def _check_config(
    config: Path | None,
    overrides: list[str] | None,
    run_dir: Path | None,
    run_id: str | None,
    calibrated: bool = False,
) -> tuple[Path, Any]:
    """Everything checkable before a flow (and its Prefect server) starts; returns the run
    directory and the resolved config."""
    from stepgrpo.checks import check_config
    from stepgrpo.config import load_config
    from stepgrpo.runs import check_resumable, resolve_run_dir

    cfg = load_config(config, overrides or [])
    check_config(cfg, calibrated=calibrated)
    path = resolve_run_dir(cfg, str(run_dir) if run_dir else None, run_id)
    check_resumable(cfg, path)
    return path, cfg


def _check_run(
    run: str,
    reward: str | None = None,
    reward_options: dict[str, Any] | None = None,
    scheme: str | None = None,
    scheme_options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    rescore_iterations: list[int] | str | None = None,
) -> Path:
    """Check this command's names and options, then open the run (manifest and schema version
    checked) and its stored config as data (`stepgrpo.runs.open_stored`); with `rescore_iterations`
    (a list, or "all"), that a re-score finds their latents; for a re-score or a re-credit, that
    the run has rollouts. All before any server starts."""
    from stepgrpo.checks import check_model
    from stepgrpo.errors import StageError
    from stepgrpo.runs import open_stored
    from stepgrpo_core.registry import allow, references_in
    from storage.run import Run, find_run

    allow(*references_in([reward, reward_options, scheme]))  # this command's own names may be imported
    replace: dict[str, Any] = {}
    if reward is not None:
        from stepgrpo.rewards import REWARDS, reward_identity

        REWARDS.validate(reward)
        try:
            reward_identity({"name": reward, "options": reward_options or {}})
        except TypeError as err:
            raise StageError(f"--options: {err}") from None
        replace["reward"] = {"name": reward, "options": reward_options or {}}
    if scheme is not None:
        from stepgrpo_core.credit import SCHEMES, check_options

        SCHEMES.validate(scheme)
        try:
            check_options(scheme, scheme_options or {})
        except ValueError as err:
            raise StageError(f"--options: {err}") from None
        replace["credit"] = {"scheme": scheme, "options": scheme_options or {}}
    path = find_run(run)
    if scheme is not None and SCHEMES.facts(scheme)["step_rewards"]:
        method = (Run.open(path).config.get("completion") or {}).get("method", "remaining")
        if method is None:
            final_only = [s for s in SCHEMES.names() if not SCHEMES.facts(s)["step_rewards"]]
            raise StageError(
                f"scheme {scheme!r} needs step rewards (the reward of every intermediate state's completion), but "
                f"run {path.name} scored only its final samples (completion.method: null); on this run use "
                f"{', '.join(final_only)}, or train a run with completion.method remaining / substeps:N"
            )
    stored, cfg = open_stored(path, overrides or [], replace)
    if overrides:
        from stepgrpo.policy.devices import check_device

        try:
            check_device(cfg.model.device)
        except ValueError as err:
            raise StageError(str(err)) from None
        check_model(cfg.model.path)
    if reward is not None or scheme is not None:
        from stepgrpo.runs import stored_iterations

        stored_iterations(stored)  # a run without a published rollout has nothing to re-score or re-credit
    if rescore_iterations is not None:
        from stepgrpo.runs import check_rescorable

        todo = stored.iterations("rollout") if rescore_iterations == "all" else rescore_iterations
        check_rescorable(stored, cfg.completion.method, todo)
    return path


def _check_checkpoint(path: Path, iteration: int | None) -> None:
    """An evaluation's checkpoint is there (None: the latest; -1: the base model, always)."""
    from stepgrpo.errors import StageError
    from stepgrpo.runs import latest_checkpoint
    from storage.run import Run

    run = Run.open(path)
    if iteration is None:
        latest_checkpoint(run)
    elif iteration >= 0 and run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"run {run.run_id} has no checkpoint of iteration {iteration}; see `stepgrpo inspect`")


def _owned(path: Path, flow: Any, **kwargs: Any) -> Any:
    """Run `flow` holding the run's lock (taken here, before its Prefect server starts). Whatever
    ends this process, what it starts ends with it (`stepgrpo.runtime.reaper`; SIGTERM is an orderly exit
    that stops Prefect's temporary server)."""
    import signal

    from stepgrpo.runs import owned
    from stepgrpo.runtime import reaper

    reaper.start()
    signal.signal(signal.SIGTERM, _terminated)
    with owned(path):
        return flow(**kwargs)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@app.command()
def train(config: ConfigOpt = None, set_: SetOpt = None, run_dir: RunDirOpt = None, run_id: RunIdOpt = None) -> None:
    """Train: iterations of rollout -> complete -> score -> credit -> update, evaluated before and after."""
    path, cfg = _run(_check_config, config, set_, run_dir, run_id)
    from flows.train import train as train_flow

    out = _run(_owned, path, train_flow, config=cfg, run_dir=str(path))
    from stepgrpo.reporting.report import print_summary

    print_summary(Path(out["run_dir"]), out["tracking_uri"], out["evaluations"])


config_app = typer.Typer(help="The config: every field, its value and description.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved config (--config, then --set) as YAML, each field under its description."""
    from stepgrpo.config import describe, load_config

    cfg = _run(load_config, config, set_ or [])
    print(describe(cfg))


@app.command()
def deploy(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config: the run form's defaults.")],
    set_: SetOpt = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: the config file's stem).")] = None,
    pool: Annotated[str, typer.Option(help="Prefect work pool (a process pool).")] = "stepgrpo",
    flow: Annotated[str, typer.Option(help="The flow: train or calibrate.")] = "train",
) -> None:
    """Register a train (or calibrate) deployment whose run form holds CONFIG's values (needs PREFECT_API_URL)."""
    from stepgrpo.config import load_config

    cfg = _run(load_config, config, set_ or [])
    if not os.environ.get("PREFECT_API_URL"):
        err_console.print(
            "[bold red]error:[/] a deployment lives on a Prefect server: start one (`prefect server start`) and "
            "set PREFECT_API_URL (docs/PIPELINE.md)"
        )
        raise typer.Exit(1)
    from stepgrpo_cli.deployments import deploy_flow

    deployment = _run(deploy_flow, cfg, name or config.stem, pool, str(config), flow)
    console.print(f"deployment {flow}/{name or config.stem} ({deployment}) on pool {pool}: its run form holds {config}")


@app.command()
def rescore(
    run: RunArg,
    reward: Annotated[
        str, typer.Option(help="Reward: a built-in name, an installed plug-in, or package.module:attribute.")
    ],
    options: Annotated[str | None, typer.Option(help="Reward options as JSON.")] = None,
    iteration: Annotated[
        list[int] | None, typer.Option("--iteration", help="Only these iterations (repeatable; default all).")
    ] = None,
) -> None:
    """Score the stored trajectories of RUN with another reward (no transformer call)."""
    parsed = _json(options)
    path = _run(_check_run, run, reward=reward, reward_options=parsed, rescore_iterations=iteration or "all")
    from flows.rescore import rescore as rescore_flow

    out = _run(
        _owned, path, rescore_flow, run=str(path), reward=reward, reward_options=parsed, iterations=iteration or None
    )
    table = Table("iteration", "reward", "version", "mean", "strict", "images", title=f"rescored {out['run_dir']}")
    for s in out["scores"]:
        table.add_row(
            str(s["iteration"]),
            s["reward_name"],
            s["reward_version"],
            f"{s['reward_mean']:.4f}",
            _fmt(s.get("reward_strict")),
            s["images"],
        )
    console.print(table)


@app.command()
def credit(
    run: RunArg,
    scheme: Annotated[
        str,
        typer.Option(
            help="Credit scheme (outcome, stepwise, dense, turning_point), a plug-in, or package.module:attribute."
        ),
    ],
    options: Annotated[str | None, typer.Option(help="Scheme options as JSON.")] = None,
    reward: Annotated[str | None, typer.Option(help="Which stored reward to use (default: the run's).")] = None,
) -> None:
    """Recompute the advantages of RUN with another scheme, from its stored rewards only."""
    parsed = _json(options)
    path = _run(_check_run, run, scheme=scheme, scheme_options=parsed)
    from flows.credit import credit as credit_flow

    out = _run(_owned, path, credit_flow, run=str(path), scheme=scheme, options=parsed, reward=reward)
    table = Table(
        "iteration",
        "scheme",
        "adv std",
        "|adv| max",
        "zero-std groups",
        "turning points",
        title=f"credit {out['run_dir']}",
    )
    for a in out["advantages"]:
        table.add_row(
            str(a["iteration"]),
            a["scheme"],
            f"{a['adv_std']:.4f}",
            f"{a['adv_abs_max']:.3f}",
            f"{a['zero_std_ratio']:.2f}",
            str(a["turning_points"]),
        )
    console.print(table)


@app.command("credit-quality")
def credit_quality(
    run: RunArg,
    iteration: Annotated[
        int | None, typer.Option(help="The stored iteration to judge (default: the latest scored one).")
    ] = None,
    continuations: Annotated[
        int, typer.Option(help="SDE continuations M per state (even: two halves measure the Monte-Carlo noise).")
    ] = 8,
    scheme: Annotated[
        list[str] | None,
        typer.Option("--scheme", help="A scheme to judge (repeatable; default every registered scheme)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the continuations (recorded).")] = 0,
    set_: SetOpt = None,
) -> None:
    """Judge every credit scheme on a stored iteration of RUN against Monte-Carlo true advantages."""
    path = _run(_check_quality, run, iteration, continuations, scheme or [], set_ or [])
    from flows.quality import credit_quality as quality_flow

    out = _run(
        _owned,
        path,
        quality_flow,
        run=str(path),
        iteration=iteration,
        continuations=continuations,
        schemes=scheme or None,
        seed=seed,
        overrides=set_ or None,
    )
    console.print(quality_tables(out))


def _check_quality(
    run: str, iteration: int | None, continuations: int, schemes: list[str], overrides: list[str]
) -> Path:
    """The check's inputs, before any server starts: its schemes, the run, the iteration's rollout."""
    from stepgrpo.errors import StageError
    from stepgrpo_core.registry import allow
    from storage.run import Run
    from tasks.quality import check_continuations, schemes_to_judge

    check_continuations(continuations)

    allow(*schemes)
    schemes_to_judge(schemes)
    path = _check_run(run, overrides=overrides)
    done = Run.open(path).iterations("rollout")
    if not done:
        raise StageError(f"run {path.name} has no published rollout yet: nothing to judge")
    if iteration is not None and iteration not in done:
        raise StageError(f"run {path.name} has no published rollout at iteration {iteration}; stored: {done}")
    return path


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
            _fmt(row["share"], 2),
            _fmt(row["reliability"], 2),
            *[_fmt(row.get(f"corr/{s}"), 2) for s in schemes],
            _fmt(row["r_corr"], 2),
            # no corrected correlation: V has no readable within-group spread there (a group's
            # members share x_0 at step 0), so neither has the ratio
            _fmt(row["r_var_ratio"] if row["r_corr"] is not None else None, 1),
        )
    grad = Table(
        "scheme", "weights", "cosine", "95 % interval", "raw", "- outcome", "95 % interval", title="gradient check"
    )
    for label, check in out["gradient"].items():
        for row in check["rows"]:
            grad.add_row(
                row["scheme"],
                label,
                _fmt(row["cosine"], 3),
                f"[{_fmt(row['low'], 2)}, {_fmt(row['high'], 2)}]",
                _fmt(row["raw"], 3),
                _fmt(row.get("diff"), 3),
                f"[{_fmt(row.get('diff_low'), 2)}, {_fmt(row.get('diff_high'), 2)}]"
                if row.get("diff") is not None
                else "",
            )
    rel = ", ".join(f"{k} {_fmt(v['reliability'], 2)}" for k, v in out["gradient"].items())
    notes = (
        f"reliability of G(A*): {rel}; {out['score_rows']} scored rows, {out['nfe']} NFEs, "
        f"{out['seconds']:.0f} s; record {out['record']}"
    )
    return Group(steps, grad, *([f"skipped: {'; '.join(out['skipped'])}"] if out["skipped"] else []), notes)


@app.command()
def calibrate(
    config: ConfigOpt = None, set_: SetOpt = None, run_dir: RunDirOpt = None, run_id: RunIdOpt = None
) -> None:
    """DenseGRPO psi calibration into a run (then `train` with the same config and run id)."""
    path, cfg = _run(_check_config, config, set_, run_dir, run_id, calibrated=True)
    from flows.calibrate import calibrate as calibrate_flow

    out = _run(_owned, path, calibrate_flow, config=cfg, run_dir=str(path))
    console.print(f"psi: {[round(p, 4) for p in out['psi']]}\nrun directory: {out['run_dir']}")


@app.command()
def evaluate(
    run: RunArg,
    iteration: Annotated[int | None, typer.Option(help="Checkpoint iteration (default latest; -1 base model).")] = None,
    set_: SetOpt = None,
) -> None:
    """Held-out reward of RUN's policy and an image grid."""
    path = _run(_check_run, run, overrides=list(set_ or []))
    _run(_check_checkpoint, path, iteration)
    from flows.evaluate import evaluate as evaluate_flow

    out = _run(_owned, path, evaluate_flow, run=str(path), iteration=iteration, overrides=list(set_ or []))
    console.print(
        f"held-out {out['reward_name']} ({out['label']}): {out['reward_mean']:.4f}"
        + (f", strict {out['reward_strict']:.4f}" if "reward_strict" in out else "")
        + f"\nimages: {out['grid']}"
    )


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def pretrain(ctx: typer.Context) -> None:
    """Pretrain the shipped `shapes` model into a new directory (`stepgrpo pretrain --help`: the options)."""
    from stepgrpo.pretraining.pretrain import main

    _run(main, list(ctx.args))


@app.command("reward-server")
def reward_server(
    reward: Annotated[str, typer.Option(help="A registered reward or a `name:weight,...` sum.")],
    options: Annotated[str, typer.Option(help="The reward's options as JSON.")] = "{}",
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
) -> None:
    """Serve REWARD over HTTP for the `http` reward of runs elsewhere (stepgrpo.rewards.remote)."""
    from stepgrpo.rewards import build_reward
    from stepgrpo.rewards.remote import serve
    from stepgrpo_core.registry import allow, references_in

    try:
        parsed = json.loads(options)
        allow(*references_in([reward, parsed]))  # this command's own reward (or a weighted sum's parts)
        built = build_reward({"name": reward, "options": parsed} if parsed else reward)
        server = serve(built, host, port)
    except (ValueError, TypeError, KeyError, OSError) as err:
        err_console.print(f"error: {escape(str(err))}")
        raise typer.Exit(1) from None
    console.print(f"serving {built.name} v{built.version} on http://{host}:{server.server_port} (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.server_close()


@app.command()
def runs(root: Annotated[Path, typer.Option(help="Directory holding run directories.")] = Path("runs")) -> None:
    """List the runs under ROOT."""
    from storage.errors import StorageError
    from storage.publish import read_json

    table = Table(
        "run id", "config", "created", "iterations", "checkpoints", "held-out reward (base -> last)", title=str(root)
    )
    for path in sorted(p for p in root.glob("*") if (p / "manifest.json").is_file()):
        try:
            m = read_json(path / "manifest.json", "run manifest")
            iters = [d for d in path.glob("iter_*") if (d / "rollout.zarr" / "_published.json").is_file()]
            ckpts = [d for d in (path / "checkpoints").glob("iter_*") if (d / "_published.json").is_file()]
            evals = _evals(path)
        except (OSError, ValueError, KeyError, TypeError, StorageError) as err:  # one broken run hides no other
            table.add_row(path.name, f"[red]unreadable: {escape(str(err))[:80]}[/]", "", "", "", "")
            continue
        reward = (
            f"{evals[0][1]:.4f} -> {evals[-1][1]:.4f}" if len(evals) > 1 else (f"{evals[0][1]:.4f}" if evals else "")
        )
        table.add_row(
            path.name,
            str(m.get("config", {}).get("run", {}).get("name", "")),
            str(m.get("created_at", "")),
            str(len(iters)),
            str(len(ckpts)),
            reward,
        )
    console.print(table)


@app.command()
def prune(
    run: RunArg,
    keep: Annotated[str | None, typer.Option(help="all, last or tables (default: the run's storage.keep).")] = None,
    keep_last: Annotated[int | None, typer.Option(help="With --keep last: iterations that keep their latents.")] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(help="Keep every N-th checkpoint's weights (0: all; default: the run's).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go, remove nothing.")] = False,
) -> None:
    """Remove the latents (and thinned checkpoints' weights) RUN's retention settings do not keep; say what it freed."""
    _run(_prune, run, keep, keep_last, checkpoint_every, dry_run)


def _prune(run: str, keep: str | None, keep_last: int | None, every: int | None, dry_run: bool) -> None:
    from stepgrpo.config import validate_config
    from stepgrpo.runs import apply_retention, owned, retention_plan, stored_config
    from storage.run import Run, find_run

    path = find_run(run)
    with owned(path):
        r = Run.open(path)
        stored = stored_config(r).storage.model_dump()
        given = {"keep": keep, "keep_last": keep_last, "checkpoint_every": every}
        settings = validate_config({"storage": stored | {k: v for k, v in given.items() if v is not None}}).storage
        if dry_run:
            items = retention_plan(r, settings)
            for i, stage in items:
                console.print(f"would prune iteration {i} {stage}")
            console.print(f"{len(items)} stage(s) would be pruned")
            return
        why = (
            f"stepgrpo prune: keep={settings.keep}, keep_last={settings.keep_last}, "
            f"checkpoint_every={settings.checkpoint_every}"
        )
        report = apply_retention(r, settings, why)
    console.print(f"run {r.run_id}: {report.describe()}")


@app.command()
def inspect(
    run: RunArg,
    verify: Annotated[bool, typer.Option("--verify", help="Check every stored byte against its digests.")] = False,
) -> None:
    """A table of RUN's iterations: stages published and rewards (--verify: check all stored data)."""
    if verify:
        _run(_verify, run)
        return
    _run(_inspect, run)


def _verify(run: str) -> None:
    """Every published stage, table part, checkpoint and the prompts against their digests; exit 1 if any differs."""
    from storage.run import Run, find_run

    r = Run.open(find_run(run))
    problems = r.verify_all()
    for what, error in problems:
        err_console.print(f"[bold red]damaged:[/] {what}: {escape(error)}", highlight=False, soft_wrap=True)
    checked = r.stored_items()
    if problems:
        err_console.print(
            f"{len(problems)} of {len(checked)} stored items do not verify; resume the run with "
            "`stepgrpo train` (same config) to recompute them, or restore them from a copy"
        )
        raise typer.Exit(1)
    console.print(f"run {r.run_id}: {len(checked)} stored items verify")


def _inspect(run: str) -> None:
    from storage.run import Run, find_run

    r = Run.open(find_run(run))
    rewards = r.tables.read_rewards().to_pandas() if (r.path / "rewards").is_dir() else None
    advantages = r.tables.read_advantages().to_pandas() if (r.path / "advantages").is_dir() else None
    table = Table(
        "iteration",
        "rollout",
        "completions",
        "rewards (final-sample mean)",
        "advantages",
        "checkpoint",
        title=f"run {r.run_id}",
    )
    iters = sorted(set(r.iterations("rollout")) | set(r.iterations("checkpoint")))
    for i in iters:
        comps = sorted(
            p.stem for p in (r.path / f"iter_{i}" / "completions").glob("*.zarr") if (p / "_published.json").is_file()
        )
        rew = ""
        if rewards is not None:
            sel = rewards[rewards.iteration == i]
            final = sel[sel.k == sel.k.max()] if len(sel) else sel
            rew = ", ".join(
                f"{n} v{v}: {g.value.mean():.4f}" for (n, v), g in final.groupby(["reward_name", "reward_version"])
            )
        adv = ""
        if advantages is not None:
            adv = ", ".join(sorted(set(advantages[advantages.iteration == i].scheme)))
        rollout = r.stage_manifest(i, "rollout")
        table.add_row(
            str(i),
            (f"{rollout['counts']['trajectories']} traj" + (" (pruned)" if r.pruned(i, "rollout") else ""))
            if rollout
            else "-",
            ", ".join(c + (" (pruned)" if r.pruned(i, f"completions/{c}") else "") for c in comps) or "-",
            rew or "-",
            adv or "-",
            ("thinned" if r.pruned(i, "checkpoint") else "yes") if r.stage_manifest(i, "checkpoint") else "-",
        )
    console.print(table)
    _diagnostics(r, iters)
    for label, value in _evals(r.path):
        console.print(f"held-out reward {label}: {value:.4f}")
    _quality_checks(r)


def _quality_checks(r: Any) -> None:
    """One line per stored credit-quality check: each scheme's corrected gradient cosine, and its
    paired difference to outcome with the 95 % interval (`stepgrpo credit-quality`)."""
    from storage.errors import StorageError
    from storage.publish import read_json
    from tasks.quality import QUALITY_DIR

    for path in sorted((r.path / QUALITY_DIR).glob("iter_*.json")):
        try:
            c = read_json(path, "credit-quality record")
            rows = c["gradient"]["uniform"]["rows"]
        except (StorageError, KeyError, TypeError) as err:
            err_console.print(f"[bold red]damaged:[/] {escape(str(path))}: {escape(str(err))}", soft_wrap=True)
            continue
        parts = []
        for row in rows:
            text = f"{row['scheme']} {_fmt(row['cosine'], 3)}"
            if row.get("diff") is not None:
                text += f" ({row['diff']:+.3f} [{_fmt(row.get('diff_low'), 2)}, {_fmt(row.get('diff_high'), 2)}])"
            parts.append(text)
        console.print(
            f"credit quality iter_{c['iteration']} (M = {c['continuations']}, {c['groups']} groups): "
            + "; ".join(parts),
            soft_wrap=True,
        )


def _diagnostics(r: Any, iters: list[int]) -> None:
    """The learning diagnostics of every trained iteration (the update's record, the run's reward)."""
    import torch
    from pydantic import ValidationError

    from stepgrpo.config import ConfigError
    from stepgrpo.loops.scoring import reward_summary
    from stepgrpo.loops.workspace import reward_identity
    from stepgrpo.reporting.report import SignalWatch
    from stepgrpo.results import UpdateStats
    from stepgrpo.runs import stored_config
    from stepgrpo_core.registry import PluginError
    from storage.errors import StorageError
    from storage.publish import read_json

    try:
        reward = reward_identity(stored_config(r).reward)["name"]
    except (ConfigError, PluginError) as err:  # e.g. a plug-in this command may not import: no reward columns
        console.print(f"(reward columns left out: {escape(str(err))})", soft_wrap=True)
        reward = None
    table = Table(
        "iter",
        "R SDE",
        "R ODE",
        "grp std",
        "0-std",
        "clip 1st/later",
        "0-grad",
        "ratio sd",
        "signal",
        "signal 20 it.",
        "grad energy k:share",
        "|step|",
        "|LoRA-init|",
        title="learning diagnostics",
    )
    watch, warning = SignalWatch(), None
    for i in iters:
        state = r.stage_path(i, "checkpoint") / "state.json"
        if not state.is_file():
            continue
        try:
            u = UpdateStats.model_validate(read_json(state, "checkpoint state")["update"])
        except (StorageError, KeyError, TypeError, ValidationError) as err:
            err_console.print(f"[bold red]damaged:[/] {escape(str(state))}: {escape(str(err))}", soft_wrap=True)
            continue
        score: dict[str, Any] = {}
        names = (
            set(r.tables.read_rewards(i).column("reward_name").to_pylist()) if r.stage_manifest(i, "rollout") else set()
        )
        if reward in names:
            groups = torch.from_numpy(r.stages.read_array(i, "rollout", "group_ids")).long()
            score = reward_summary(
                r.tables.reward_grid(i, reward), r.tables.reward_grid(i, reward, field="strict"), groups
            )
        share = " ".join(f"{k}:{v:.2f}" for k, v in zip(u.trained_step_ids, u.grad_energy_share) if v is not None)
        table.add_row(
            str(i),
            _fmt(score.get("reward_mean")),
            _fmt(score.get("ode_reward_mean")),
            _fmt(score.get("group_reward_std")),
            _fmt(score.get("zero_std_groups"), 2),
            f"{_fmt(u.clip_frac_first, 3)}/{_fmt(u.clip_frac_later, 3)}",
            _fmt(u.zero_grad_frac_later, 3),
            _fmt(u.ratio_std, 5),
            _fmt(u.signal_cosine, 3),
            _fmt(u.signal_cosine_window, 3),
            share or "-",
            _fmt(u.update_norm),
            _fmt(u.lora_distance),
        )
        warning = warning or watch.see(i, u)
    if table.row_count:
        # wide: a pipe or a log file would otherwise wrap every row into several lines
        (console if console.is_terminal else Console(width=160)).print(table)
        console.print(
            "R SDE / R ODE: training reward of the SDE samples / of the ODE sample from the same prompt and noise; "
            "grp std: within-group std of R_T (0-std: groups with none); clip, 0-grad (later steps), ratio sd: "
            "the PPO ratio; signal: cosine between the gradients of two halves of the batch, this iteration "
            "and summed over ~20 iterations (~0: noise); "
            "|step|: the update's size; |LoRA-init|: distance from the initial LoRA",
            soft_wrap=True,
        )
    if warning:
        console.print(warning)


def _evals(path: Path) -> list[tuple[str, float]]:
    """The run's held-out evaluations at its own settings, `(label, reward)`, oldest first; a damaged
    record is named on stderr and left out."""
    from storage.errors import StorageError
    from storage.publish import read_json

    out = []
    for f in (path / "eval").glob("*.json"):
        try:
            e = read_json(f, "evaluation record")
            label, value = e["label"], float(e["reward_mean"])
            order = -1 if label == "base" else int(label.removeprefix("iter_"))
        except (StorageError, KeyError, TypeError, ValueError, AttributeError) as err:
            err_console.print(f"[bold red]damaged:[/] {escape(str(f))}: {escape(str(err))}", soft_wrap=True)
            continue
        if f.stem != label:
            continue  # an evaluation with other settings than the run's (`evaluate --set ...`)
        out.append((label, value, order))
    return [(label, value) for label, value, _ in sorted(out, key=lambda x: x[2])]


def _json(text: str | None) -> dict[str, Any] | None:
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


def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
