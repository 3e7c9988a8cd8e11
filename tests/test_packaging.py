"""An installable stepgrpo: the wheel holds every package of the code, the shipped model and the
recipes, and an installed copy finds them from any directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_lists_every_package_of_the_code():
    from setuptools import find_packages

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    # the top-level flows/, tasks/, storage/ are found under stepgrpo's name (its links), never their own
    code = set(find_packages(str(REPO), include=["stepgrpo*", "stepgrpo_core*", "stepgrpo_cli*"]))
    assert {"stepgrpo.flows", "stepgrpo.tasks", "stepgrpo.storage"} <= code
    assert listed - {"stepgrpo.shipped.configs", "stepgrpo.shipped.models"} == code
    assert not listed & {"flows", "tasks", "storage"}


@pytest.mark.slow
def test_an_installed_wheel_trains_a_shipped_config_from_another_directory(tmp_path, server):
    """`pip wheel` of a copy of the checkout (no build/ left in the repository), installed into a
    fresh venv (the dependencies, already here, reached through a .pth; the checkout's editable
    install is not), then `stepgrpo train --config shapes_outcome` from a directory with no
    configs/ or models/ in it, but with packages of its own named `flows`, `tasks` and `storage`
    (a Prefect project's usual layout): train, rescore and the Python API use stepgrpo's."""
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "dist", "runs", "*.egg-info", "__pycache__", "bench", "docs"),
    )
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", str(wheels)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("stepgrpo-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    shipped = site / "stepgrpo" / "shipped"
    assert (shipped / "models" / "shapes" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert (shipped / "configs" / "shapes_outcome.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    for own in ("flows", "tasks", "storage"):  # the user's packages, first on sys.path from this directory
        (elsewhere / own).mkdir(parents=True)
        (elsewhere / own / "__init__.py").write_text(f"MINE = {own!r}\n")

    def run(*args):
        done = subprocess.run(args, cwd=elsewhere, env=server, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    stepgrpo = str(venv / "bin" / "stepgrpo")
    assert run(stepgrpo, "--version").startswith("stepgrpo ")
    assert "--set" in run(stepgrpo, "demo", "--help")
    small = ["run.iterations=1", "run.prompts_per_iteration=2", "run.group_size=2", "run.eval_prompts=2"]
    small += ["run.eval_seeds=1", "sampler.steps=4", "sampler.eval_steps=4", "sampler.sde_window_size=2"]
    run(stepgrpo, "train", "--config", "shapes_outcome", "--run-id", "wheel", *[a for o in small for a in ("--set", o)])
    stored = elsewhere / "runs" / "wheel"
    run(stepgrpo, "rescore", "wheel", "--reward", "jpeg_compressibility")
    api = (
        "import flows, tasks, storage, stepgrpo; "
        "scores = stepgrpo.rescore('wheel', 'shapes'); "
        "print(len(scores), flows.MINE, tasks.MINE, storage.MINE, stepgrpo.open_run('wheel').iterations('rollout')); "
        # the shipped files and model are found from the installed package
        "import stepgrpo.paths as p, stepgrpo.policy.base as b, stepgrpo.loops.workspace as w; "
        "print(p.SHIPPED_ROOT, b.DEFAULT_MODEL, w.resolve_model_path('models/shapes'))"
    )
    said, where = run(str(venv / "bin" / "python"), "-c", api).strip().splitlines()[-2:]
    assert said.split() == ["1", "flows", "tasks", "storage", "[0]"]
    assert where.split() == [str(shipped), *[str(shipped / "models" / "shapes")] * 2]
    assert run(str(venv / "bin" / "python"), "-m", "stepgrpo_cli", "--version").startswith("stepgrpo ")
    from stepgrpo.storage.run import Run

    trained = Run.open(stored)
    assert trained.iterations("checkpoint") == [0]
    assert trained.config["run"]["name"] == "shapes_outcome" and trained.config["model"]["path"] == "models/shapes"
    from stepgrpo.config import load_config

    assert load_config(shipped / "configs" / "demo.yaml").run.name == "demo"  # its base file is shipped beside it
    # deployed from the wheel: the worker runs in the directory `deploy` ran in, the run lands there
    # (not in site-packages), beside the one trained above, and `stepgrpo runs` there lists it
    python = str(venv / "bin" / "python")
    run(python, "-m", "prefect", "work-pool", "create", "wheel-pool", "--type", "process", "--overwrite")
    run(stepgrpo, "deploy", "--config", "shapes_outcome", "--name", "wheel", "--pool", "wheel-pool",
        *[a for o in small for a in ("--set", o)])  # fmt: skip
    run(python, "-m", "prefect", "deployment", "run", "train/wheel", "--param", "run_id=deployed")
    run(python, "-m", "prefect", "worker", "start", "--pool", "wheel-pool", "--run-once")
    deployed = Run.open(elsewhere / "runs" / "deployed")
    assert deployed.iterations("checkpoint") == [0]
    assert not list(site.glob("runs")) and not list(site.glob("mlflow*"))
    assert "deployed" in run(stepgrpo, "runs")
