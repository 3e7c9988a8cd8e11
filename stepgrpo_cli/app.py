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
    stepgrpo server start|stop|status         # a Prefect server kept for the commands above

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


# Commands that run a flow, so talk to a Prefect server: a kept one if there is (`stepgrpo server`).
FLOW_COMMANDS = {"train", "rescore", "credit", "credit-quality", "calibrate", "evaluate", "deploy"}


@app.callback()
def _options(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version)
    ] = False,
) -> None:
    """Options of `stepgrpo` itself (the app's help text is `app`'s)."""
    if ctx.invoked_subcommand in FLOW_COMMANDS:
        from stepgrpo.runtime import server

        if (url := server.use_kept()) is not None:  # before anything imports Prefect
            err_console.print(f"[dim]Prefect server: {url} (kept; `stepgrpo server stop` ends it)[/]", highlight=False)
        elif not os.environ.get("PREFECT_API_URL") and err_console.is_terminal:
            err_console.print(
                "[dim]Prefect server: a temporary one for this command (`stepgrpo server start` keeps one running)[/]",
                highlight=False,
            )


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
    from stepgrpo.storage.errors import StorageError
    from stepgrpo_core.registry import UnknownNameError

    return (ConfigError, StageError, StorageError, UnknownNameError, FileNotFoundError, ValueError, TypeError, KeyError)


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a flow; on failure print a clear message and exit 1."""
    try:
        from stepgrpo.runtime import environment

        environment.apply()  # the flows apply it again with their config's `scale.threads`
        return fn(*args, **kwargs)
    except _expected_errors() as err:
        _failed("error", err)
    except Exception as err:  # an unexpected failure: still a message and a non-zero exit
        _failed("failed", err)


def _failed(label: str, err: BaseException) -> None:
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


def _command(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a command that runs a flow (`stepgrpo.flows.api`), as `_run` does. Whatever ends this
    process, what it starts ends with it (`stepgrpo.runtime.reaper`; SIGTERM is an orderly exit
    that stops Prefect's temporary server)."""
    import signal

    from stepgrpo.flows import session
    from stepgrpo.reporting.live import VERBOSE_ENV
    from stepgrpo.runtime import reaper

    # a failure reaches the console as one line (`_failed`), not as Prefect's tracebacks
    session.QUIET_FAILURES = os.environ.get(VERBOSE_ENV) != "1"
    reaper.start()
    signal.signal(signal.SIGTERM, _terminated)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores it
        signal.signal(signal.SIGINT, _terminated)
    session.OWN_TEMPORARY_SERVER = True
    return _run(fn, *args, **kwargs)


def _offline_command(fn: Any, run: str, *args: Any, **kwargs: Any) -> Any:
    """An offline command on `run` (`rescore`, `credit`, `evaluate`), as `_command` runs it; the
    helper that writes its MLflow run starts first, so that it imports MLflow while this process
    imports torch and Prefect (`stepgrpo.reporting.offline`)."""
    from stepgrpo.reporting import offline

    with offline.helper(run):
        return _command(fn, run, *args, **kwargs)


def _resume_command(path: Path) -> str:
    """This `stepgrpo train` command line, naming the run it made or resumed (by `--run-id`
    unless the line names it already)."""
    import shlex

    args, named = sys.argv[1:], False
    for flag in ("--run-id", "--run-dir"):
        named = named or any(a == flag or a.startswith(f"{flag}=") for a in args)
    program = sys.argv[0] if Path(sys.argv[0]).name == "stepgrpo" else "stepgrpo"
    return shlex.join([program, *args, *([] if named else ["--run-id", path.name])])


def _terminated(signum: int, frame: Any) -> None:
    """SIGINT (Ctrl-C) and SIGTERM: noted (`session.INTERRUPTED`), then a KeyboardInterrupt."""
    from stepgrpo.flows import session

    session.INTERRUPTED = True
    raise KeyboardInterrupt(f"signal {signum}")


@app.command()
def train(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    run_id: RunIdOpt = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Prefect's run lines and a failure's traceback on the console too."),
    ] = False,
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
        out = _command(api.train, config, overrides=set_ or [], run_dir=run_dir, run_id=run_id)
    except api.Interrupted as stopped:
        err_console.print(
            "interrupted; the run keeps every stage it finished. Resume it with:\n  "
            + _resume_command(stopped.run_dir),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    print_summary(out.run_dir, out.tracking_uri, [e.record() for e in out.evaluations])


@app.command()
def demo(
    set_: SetOpt = None,
    run_id: RunIdOpt = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Prefect's run lines and a failure's traceback on the console too."),
    ] = False,
) -> None:
    """The CPU demo: the shipped shapes model learns its reward with Flow-GRPO (the shipped `demo`
    config: 100 iterations, a few minutes), then the base and trained held-out rewards."""
    from stepgrpo.paths import SHIPPED_CONFIGS

    train(config=SHIPPED_CONFIGS / "demo.yaml", set_=set_, run_dir=None, run_id=run_id, verbose=verbose)


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
            "[bold red]error:[/] a deployment lives on a Prefect server: start one (`stepgrpo server start`, or "
            "`prefect server start` and set PREFECT_API_URL; docs/PIPELINE.md)"
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
    from stepgrpo.flows import api

    parsed = _json(options)
    scores = _offline_command(api.rescore, run, reward, options=parsed, iterations=iteration or None)
    table = Table("iteration", "reward", "version", "mean", "strict", "images", title=f"rescored {_where(run)}")
    for s in scores:
        table.add_row(
            str(s.iteration),
            s.reward_name,
            s.reward_version,
            f"{s.reward_mean:.4f}",
            _fmt(s.reward_strict),
            s.images,
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
    from stepgrpo.flows import api

    parsed = _json(options)
    advantages = _offline_command(api.credit, run, scheme, options=parsed, reward=reward)
    table = Table(
        "iteration",
        "scheme",
        "adv std",
        "|adv| max",
        "zero-std groups",
        "turning points",
        title=f"credit {_where(run)}",
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
    method: Annotated[
        list[str] | None,
        typer.Option(
            "--method",
            help="A completion method whose step rewards are judged too, e.g. rollout, tweedie, substeps:2 "
            "(repeatable; default the run's own alone).",
        ),
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Judge every credit scheme on a stored iteration of RUN against Monte-Carlo true advantages."""
    from stepgrpo.flows import api

    out = _command(
        api.credit_quality,
        run,
        iteration=iteration,
        continuations=continuations,
        schemes=scheme or None,
        seed=seed,
        overrides=set_ or [],
        methods=method or None,
    )
    console.print(quality_tables(out.result.record() | {"record": str(out.record), "run_dir": str(out.run_dir)}))


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
    costs = "; ".join(f"{m} {c['nfe_per_trajectory']:.1f}" for m, c in (out.get("methods") or {}).items())
    notes = (
        f"reliability of G(A*): {rel}; {out['score_rows']} scored rows, {out['nfe']} NFEs, "
        f"{out['seconds']:.0f} s; record {out['record']}"
        + (f"; step rewards' NFEs a trajectory: {costs}" if costs else "")
    )
    return Group(steps, grad, *([f"skipped: {'; '.join(out['skipped'])}"] if out["skipped"] else []), notes)


@app.command()
def calibrate(
    config: ConfigOpt = None, set_: SetOpt = None, run_dir: RunDirOpt = None, run_id: RunIdOpt = None
) -> None:
    """DenseGRPO psi calibration into a run (then `train` with the same config and run id)."""
    from stepgrpo.flows import api

    psi, path = _command(api.calibrate, config, overrides=set_ or [], run_dir=run_dir, run_id=run_id)
    console.print(f"psi: {[round(p, 4) for p in psi]}\nrun directory: {path}")


@app.command()
def evaluate(
    run: RunArg,
    iteration: Annotated[int | None, typer.Option(help="Checkpoint iteration (default latest; -1 base model).")] = None,
    set_: SetOpt = None,
) -> None:
    """Held-out reward of RUN's policy and an image grid."""
    from stepgrpo.flows import api

    out = _offline_command(api.evaluate, run, iteration=iteration, overrides=list(set_ or []))
    console.print(
        f"held-out {out.reward_name} ({out.label}): {out.reward_mean:.4f}"
        + (f", strict {out.reward_strict:.4f}" if out.reward_strict is not None else "")
        + f"\nimages: {out.grid}"
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
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface; needs --token).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8100,
    max_batch: Annotated[
        int, typer.Option(help="Most images of one reward call: concurrent requests are scored together up to it.")
    ] = 64,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="STEPGRPO_REWARD_TOKEN",
            show_envvar=True,
            help="Shared secret clients send (they read STEPGRPO_REWARD_TOKEN); required beyond the loopback.",
        ),
    ] = None,
    resolution: Annotated[
        int | None,
        typer.Option(help="The image side the clients' model makes: other sizes are refused before decoding."),
    ] = None,
    max_body_mib: Annotated[int, typer.Option(help="Largest request body, MiB.")] = 1024,
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
            max_body=max_body_mib << 20,
            access_log=True,
        )
    except (ServiceError, ValueError, TypeError, KeyError, OSError) as err:
        err_console.print(f"error: {escape(str(err))}")
        raise typer.Exit(1) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shown = f"[{host}]" if ":" in host else host
    console.print(
        f"serving {built.name} v{built.version} on http://{shown}:{server.server_port} "
        f"(API docs at /docs; Ctrl-C stops)"
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


server_app = typer.Typer(
    help="A Prefect server kept running for the commands that run flows (else each starts a temporary one).",
    no_args_is_help=True,
)
app.add_typer(server_app, name="server")


@server_app.command("start")
def server_start(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (the UI is on it too).")] = 4200,
) -> None:
    """Start a Prefect server in the background; later commands (train, rescore, credit, ...) use it."""
    from stepgrpo.runtime import server

    try:
        record, started = server.start(host, port)
    except server.ServerError as err:
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(
        f"{'started' if started else 'already running'}: Prefect server {record['url']} (pid {record['pid']}), "
        f"UI {record['ui']}; commands of this Prefect home ({server.prefect_home()}) use it until "
        "`stepgrpo server stop`",
        soft_wrap=True,
        highlight=False,
    )


@server_app.command("stop")
def server_stop() -> None:
    """Stop the kept Prefect server (runs and their records stay in Prefect's database)."""
    from stepgrpo.runtime import server

    record = server.stop()
    console.print(f"stopped the Prefect server at {record['url']}" if record else "no kept Prefect server is running")


@server_app.command("status")
def server_status() -> None:
    """Say whether a kept Prefect server runs, and where."""
    from stepgrpo.runtime import server

    record = server.running()
    if record is None:
        console.print("no kept Prefect server: each command that runs a flow starts a temporary one")
        raise typer.Exit(1)
    console.print(f"Prefect server {record['url']} (pid {record['pid']}), UI {record['ui']}", highlight=False)


@app.command()
def runs(root: Annotated[Path, typer.Option(help="Directory holding run directories.")] = Path("runs")) -> None:
    """List the runs under ROOT: each one's recipe, scheme, status and held-out reward."""
    from stepgrpo.runs import in_use
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.publish import read_json

    if not root.is_dir():
        err_console.print(
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
    for path in sorted(p for p in root.glob("*") if (p / "manifest.json").is_file()):
        try:
            m = read_json(path / "manifest.json", "run manifest")
            cfg = m.get("config", {})
            ckpts = [d for d in (path / "checkpoints").glob("iter_*") if (d / "_published.json").is_file()]
            evals = _evals(path)
            total = int(cfg.get("run", {}).get("iterations", 0))
            method = cfg.get("completion", {}).get("method")
            scheme = str(cfg.get("credit", {}).get("scheme", "")) + (f" @ {method}" if method else "")
        except (
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            StorageError,
        ) as err:  # one broken run hides no other
            table.add_row(path.name, f"[red]unreadable: {escape(str(err))[:80]}[/]", "", "", "", "", "")
            continue
        status = (
            "running"
            if in_use(path)
            else "finished"
            if total and len(ckpts) >= total
            else f"stopped at {len(ckpts)}/{total}"
        )
        reward = (
            f"{evals[0][1]:.4f} -> {evals[-1][1]:.4f}" if len(evals) > 1 else (f"{evals[0][1]:.4f}" if evals else "")
        )
        table.add_row(
            path.name,
            str(cfg.get("run", {}).get("name", "")),
            escape(scheme),
            status,
            str(m.get("created_at", "")),
            f"{len(ckpts)}/{total}",
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
def compare(
    runs: Annotated[list[str], typer.Argument(help="Run directories or run ids under runs/.")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the chart here (PNG; needs matplotlib: stepgrpo[plots]).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the curves as JSON.")] = False,
) -> None:
    """RUNS at equal compute: each evaluation's held-out reward against the training NFEs spent
    before it, one row a run (scheme @ completion, NFEs, base and last reward, paired gain); with
    --out, the chart, a colour a recipe."""
    _run(_compare, runs, out, as_json)


def _compare(runs: list[str], out: Path | None, as_json: bool) -> None:
    import json

    from rich.table import Table

    from stepgrpo.reporting.compare import chart, compare
    from stepgrpo.storage.run import Run, find_run

    opened = [Run.open(find_run(r)) for r in runs]
    curves = compare(opened)
    if as_json:
        console.print_json(json.dumps(curves))
    else:
        table = Table("run", "scheme @ completion", "NFEs", "held-out: base", "last", "paired gain [95 %]")
        for c in curves:
            first, last = c["points"][0], c["points"][-1]
            gain = "" if c["gain"] is None else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*c["gain"])
            table.add_row(
                c["run_id"],
                c["recipe"],
                str(last["nfe"]),
                f"{first['reward_mean']:.4f}",
                f"{last['reward_mean']:.4f}",
                gain,
            )
        console.print(table)
    if out is not None:
        reward = (opened[0].config.get("reward") or {}).get("name", "reward")
        console.print(f"chart: {chart(curves, out, reward)}", highlight=False, soft_wrap=True)


@app.command()
def export(
    run: RunArg,
    push_to_hub: Annotated[
        str | None, typer.Option("--push-to-hub", help="Upload the export to this hub model repository (owner/name).")
    ] = None,
    private: Annotated[bool, typer.Option("--private", help="Make the hub repository private.")] = False,
) -> None:
    """Write RUN's export again (lora/: weights, model card README.md, samples.png, config.yaml), and
    with --push-to-hub upload it (`huggingface_hub`; log in first with `hf auth login`)."""
    _run(_export, run, push_to_hub, private)


def _export(run: str, repo: str | None, private: bool) -> None:
    from stepgrpo.reporting.card import push_to_hub, refresh_export
    from stepgrpo.runs import open_stored, owned

    stored, cfg = open_stored(run)
    with owned(stored.path):
        folder = refresh_export(stored, cfg)
    console.print(f"export: {folder} (model card {folder / 'README.md'})", highlight=False, soft_wrap=True)
    if repo is not None:
        url = push_to_hub(folder, repo, private, f"stepgrpo export of run {stored.run_id}")
        console.print(f"pushed to {url}", highlight=False, soft_wrap=True)


@app.command()
def inspect(
    run: RunArg,
    verify: Annotated[bool, typer.Option("--verify", help="Check every stored byte against its digests.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the run as JSON: each iteration's NFEs and seconds per stage.")
    ] = False,
) -> None:
    """A table of RUN's iterations: stages published and rewards (--verify: check all stored data)."""
    if verify:
        _run(_verify, run)
        return
    _run(_inspect_json if as_json else _inspect, run)


def _inspect_json(run: str) -> None:
    """The run as JSON (`iterations`: `stepgrpo.reporting.costs.iteration_costs`; `evaluations`: the
    held-out records' headline numbers), on stdout, for scripts."""
    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.publish import read_json
    from stepgrpo.storage.run import Run, find_run

    r = Run.open(find_run(run))
    evaluations = []
    for f in sorted((r.path / "eval").glob("*.json")):
        e = read_json(f, "evaluation record")
        if isinstance(e, dict) and "reward_mean" in e:
            keep = ("label", "reward_mean", "reward_strict", "prompts", "seeds", "nfe", "seconds")
            evaluations.append({k: e.get(k) for k in keep})
    cfg = r.config
    out = {
        "run_id": r.run_id,
        "run_dir": str(r.path),
        "scheme": (cfg.get("credit") or {}).get("scheme"),
        "completion": (cfg.get("completion") or {}).get("method"),
        "reward": (cfg.get("reward") or {}).get("name"),
        "iterations": iteration_costs(r),
        "evaluations": evaluations,
    }
    print(json.dumps(out, indent=1))


def _verify(run: str) -> None:
    """Every published stage, table part, checkpoint and the prompts against their digests; exit 1 if any differs."""
    from stepgrpo.storage.run import Run, find_run

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
    from stepgrpo.storage.run import Run, find_run

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
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.publish import read_json

    for path in sorted((r.path / r.QUALITY_DIR).glob("iter_*.json")):
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
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.publish import read_json
    from stepgrpo_core.registry import PluginError

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
            "/".join(_fmt(v, 2) for v in u.clip_frac_by_part)
            or f"{_fmt(u.clip_frac_first, 3)}/{_fmt(u.clip_frac_later, 3)}",
            " ".join(f"{k}:{v:.2f}" for k, v in zip(u.trained_step_ids, u.clip_frac_later_by_step) if v is not None)
            or "-",
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
            "grp std: within-group std of R_T (0-std: groups with none); clip by opt. step: the share of rows whose "
            "PPO ratio left the clip range, at each optimizer step of the sampled batch (the first is on-policy: 0), "
            "and after the first per trained step k; 0-grad: the share of later rows the clip gives no gradient; "
            "ratio sd: the PPO ratio's spread; signal: cosine between the gradients of two halves of the batch, "
            "this iteration and summed over ~20 iterations (~0: noise); "
            "|step|: the update's size; |LoRA-init|: distance from the initial LoRA",
            soft_wrap=True,
        )
    if warning:
        console.print(warning)


def _evals(path: Path) -> list[tuple[str, float]]:
    """The run's held-out evaluations at its own settings, `(label, reward)`, oldest first; a damaged
    record is named on stderr and left out."""
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.publish import read_json
    from stepgrpo.storage.run import Run

    out = []
    for f in (path / Run.EVAL_DIR).glob("*.json"):
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


def _where(run: str) -> str:
    """The run directory a command's RUN argument names (for a table's title)."""
    from stepgrpo.storage.run import find_run

    return str(find_run(run))


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
