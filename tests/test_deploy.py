"""`prefect.yaml`: a local Prefect server, `prefect deploy --all`, and one deployed run through a worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]


def prefect(env, *args: str, timeout: float = 300) -> str:
    """The `prefect` command a user types (deploy, worker start)."""
    out = subprocess.run([*PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-3000:])
    return out.stdout + out.stderr


def api_client():
    """The session server's API from this process: for what the test itself reads and starts (a
    `prefect` command per call would import Prefect again each time)."""
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def start(deployment: str, **parameters) -> None:
    """A run of `deployment` for the worker to pick up, as `prefect deployment run` creates it."""
    with api_client() as api:
        api.create_flow_run_from_deployment(api.read_deployment_by_name(deployment).id, parameters=parameters)


def flow_runs() -> str:
    """The server's flow runs, for a failure's message."""
    with api_client() as api:
        return "\n".join(f"{r.name}: {r.state_name}" for r in api.read_flow_runs(limit=200))


def test_prefect_yaml_declares_the_deployments():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in spec["deployments"]}
    assert {"train", "evaluate", "rescore", "credit", "credit-quality"} <= set(by_name)
    assert all(d["work_pool"]["name"] == "stepgrpo" for d in by_name.values())
    assert [s["active"] for s in by_name["train"]["schedules"]] == [False]


def test_deploy_all_and_run_one_deployment_through_a_process_worker(server, harness, tmp_path):
    prefect(server, "work-pool", "create", "stepgrpo", "--type", "process")
    before = (REPO / "prefect.yaml").read_text()
    prefect(server, "--no-prompt", "deploy", "--all")
    assert (REPO / "prefect.yaml").read_text() == before
    with api_client() as api:
        for name in ("train/train", "evaluate/evaluate", "rescore/rescore", "check/check"):
            api.read_deployment_by_name(name)  # raises if it is not deployed
        assert [s.active for s in api.read_deployment_by_name("train/train").schedules] == [False]

    report = tmp_path / "report.json"
    start("check/check", report=str(report), overrides=["scale.threads=null"])
    # the flow applies the worker's environment itself, as the CLI does (STEPGRPO_THREADS)
    worker = prefect(dict(server, STEPGRPO_THREADS="2"), "worker", "start", "--pool", "stepgrpo", "--run-once")
    assert report.is_file(), worker[-3000:] + flow_runs()
    result = json.loads(report.read_text())
    assert result["config"] == "demo" and "turning_point" in result["schemes"] and "shapes" in result["rewards"]
    assert result["torch_threads"] == 2


def test_stepgrpo_deploy_fills_the_run_form_and_the_deployed_train_runs_like_the_cli(
    warm_cli, server, harness, tmp_path
):
    """`stepgrpo deploy`: the form's defaults are the YAML's values; a run of it through a worker
    is named after its run id, applies the config's thread count, and logs to the runs root's store."""
    sets = ["run.iterations=1", "run.eval_prompts=4", "run.eval_seeds=1", f"run.runs_root={tmp_path}"]
    sets += ["scale.threads=2", "run.prompts_per_iteration=2", "run.group_size=2"]
    sets += ["sampler.steps=4", "sampler.eval_steps=4"]  # the tiniest run of the recipe
    args = [a for s in sets for a in ("--set", s)]
    out = warm_cli.run(["deploy", "--config", "configs/demo.yaml", "--name", "tiny", *args], REPO, warm_cli.env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with api_client() as api:
        form = json.dumps(api.read_deployment_by_name("train/tiny").parameters)  # the run form's values
    assert '"scheme": "outcome"' in form and '"iterations": 1' in form, form[:3000]
    # the form's notes give the recipe's value first, the code's default second
    with api_client() as api:
        schema = api.read_deployment_by_name("train/tiny").parameter_openapi_schema
    notes = {k: p["description"] for k, p in schema["definitions"]["RunConfig"]["properties"].items()}
    assert notes["iterations"].endswith("configs/demo.yaml: `1` (stepgrpo's default: `2`)."), notes["iterations"]
    assert "Default:" not in json.dumps(schema["definitions"])
    start("train/tiny", run_id="deployed")
    worker = prefect(server, "worker", "start", "--pool", "stepgrpo", "--run-once", timeout=900)
    assert (tmp_path / "deployed" / "checkpoints" / "iter_0" / "_published.json").is_file(), worker[-3000:]
    # the flow run is named after the run id
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with api_client() as api:
        runs = api.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])), limit=200)
    assert "deployed" in {r.name for r in runs}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("stepgrpo").experiment_id])
    assert mlrun.data.tags["stepgrpo.run_id"] == "deployed" and mlrun.data.tags["stepgrpo.torch_threads"] == "2"
    assert mlrun.data.tags["stepgrpo.config"] == "demo"  # the config tells runs of the runs root's experiment apart


def test_a_deployment_runs_where_it_was_made_and_offline_flows_deploy_too(
    warm_cli, server, harness, tmp_path, monkeypatch
):
    """From a user's own directory: the run form's relative paths are anchored there, the worker runs
    there (the deployment's source), the offline flows deploy by name, and a missing pool is named
    with the command that creates it."""
    from typer.testing import CliRunner

    from stepgrpo.config import load_config
    from stepgrpo_cli import app
    from stepgrpo_cli.deployments import deploy_flow

    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\n")
    sets = ["--set", "run.runs_root=runs", "--set", "run.prompts=prompts.txt", "--set", "run.prompts_per_iteration=1"]
    prefect(server, "work-pool", "create", "stepgrpo", "--type", "process", "--overwrite")
    made = warm_cli.run(["deploy", "--config", "shapes_outcome", "--name", "here", *sets], tmp_path, warm_cli.env)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    with api_client() as api:
        deployment = api.read_deployment_by_name("train/here")
    run = deployment.parameters["config"]["run"]
    assert run["runs_root"] == str(tmp_path.resolve() / "runs")
    assert run["prompts"] == str(tmp_path.resolve() / "prompts.txt")
    assert deployment.parameters["config"]["model"]["path"] == "models/shapes"  # a name here: left as it is
    assert str(tmp_path.resolve()) in json.dumps(deployment.pull_steps)  # the worker's working directory
    # the same from this process: the offline flows, a missing pool, a training flow without its recipe
    monkeypatch.chdir(tmp_path)
    for flow in ("rescore", "credit-quality"):
        deploy_flow(None, flow, "stepgrpo", None, flow)
    with api_client() as api:
        api.read_deployment_by_name("rescore/rescore")
        assert str(tmp_path.resolve()) in json.dumps(
            api.read_deployment_by_name("credit-quality/credit-quality").pull_steps
        )
    with pytest.raises(ValueError, match="prefect work-pool create nobody-made-this --type process"):
        deploy_flow(load_config("shapes_outcome"), "x", "nobody-made-this", "shapes_outcome")
    needs = CliRunner().invoke(app, ["deploy", "--flow", "train"])
    assert needs.exit_code == 1 and "needs --config" in needs.output
