"""The `stepgrpo` console script: help texts and error paths (clear message, exit 1, nothing published).

None of these start a Prefect server: inputs are validated before any flow runs.
"""

from __future__ import annotations

import json

import prefect  # noqa: F401  (Prefect binds its log handlers at import: not inside CliRunner's streams)
import pytest
from typer.testing import CliRunner

from stepgrpo_cli import app

runner = CliRunner()
COMMANDS = ["train", "rescore", "credit", "calibrate", "evaluate", "pretrain", "runs", "inspect"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


def test_version_prints_the_package_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"stepgrpo {version('stepgrpo')}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "pretrain"])
def test_each_command_has_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0 and "Usage" in result.output


def test_help_shows_what_to_type_not_python_types():
    """Every option's help names its value as a user types it (`--set KEY=VALUE`, `--config NAME|FILE`);
    a flag, `--help` included, shows none (Typer's default prints `<bool>`, `<list[str]>`)."""
    import typer

    def commands(command, path):
        if hasattr(command, "commands"):
            yield path, command
            for name, sub in command.commands.items():
                yield from commands(sub, [*path, name])
        else:
            yield path, command

    seen = 0
    for path, command in commands(typer.main.get_command(app), []):
        if "pretrain" in path:  # its own parser's help (`stepgrpo pretrain --help`)
            continue
        ctx = command.make_context(" ".join(path) or "stepgrpo", [], resilient_parsing=True)
        for option in [*command.params, command.get_help_option(ctx)]:
            if option is None or option.param_type_name != "option":
                continue
            shown = option.display_type_rich(ctx)
            assert shown is not None and "<" not in shown, (path, option.opts, shown)
            assert (shown == "") == option.is_flag, (path, option.opts, shown)
            seen += 1
    assert seen > 40
    text = invoke("train", "--help").output
    assert "KEY=VALUE" in text and "NAME|FILE" in text and "<bool>" not in text


@pytest.mark.parametrize(
    "override, says",
    [
        ("optim.lrr=1", ["optim.lrr", "unknown field", "weight_decay"]),
        ("reward.name=nope", ["unknown reward 'nope'", "jpeg_compressibility", "shapes"]),
        ("credit.scheme=vibes", ["unknown credit scheme 'vibes'", "turning_point"]),
        ("sampler.kernel=brownian", ["unknown kernel 'brownian'", "ddim"]),
        ("model.path=no/such/model", ["model.path 'no/such/model'", "stepgrpo pretrain"]),
    ],
)
def test_train_rejects_bad_input_before_publishing_anything(tmp_path, monkeypatch, override, says):
    monkeypatch.chdir(tmp_path)
    result = invoke("train", "--set", override, "--set", "run.runs_root=runs", "--run-id", "x")
    assert result.exit_code == 1, result.output
    for text in says:
        assert text in result.output, (text, result.output)
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path):
    result = invoke("train", "--config", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 1 and "does not exist" in result.output


def _fake_run(root, schema_version):
    run = root / "old"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"run_id": "old", "schema_version": schema_version, "config": {}}))
    return run


def test_a_run_of_another_schema_version_is_refused(tmp_path):
    run = _fake_run(tmp_path, 999)
    for args in (
        ["rescore", str(run), "--reward", "shapes"],
        ["credit", str(run), "--scheme", "dense"],
        ["evaluate", str(run)],
        ["inspect", str(run)],
    ):
        result = invoke(*args)
        assert result.exit_code == 1, (args, result.output)
        assert "schema version 999" in result.output, result.output


def test_offline_commands_name_unknown_runs_rewards_and_schemes(tmp_path):
    from stepgrpo.storage.schema import SCHEMA_VERSION

    run = _fake_run(tmp_path, SCHEMA_VERSION)
    result = invoke("rescore", str(tmp_path / "missing"), "--reward", "shapes")
    assert result.exit_code == 1 and "no run" in result.output
    result = invoke("rescore", str(run), "--reward", "nope")
    assert result.exit_code == 1 and "known rewards" in result.output
    result = invoke("credit", str(run), "--scheme", "nope")
    assert result.exit_code == 1 and "known credit schemes" in result.output
    result = invoke("credit", str(run), "--scheme", "dense", "--options", "[1]")
    assert result.exit_code == 1 and "JSON object" in result.output


def test_runs_on_an_empty_root(tmp_path):
    result = invoke("runs", "--root", str(tmp_path))
    assert result.exit_code == 0


def test_runs_lists_scheme_and_status_and_refuses_a_missing_root(tmp_path, monkeypatch):
    import importlib

    from rich.console import Console

    from stepgrpo.config import load_config
    from stepgrpo.runs import owned
    from stepgrpo.storage.run import Run

    missing = invoke("runs", "--root", str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and "is not a directory" in missing.output
    assert not (tmp_path / "nowhere").exists()
    cfg = load_config(None, ["credit.scheme=dense", "completion.method=rollout", "run.iterations=3"])
    path = Run.create(tmp_path / "runs", "r", cfg.model_dump(mode="json")).path
    cli = importlib.import_module("stepgrpo_cli.shell")  # the consoles every command prints on
    monkeypatch.setattr(cli, "console", Console(width=200))  # one line a run, whatever the terminal
    listed = runner.invoke(app, ["runs", "--root", str(tmp_path / "runs")])
    assert listed.exit_code == 0 and "dense @ rollout" in listed.output and "stopped at 0/3" in listed.output
    awm = load_config(
        None, ["update.objective=awm", "sampler.kernel=flow", "completion.method=null", "credit.scheme=outcome"]
    )
    Run.create(tmp_path / "runs", "a", awm.model_dump(mode="json"))
    assert "awm, outcome" in runner.invoke(app, ["runs", "--root", str(tmp_path / "runs")]).output
    with owned(path):  # while a process owns the run
        assert (
            "running" in runner.invoke(app, ["runs", "--root", str(tmp_path / "runs")], env={"COLUMNS": "200"}).output
        )


def test_transformers_notice_of_its_pil_fallback_is_dropped_and_nothing_else():
    import logging

    import stepgrpo  # noqa: F401  (installs the filter)

    logger = logging.getLogger("transformers.utils.import_utils")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, None, None)

    notice = "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`"
    assert not logger.filter(record(notice))
    assert logger.filter(record("`Foo` requires bar (not installed)"))


def test_the_console_script_ends_with_the_commands_status_and_all_its_output(tmp_path):
    """`main` ends the process from the last exit handler (skipping the interpreter's teardown):
    the command's exit status and every byte it printed still come out, through pipes too."""
    import subprocess
    import sys

    from stepgrpo.paths import REPO_ROOT

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stepgrpo_cli", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
        )

    shown = cli("config", "show", "--config", "configs/shapes_outcome.yaml")
    assert shown.returncode == 0, shown.stderr
    in_process = CliRunner().invoke(app, ["config", "show", "--config", "configs/shapes_outcome.yaml"])
    assert shown.stdout == in_process.output  # all of it, flushed before the process ended
    missing = cli("inspect", str(tmp_path / "no-such-run"))
    assert missing.returncode == 1 and "no run" in missing.stderr, (missing.returncode, missing.stderr)
    usage = cli("credit")  # typer's own usage error
    assert usage.returncode == 2, usage.returncode


def test_a_process_ended_at_exit_runs_its_later_handlers_and_ends_with_its_status():
    """`end_at_exit` (the console script's and the update ranks' ending): the handlers registered
    after it run, printed bytes and logging come out through pipes, the status is the cell's; an
    uncaught exception ends with 1 and its traceback."""
    import subprocess
    import sys

    script = (
        "import atexit, logging, sys\n"
        "from stepgrpo.runtime.environment import end_at_exit\n"
        "ended = end_at_exit()\n"
        "atexit.register(lambda: print('later handler', flush=False))\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "logging.getLogger('x').warning('logged')\n"
        "print('printed', end='')\n"
    )
    done = subprocess.run([sys.executable, "-c", script + "ended[0] = 3\n"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "printedlater handler\n", "WARNING:x:logged\n")
    failed = subprocess.run(
        [sys.executable, "-c", script + "raise RuntimeError('boom')\n"], capture_output=True, text=True, timeout=60
    )
    assert failed.returncode == 1 and "RuntimeError: boom" in failed.stderr, failed.stderr


def test_offline_commands_skip_flow_heartbeats_unless_the_user_asks_for_them(monkeypatch):
    """Prefect's heartbeat thread holds a flow's end for up to 1 s; the offline commands (seconds
    long) run without it, unless the user set the interval; training keeps Prefect's default."""
    from prefect.settings import get_current_settings

    from stepgrpo.flows import session

    for name in session.HEARTBEAT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STEPGRPO_KEPT_SERVER", "0")  # no server lookup: only the settings are read
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # and no temporary server started (none called)
    with session.prefect_server(heartbeats=False):
        assert get_current_settings().flows.heartbeat_frequency is None
    default = get_current_settings().flows.heartbeat_frequency
    with session.prefect_server():
        assert get_current_settings().flows.heartbeat_frequency == default
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    monkeypatch.setenv("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "60")  # as a user's process starts with it
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 60}), session.prefect_server(heartbeats=False):
        assert get_current_settings().flows.heartbeat_frequency == 60


def test_verify_names_a_copied_checkpoint_and_ends_with_its_own_summary(tmp_path):
    import shutil

    import torch

    from stepgrpo.storage.run import Run

    run = Run.create(tmp_path, "r", {})
    run.checkpoints.save_checkpoint(1, {"lora": {"a.weight": torch.ones(2)}}, {"iteration": 1})
    shutil.copytree(run.stage_path(1, "checkpoint"), run.stage_path(7, "checkpoint"))
    result = runner.invoke(app, ["inspect", str(run.path), "--verify"])
    assert result.exit_code == 1
    assert "iter_7 holds the checkpoint of iteration 1" in result.output and "do not verify" in result.output
    assert "Exit" not in result.output and "failed" not in result.output


def test_config_list_names_every_shipped_recipe_and_a_checkout_path_points_to_it(tmp_path, monkeypatch):
    from stepgrpo.paths import SHIPPED_CONFIGS

    listed = runner.invoke(app, ["config", "list"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0
    for path in SHIPPED_CONFIGS.glob("*.yaml"):
        assert path.stem in listed.output
    from stepgrpo.config import shipped_recipes

    for name, about in shipped_recipes():  # a whole sentence each, not a line cut mid-sentence
        assert about.endswith((".", ")")), (name, about)
    from stepgrpo.config import START_HERE

    # where a newcomer starts: one shipped recipe, marked on its line and named below
    assert (SHIPPED_CONFIGS / f"{START_HERE[0]}.yaml").is_file()
    marked = [
        line.split()[1] for line in listed.output.splitlines() if line.startswith("* ") and "start here" not in line
    ]
    assert marked == [START_HERE[0]]
    assert f"start here: {START_HERE[0]}" in listed.output
    monkeypatch.chdir(tmp_path)  # a user's project: no configs/ here
    wrong = runner.invoke(app, ["config", "show", "--config", "configs/shapes_dense.yaml"])
    assert wrong.exit_code == 1 and "`--config shapes_dense`" in wrong.output


def test_runs_shows_an_extended_run_at_its_own_length(tmp_path, monkeypatch):
    import torch
    from rich.console import Console

    from stepgrpo.config import load_config
    from stepgrpo.storage.run import Run
    from stepgrpo_cli import shell

    monkeypatch.setattr(shell, "console", Console(width=250))
    cfg = load_config(None, ["run.iterations=1"])
    run = Run.create(tmp_path, "r", cfg.model_dump(mode="json"))
    for i in range(2):  # extended to 2 by a resume with run.iterations=2
        run.checkpoints.save_checkpoint(i, {"lora": {"a.weight": torch.ones(1)}}, {"iteration": i})
    listed = runner.invoke(app, ["runs", "--root", str(tmp_path)])
    assert listed.exit_code == 0 and "2/2" in listed.output and "2/1" not in listed.output


def test_config_variants_lists_every_family_a_config_names(monkeypatch):
    """Every family from its registry (kernels, completions, schemes, objectives, rewards, optimizer
    presets, evaluation protocols): every entry of each, whatever they hold, with its paper."""
    from rich.console import Console

    from stepgrpo.families import families
    from stepgrpo_cli import shell

    monkeypatch.setattr(shell, "console", Console(width=2000))  # every cell on one line

    listed = runner.invoke(app, ["config", "variants"])
    assert listed.exit_code == 0, listed.output
    assert {"optimizer preset", "evaluation protocol", "reward", "credit scheme"} <= set(families())
    rows = {tuple(c.strip() for c in ln.split("│")[1:3]): ln for ln in listed.output.splitlines() if "│" in ln}
    for heading, registry in families().items():
        for name in registry.names():
            d = registry.describe(name)
            assert d["summary"][:20] in rows.get((heading, d["pattern"]), ""), (heading, name)
