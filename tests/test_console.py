"""What a person at the terminal sees of a training run: the live bar, the resume line, and on
Ctrl-C the command that resumes (`stepgrpo.reporting.live`, `stepgrpo_cli.app.train`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepgrpo.reporting.live import TrainingView


def test_the_view_is_a_no_op_off_a_terminal_and_logs_its_lines(capsys, monkeypatch):
    monkeypatch.setenv("STEPGRPO_PROGRESS", "1")
    with TrainingView("r", 3) as view:  # pytest's stderr is no terminal
        assert not view.live
        view.started(1)
        view.iteration(1, 0.5)
        view.evaluated(0.6)
        view.say("resuming run r at iteration 1 of 3")
    assert capsys.readouterr().out == "resuming run r at iteration 1 of 3\n"


@pytest.fixture
def console_handler(monkeypatch):
    """A terminal (stderr a tty, the bar on, not verbose) and a Prefect console handler on a logger,
    as a CLI process has one."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("STEPGRPO_PROGRESS", "1")
    monkeypatch.delenv("STEPGRPO_VERBOSE", raising=False)
    handler = PrefectConsoleHandler()
    logging.getLogger("stepgrpo-test-console").addHandler(handler)
    yield handler
    logging.getLogger("stepgrpo-test-console").removeHandler(handler)


def test_the_view_on_a_terminal_shows_the_bar_and_folds_prefects_console_lines(monkeypatch, console_handler):
    import logging

    handler = console_handler
    with TrainingView("r", 4) as view:
        assert view.live and handler.level == logging.WARNING
        view.started(2)
        view.iteration(2, 0.51234)
        view.evaluated(0.7)
        task = view.progress.tasks[0]
        assert task.completed == 3 and task.fields["reward"] == "0.5123" and task.fields["heldout"] == "0.7000"
    assert handler.level == logging.NOTSET  # given back
    monkeypatch.setenv("STEPGRPO_VERBOSE", "1")
    with TrainingView("r", 4) as view:
        assert view.live and not view.fold and handler.level == logging.NOTSET


def test_a_resumed_runs_reused_iterations_do_not_move_the_bar_back_and_ctrl_c_crash_lines_are_folded(
    monkeypatch, console_handler
):
    """On a resume the flow replays its reused iterations (their rewards) after `started(done)`:
    the bar stays at `done` and their near-zero seconds do not enter the time per iteration.
    Prefect's "aborted by an interrupt signal" errors of a Ctrl-C are folded too (the command
    prints the resume command itself); other errors are not."""
    import logging

    handler = console_handler
    with TrainingView("r", 6) as view:
        view.started(3)
        for i in range(3):  # reused
            view.iteration(i, 0.1 * i)
            assert view.progress.tasks[0].completed == 3 and not view.recent
        assert view.progress.tasks[0].fields["reward"] == "0.2000"
        view.iteration(3, 0.9)
        assert view.progress.tasks[0].completed == 4 and len(view.recent) == 1

        def record(text: str) -> logging.LogRecord:
            return logging.LogRecord("prefect", logging.ERROR, __file__, 1, text, None, None)

        crash = "Crash detected! Execution was aborted by an interrupt signal."
        assert not handler.filter(record(crash)) and handler.filter(record("Task run 'update iter_3' failed"))
    assert handler.filter(record(crash))  # given back


def test_a_resumed_run_shows_its_last_stored_held_out_reward(tmp_path, console_handler):
    import json
    from types import SimpleNamespace

    from stepgrpo.config import load_config
    from stepgrpo.flows.progress import TrainingLog
    from stepgrpo.storage.run import Run

    cfg = load_config(None, ["run.iterations=4"])
    run = Run.create(tmp_path, "r", cfg.model_dump(mode="json"))
    (run.path / "eval").mkdir()
    for label, reward in (("base", 0.5), ("iter_1", 0.61)):
        (run.path / "eval" / f"{label}.json").write_text(json.dumps({"label": label, "reward_mean": reward}))
    with TrainingView("r", 4) as view:
        TrainingLog.resuming(SimpleNamespace(run=run, cfg=cfg, view=view), 2, 5)
        assert view.progress.tasks[0].fields["heldout"] == "0.6100" and view.progress.tasks[0].completed == 2


def test_the_resume_command_names_the_run(monkeypatch):
    from stepgrpo_cli.shell import resume_command

    monkeypatch.setattr(sys, "argv", ["/x/.venv/bin/stepgrpo", "train", "--config", "my config.yaml"])
    expected = "/x/.venv/bin/stepgrpo train --config 'my config.yaml' --run-id demo-1"
    assert resume_command(Path("runs/demo-1")) == expected
    monkeypatch.setattr(sys, "argv", ["stepgrpo", "train", "--run-dir=/data/r1"])
    assert resume_command(Path("/data/r1")) == "stepgrpo train --run-dir=/data/r1"


def _sigint_as_at_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_ctrl_c_prints_the_command_that_resumes_and_it_resumes(tmp_path, server, prefect_home):
    """SIGINT (a terminal's Ctrl-C) after the first checkpoint, while the second update runs (held
    there by the fault hook until the signal comes): exit 130 with the resume command; that
    command resumes the run at its first unfinished iteration, and finishes it."""
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    model = tmp_path / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(model))
    sets = [f"model.path={model}", "model.lora_rank=4", "model.guidance_scale=1.0", "sampler.steps=4"]
    sets += ["sampler.eval_steps=4", "reward.name=jpeg_compressibility", "run.iterations=2"]
    sets += ["run.prompts_per_iteration=2", "run.group_size=3", "run.eval_prompts=2", "optim.micro_batch=3"]
    sets += [f"run.runs_root={tmp_path / 'runs'}", "scale.threads=1"]
    args = ["train", *[a for s in sets for a in ("--set", s)], "--run-id", "interrupted"]
    env = dict(os.environ, PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)  # the command's own temporary server, which a Ctrl-C must not reach
    held = tmp_path / "held"  # iteration 1's update stops before it publishes, until the signal
    env["STEPGRPO_FAULT"] = f"hang:update:1:{held}"
    command = subprocess.Popen(
        [sys.executable, "-m", "stepgrpo_cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a terminal's foreground command takes SIGINT by default; a process that ignores or blocks
        # it passes that on to what it starts (POSIX keeps SIG_IGN and the signal mask across exec),
        # and in two CI runs the command never saw the interrupt
        preexec_fn=_sigint_as_at_a_terminal,
    )
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    inherited = f"this test process: SIGINT {signal.getsignal(signal.SIGINT)}, blocked {blocked}"
    deadline = time.monotonic() + 240
    while not held.is_file():
        assert command.poll() is None, command.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(command.pid, signal.SIGINT)  # the whole group, as a terminal does
    out, err = command.communicate(timeout=120)
    assert command.returncode == 130, inherited + "\n" + err[-3000:]
    checkpoints = tmp_path / "runs" / "interrupted" / "checkpoints"
    assert (checkpoints / "iter_0" / "_published.json").is_file() and not (checkpoints / "iter_1").exists()
    said = err.split("Resume it with:\n", 1)[1].strip().splitlines()[0].strip()
    assert said.startswith("stepgrpo train --set") and said.endswith("--run-id interrupted")

    again = subprocess.run(  # against the session's server: the resume, not a second temporary server, is checked
        [sys.executable, "-m", "stepgrpo_cli", *said.split()[1:]],
        env=dict(server, PREFECT_SERVER_ANALYTICS_ENABLED="false"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming run interrupted at iteration 1 of 2" in again.stdout + again.stderr
    assert (tmp_path / "runs" / "interrupted" / "checkpoints" / "iter_1" / "_published.json").is_file()


@pytest.mark.slow
def test_a_failure_inside_the_flow_is_one_line_and_verbose_shows_the_traceback(tmp_path, server, prefect_home):
    """A reward that raises mid-run: the command exits 1 with one line naming the error and how to
    see the traceback; Prefect's own tracebacks stay off the console. `--verbose`: they show."""
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    model = tmp_path / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(model))
    (tmp_path / "boom.py").write_text(
        "from stepgrpo.plugins import reward\n\n\n"
        "@reward(version='1')\n"
        "class Boom:\n"
        "    def __call__(self, images, prompts, metadata):\n"
        "        raise RuntimeError('the reward model ran out of memory')\n"
    )
    sets = [f"model.path={model}", "model.lora_rank=4", "sampler.steps=4", "sampler.eval_steps=4"]
    sets += ["reward.name=boom:Boom", "run.iterations=1", "run.prompts_per_iteration=2", "run.group_size=2"]
    sets += ["run.eval_prompts=2", f"run.runs_root={tmp_path / 'runs'}", "scale.stage_retries=0"]
    args = [sys.executable, "-m", "stepgrpo_cli", "train", *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PREFECT_HOME=str(prefect_home))
    env.pop("PREFECT_API_URL", None)
    quiet = subprocess.run([*args, "--run-id", "quiet"], env=env, capture_output=True, text=True, timeout=300)
    said = quiet.stdout + quiet.stderr
    assert quiet.returncode == 1, said[-3000:]
    assert "RuntimeError: the reward model ran out of memory" in said and "--verbose" in said
    assert "Traceback" not in said, said[-3000:]
    loud = subprocess.run(  # the session's server: the console's lines, not a second temporary server, are checked
        [*args, "--run-id", "loud", "--verbose"],
        env=dict(server, PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loud.returncode == 1 and "Traceback" in loud.stdout + loud.stderr
