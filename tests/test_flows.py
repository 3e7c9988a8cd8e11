"""The Prefect flows on a tiny random-weight SD3 pipeline: training, caching, rescore, credit, failures.

The session's Prefect server (`harness`, tests/conftest.py); stage executions are counted by wrapping the stage
bodies (a cached task never calls its body).
"""

from __future__ import annotations

import collections
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import encode
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import UpdateStats
from stepgrpo.rewards.base import RewardOutput
from stepgrpo.storage.publish import options_digest

pytestmark = pytest.mark.slow

STAGES = ("prompts", "calibrate", "draw", "rollout", "complete", "score", "credit", "update", "evaluate")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_model) -> list[str]:
    return [
        f"model.path={tiny_model}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.guidance_scale=1.0",
        "sampler.steps=4",
        "sampler.eval_steps=4",
        "reward.name=jpeg_compressibility",
        "credit.scheme=stepwise",
        "run.iterations=2",
        "run.prompts_per_iteration=2",
        "run.group_size=3",
        "run.eval_prompts=4",
        "optim.micro_batch=3",
        "optim.lr=1e-3",
        "optim.clip_range=0.05",
    ]


@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Counts computations of each stage (`stepgrpo.tasks.<stage>.compute`: a reused stage is not computed)."""
    import importlib

    counter: collections.Counter = collections.Counter()
    for name in STAGES:
        module = importlib.import_module(f"stepgrpo.tasks.{name}")
        original = module.compute

        def wrapped(*args, _name=name, _original=original, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "compute", wrapped)
    return counter


@pytest.fixture(scope="module")
def trained(harness, tiny, tmp_path_factory) -> dict:
    from stepgrpo.flows.train import train

    run_dir = tmp_path_factory.mktemp("runs") / "tiny-a"
    return train(overrides=tiny, run_dir=str(run_dir)) | {"model_path": tiny[0].removeprefix("model.path=")}


def test_the_reference_loop_computes_what_the_pipeline_stores(trained):
    """`stepgrpo.loops.reference` is the algorithm on one page, and bench/costs/costs.py's overhead ratio
    divides the pipeline's time by its: the two must do the same work. On the same config its rewards
    and advantages of every iteration equal what the pipeline stored (the second iteration after an
    update of each)."""
    from stepgrpo.config import validate_config
    from stepgrpo.loops.reference import reference_loop
    from stepgrpo.storage import Run

    run = Run.open(Path(trained["run_dir"]))
    cfg = validate_config(run.config)
    bare = reference_loop(cfg, cfg.run.iterations)
    assert len(bare) == 2
    for i, rec in enumerate(bare):
        grid = run.tables.reward_grid(i, cfg.reward.name)
        assert torch.allclose(rec["rewards"].float(), grid, atol=1e-6), i
        stored = run.tables.advantage_grid(i, cfg.credit.scheme)
        trained_steps = torch.isfinite(stored)
        assert trained_steps.any()
        assert torch.allclose(rec["advantages"][trained_steps].float(), stored[trained_steps], atol=1e-5), i


def test_train_runs_every_stage_and_tracks_it(trained):
    run_dir = Path(trained["run_dir"])
    assert [e["label"] for e in trained["evaluations"]] == ["base", "iter_1"]
    for i in (0, 1):
        assert (run_dir / f"iter_{i}" / "rollout.zarr" / "_published.json").is_file()
        assert (run_dir / f"iter_{i}" / "completions" / "remaining.zarr" / "_published.json").is_file()
        assert (run_dir / "checkpoints" / f"iter_{i}" / "lora.safetensors").is_file()
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (run_dir / "eval" / "base.png").is_file()

    from mlflow.tracking import MlflowClient

    assert trained["tracking_uri"] == f"sqlite:///{run_dir.parent / 'mlflow.db'}"  # the runs root's store
    client = MlflowClient(trained["tracking_uri"])
    exp = client.get_experiment_by_name("stepgrpo")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    (mlrun,) = client.search_runs([exp.experiment_id], filter_string="tags.`stepgrpo.run_id` = 'tiny-a'")
    assert mlrun.data.params["credit.scheme"] == "stepwise"
    assert mlrun.data.tags["stepgrpo.scheme"] == "stepwise" and mlrun.data.tags["stepgrpo.completion"] == "remaining"
    assert mlrun.data.tags["mlflow.source.name"].startswith(Path(sys.argv[0]).name)  # the command that ran it
    assert len(mlrun.data.tags.get("mlflow.source.git.commit", "x" * 40)) == 40
    for metric in (
        "reward/mean",
        "clip_frac",
        "approx_kl",
        "ratio/mean",
        "zero_std_ratio",
        "gain/step_0",
        "nfe/complete",
        "seconds/update",
        "eval/mean",
        # the learning diagnostics
        "reward/ode_mean",
        "reward/group_std",
        "reward/zero_std_groups",
        "clip_frac/first",
        "zero_grad_frac/first",
        "clip_frac/part_1",  # the recipe's second optimizer step of a batch
        "zero_grad_frac/part_1",
        "clip_frac_later/step_0",
        "ratio/std",
        "signal_cosine",
        "lora/distance",
        "lora/update_norm",
        "grad_energy_share/step_0",
        "grad_energy_share/step_2",
        "nfe/ode_reference",
    ):
        assert metric in mlrun.data.metrics, metric
    assert len(client.get_metric_history(mlrun.info.run_id, "reward/mean")) == 2
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "reward/mean")] == [0, 1]
    # cumulative cost, for comparing runs at equal compute: the running sum of every forward an iteration made
    hist = {
        k: [m.value for m in sorted(client.get_metric_history(mlrun.info.run_id, k), key=lambda m: m.step)]
        for k in ("nfe/rollout", "nfe/ode_reference", "nfe/complete", "nfe/update", "cost/nfe_total")
    }
    per_iteration = [sum(v) for v in zip(*(hist[k] for k in hist if k != "cost/nfe_total"))]
    assert hist["cost/nfe_total"] == [per_iteration[0], per_iteration[0] + per_iteration[1]]
    assert min(hist["nfe/update"]) > 0
    seconds = [m.value for m in client.get_metric_history(mlrun.info.run_id, "cost/seconds_total")]
    assert len(seconds) == 2 and 0 < min(seconds)
    assert sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "eval/mean")) == [0, 2]
    # each evaluation with the training compute before it, at its step (eval/* against compute)
    at_eval = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "eval/nfe_total"))
    assert at_eval == [(0, 0.0), (2, hist["cost/nfe_total"][-1])]
    # the held-out reward with the cumulative NFEs as its step: any chart of it compares runs by compute
    evals = [m.value for m in sorted(client.get_metric_history(mlrun.info.run_id, "eval/mean"), key=lambda m: m.step)]
    by_nfe = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "heldout/reward_by_nfe"))
    assert by_nfe == [(0, evals[0]), (int(hist["cost/nfe_total"][-1]), evals[-1])]
    # and with the cumulative passes (forwards + 2 per backward row): the axis objectives compare on
    by_passes = sorted(
        (m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "heldout/reward_by_passes")
    )
    passes = max(m.value for m in client.get_metric_history(mlrun.info.run_id, "cost/passes_total"))
    assert by_passes == [(0, evals[0]), (int(passes), evals[-1])] and passes > hist["cost/nfe_total"][-1]
    assert mlrun.data.tags["stepgrpo.recipe"].startswith("stepwise@")
    # the run's description at the top of its page: the recipe and the held-out reward, not 84 params
    note = mlrun.data.tags["mlflow.note.content"]
    assert note.startswith("**stepwise @ remaining**") and "Paired gain" in note and "NFEs" in note
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"lora", "images"} <= artifacts
    # the evaluation grids are an image history (one per evaluation, at its step), captioned
    pngs = [a.path for a in client.list_artifacts(mlrun.info.run_id, "images") if a.path.endswith(".png")]
    assert sorted(int(p.split("+")[2]) for p in pngs) == [0, 2], pngs
    from PIL import Image

    grid = Image.open(run_dir / "eval" / "base.png")
    assert grid.width >= 4 * 128  # 4 held-out prompts, scaled-up tiles with a caption under each
    # the LoRA artifact is a directory that diffusers loads
    from diffusers import StableDiffusion3Pipeline

    lora_dir = client.download_artifacts(mlrun.info.run_id, "lora", str(run_dir.parent / "downloaded"))
    pipe = StableDiffusion3Pipeline.from_pretrained(trained["model_path"], text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(lora_dir)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())


def test_flow_and_task_runs_are_named_after_the_run_and_iteration(trained):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
    )

    # filtered on the server: the session's server holds every test's runs
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["tiny-a"])))
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        names = {t.name for t in client.read_task_runs(flow_run_filter=this_run)}
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-a-rewards", "tiny-a-summary"]))
        artifacts = client.read_artifacts(artifact_filter=keys)
    assert {"prompts", "evaluate base", "rollout iter_0", "update iter_1", "evaluate iter_1"} <= names, names
    # the reward table is published after every iteration, under one key
    tables = [a for a in artifacts if a.key == "tiny-a-rewards"]
    assert len(tables) == 2
    (summary,) = [a for a in artifacts if a.key == "tiny-a-summary"]
    assert "paired gain over the base (4 held-out prompts" in summary.data and "95 % interval" in summary.data


def test_inspect_shows_the_learning_diagnostics(trained):
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    result = CliRunner().invoke(app, ["inspect", trained["run_dir"]])
    assert result.exit_code == 0, result.output
    assert "learning diagnostics" in result.output
    columns = ("R SDE", "R ODE", "grp std", "clip by opt. step", "clip later k:frac", "0-grad", "signal")
    for column in (*columns, "grad energy k:share", "|LoRA-init|"):
        assert column in result.output, column
    assert "0:" in result.output and "2:" in result.output  # the energy share of trained steps 0..2
    # stored with the checkpoint: the clip per optimizer step of the batch (2 here; the first on-policy)
    import json

    state = json.loads((Path(trained["run_dir"]) / "checkpoints" / "iter_0" / "state.json").read_text())
    assert len(state["update"]["clip_frac_by_part"]) == 2 and state["update"]["clip_frac_by_part"][0] == 0.0
    assert len(state["update"]["zero_grad_frac_by_part"]) == 2


def test_inspect_shows_a_training_iterations_samples_as_a_picture(trained, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from stepgrpo.inspection import training_images
    from stepgrpo.storage.run import Run
    from stepgrpo_cli import app

    out = tmp_path / "samples.png"
    result = CliRunner().invoke(app, ["inspect", trained["run_dir"], "--images", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "6 training samples of iteration 1" in result.output and Image.open(out).width > 6 * 64
    pictures, captions = training_images(Run.open(Path(trained["run_dir"])), 1)
    assert pictures.shape[0] == len(captions) == 6 and "jpeg_compressibility" in captions[0]


def test_the_python_entry_returns_typed_results_and_reuses_what_the_run_stored(trained, tiny, calls, tmp_path):
    """`stepgrpo.train` on the stored run computes nothing and returns the flow's numbers, typed;
    `rescore`, `credit` and `evaluate` on a copy return typed results per iteration; `open_run` the
    stored run as data. Bad input fails before any flow, with the CLI's error."""
    import shutil

    import stepgrpo
    from stepgrpo.config import ConfigError
    from stepgrpo.results import CreditResult, EvaluateResult, ScoreResult

    again = stepgrpo.train(None, overrides=tiny, run_dir=trained["run_dir"])
    assert sum(calls.values()) == 0, calls
    assert isinstance(again, stepgrpo.TrainResult) and again.run_id == "tiny-a"
    assert [e.record() for e in again.evaluations] == [
        EvaluateResult.model_validate(e).record() for e in trained["evaluations"]
    ]
    mean, low, high = again.gain()
    assert low <= mean <= high
    gain = again.gain()  # a named result: fields, a readable form, and whether it is beyond noise
    assert gain.mean == mean and str(gain) == f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"
    assert gain.resolved == (low > 0 or high < 0)

    copy = tmp_path / "copy"
    shutil.copytree(trained["run_dir"], copy)
    scores = stepgrpo.rescore(copy, "jpeg_incompressibility", iterations=[1])
    assert [type(s) for s in scores] == [ScoreResult] and scores[0].iteration == 1
    credits = stepgrpo.credit(copy, "turning_point")
    assert [type(c) for c in credits] == [CreditResult, CreditResult] and credits[0].scheme == "turning_point"
    base = stepgrpo.evaluate(copy, iteration=-1)
    assert isinstance(base, EvaluateResult) and base.label == "base"
    assert base.reward_mean == again.evaluations[0].reward_mean  # the stored evaluation, reused
    run = stepgrpo.open_run(copy)
    assert run.iterations("rollout") == [0, 1] and {"jpeg_incompressibility"} <= set(
        run.tables.read_rewards().column("reward_name").to_pylist()
    )
    # each offline command is an MLflow run of its own, linked to the training run, with its table
    from mlflow.tracking import MlflowClient

    from stepgrpo.reporting.tracking import tracking_uri

    client = MlflowClient(tracking_uri=tracking_uri(copy))
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string="tags.`stepgrpo.parent_run_id` = 'tiny-a'"
    )
    by_kind = {r.data.tags["stepgrpo.kind"]: r for r in runs}
    assert {"rescore", "credit", "evaluate"} <= set(by_kind), by_kind.keys()
    assert by_kind["credit"].data.params["scheme"] == "turning_point"
    assert "credit/adv_std" in by_kind["credit"].data.metrics
    assert [a.path for a in client.list_artifacts(by_kind["rescore"].info.run_id)] == ["rescore.json"]
    stepgrpo.rescore(copy, "jpeg_incompressibility")  # again, now over both iterations: the same MLflow run
    table = json.loads(Path(client.download_artifacts(by_kind["rescore"].info.run_id, "rescore.json")).read_text())
    iterations = [row[table["columns"].index("iteration")] for row in table["data"]]
    assert sorted(iterations) == [0, 1]  # iteration 1's row once, not appended again
    with pytest.raises(ConfigError, match="unknown"):
        stepgrpo.train(None, overrides=[*tiny, "optim.nope=1"], run_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_the_mlflow_helper_of_an_offline_command_fails_loudly_and_stops_when_unused(trained, tmp_path, monkeypatch):
    """The helper process that writes an offline command's MLflow run (`stepgrpo.reporting.offline`)
    is stopped when the command ends without logging, and its failure fails the command, named."""
    import shutil

    from stepgrpo.errors import StageError
    from stepgrpo.flows import session
    from stepgrpo.reporting import offline

    copy = tmp_path / "copy"
    shutil.copytree(trained["run_dir"], copy)
    with offline.helper(copy):
        [(where, proc)] = offline._ACTIVE
        assert where == str(copy.resolve())
    assert proc.returncode is not None and not offline._ACTIVE
    with offline.helper(tmp_path / "not-a-run"):
        assert not offline._ACTIVE  # no run, no helper: the command says what is wrong
    assert "mlflow" in sys.modules  # this process trained: the Python API's commands write their own runs
    with session.offline_log(copy):
        assert not offline._ACTIVE
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://store")  # MLflow has no store for it
    record = {"kind": "credit", "experiment": "x", "name": "tiny-a credit x", "tags": {}, "params": {}}
    record |= {"rows": [{"iteration": 0, "adv_std": 1.0}], "metrics": ["adv_std"]}
    with offline.helper(copy), pytest.raises(StageError, match="writing the MLflow run of `credit` failed"):
        offline.log(copy, "tiny-a", record)


def test_rerunning_the_same_run_computes_nothing(trained, tiny, calls):
    from stepgrpo.flows.train import train

    again = train(overrides=tiny, run_dir=trained["run_dir"])
    assert sum(calls.values()) == 0, calls
    assert again["evaluations"] == trained["evaluations"]


def test_a_run_refuses_another_config(trained, tiny):
    from stepgrpo.flows.train import train

    with pytest.raises(StageError, match="changed: optim.lr"):
        train(overrides=[*tiny, "optim.lr=0.5"], run_dir=trained["run_dir"])


def test_a_finished_run_is_extended_by_more_iterations_and_never_shortened(trained, tiny, tmp_path, calls):
    """`run.iterations` 2 -> 3 on a finished run: its stored stages are reused as they are, one more
    iteration is trained and exported; fewer iterations than it trained is refused, naming why."""
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    copy = _copy(trained, tmp_path)
    before = {i: Run.open(copy).stage_manifest(i, "checkpoint")["digest"] for i in (0, 1)}
    out = train(overrides=[*tiny, "run.iterations=3", "run.eval_every=0"], run_dir=str(copy))
    assert calls["rollout"] == calls["update"] == 1, calls  # iteration 2 only
    run = Run.open(copy)
    assert {i: run.stage_manifest(i, "checkpoint")["digest"] for i in (0, 1)} == before
    assert run.iterations("checkpoint") == [0, 1, 2] and out["evaluations"][-1]["label"] == "iter_2"
    with pytest.raises(StageError, match="run.iterations=2 is fewer than the 3 iterations"):
        train(overrides=[*tiny, "run.iterations=2"], run_dir=str(copy))
    with pytest.raises(StageError, match="may change only run.iterations, run.eval_every"):
        train(overrides=[*tiny, "run.iterations=3", "optim.lr=0.5"], run_dir=str(copy))


def test_the_curriculum_draws_stored_prompts_by_gain_variance_and_resumes(harness, tiny, tmp_path, calls):
    import numpy as np

    from stepgrpo.flows.train import train
    from stepgrpo.loops.sampling import iteration_plan
    from stepgrpo.storage.run import Run
    from stepgrpo_core.curriculum import group_spread

    over = [*tiny, "curriculum.draw=gain_variance", "curriculum.window=2", "run.iterations=3"]
    run_dir = tmp_path / "curriculum"
    train(overrides=over, run_dir=str(run_dir))
    run, cfg = Run.open(run_dir), load_config(None, over)
    splits = stored_prompts(run).splits
    G = cfg.run.group_size
    for i in range(3):
        record = run.read_draw(i)
        assert record["window"] == [max(0, i - 2), i]
        stored_ids = run.stages.read_array(i, "rollout", "prompt_ids")
        assert stored_ids.tolist() == np.repeat(record["prompt_ids"], G).tolist()  # the rollout sampled the draw
    # no history at iteration 0: the uniform draw
    assert run.read_draw(0)["prompt_ids"] == iteration_plan(cfg, splits, 0).prompt_ids[::G].tolist()
    # iteration 2's weights follow the spread of its window's groups (iterations 0 and 1)
    record = run.read_draw(2)
    position = {p: n for n, p in enumerate(record["train_ids"])}
    spread = {}
    for j in (0, 1):
        first, v = group_spread(
            run.tables.reward_grid(j, "jpeg_compressibility"),
            torch.from_numpy(run.stages.read_array(j, "rollout", "group_ids")),
        )
        for row, value in zip(first.tolist(), v.tolist()):
            spread.setdefault(position[int(run.stages.read_array(j, "rollout", "prompt_ids")[row])], []).append(value)
    mean = {p: sum(v) / len(v) for p, v in spread.items()}
    average = sum(mean.values()) / len(mean)
    for p, m in mean.items():
        assert record["weights"][p] == pytest.approx(0.2 + 0.8 * m / average)
    assert record["seen"] == len(mean)
    unseen = set(range(len(record["train_ids"]))) - set(mean)
    assert all(record["weights"][p] == 1.0 for p in unseen)
    # the run resumes without drawing again; a uniform run has no draw stage
    calls.clear()
    train(overrides=over, run_dir=str(run_dir))
    assert sum(calls.values()) == 0, calls
    assert run.stage_manifest(0, "draw")["inputs"]["key"]


def test_a_uniform_run_draws_no_stage_and_keys_its_rollout_as_before(trained, tiny):
    from stepgrpo.results import DrawResult
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks.keys import stage_key

    run = Run.open(trained["run_dir"])
    assert run.stage_manifest(0, "draw") is None
    cfg = load_config(None, tiny)
    before = {"prompts": "p", "checkpoint": None, "psi": None}
    drawn = DrawResult(digest="d", iteration=0, prompt_ids=[0, 1], seen=0, zero_spread=0, weight_max=1.0)
    assert stage_key("rollout", run, cfg, 0, before) != stage_key("rollout", run, cfg, 0, {**before, "draw": drawn})
    # the published rollout's key is the one a key without a draw gives (runs made before resume)
    from stepgrpo.results import PromptsResult

    prompts = PromptsResult(digest=run.tables.prompts_manifest()["digest"], rows=run.tables.prompts_manifest()["rows"])
    key = stage_key("rollout", run, cfg, 0, {"prompts": prompts, "checkpoint": None, "psi": None})
    assert key.accepts(run.stage_manifest(0, "rollout")["inputs"]["key"])


def test_cache_keys_follow_the_contract(trained, tiny):
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks.keys import stage_key

    base = load_config(None, tiny)
    new_reward = load_config(None, [*tiny, "reward.name=jpeg_incompressibility"])
    new_scheme = load_config(None, [*tiny, "credit.scheme=dense"])
    inputs = {"rollout": "r", "checkpoint": "c"}
    run = Run.open(trained["run_dir"])
    key = lambda stage, conf: stage_key(stage, run, conf, 0, inputs)  # noqa: E731
    for stage in ("rollout", "complete"):
        assert key(stage, base) == key(stage, new_reward) == key(stage, new_scheme)
    assert key("score", base) != key("score", new_reward)
    assert key("score", base) == key("score", new_scheme)
    assert key("credit", base) != key("credit", new_scheme)
    assert key("credit", base) == key("credit", new_reward)  # its rewards digest input changes instead


@pytest.fixture
def decodes(monkeypatch) -> collections.Counter:
    """Counts VAE decodes (latent rows)."""
    from stepgrpo.policy.base import ImageDecoder

    counter: collections.Counter = collections.Counter()
    original = ImageDecoder.decode

    def counted(self, latents):
        counter["rows"] += len(latents)
        return original(self, latents)

    monkeypatch.setattr(ImageDecoder, "decode", counted)
    return counter


def test_rescore_adds_rows_without_a_transformer_call(trained, calls, decodes):
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.storage.run import Run

    pol = workspace.policy(load_config(None, _stored_overrides(trained)))
    before = pol.nfe
    out = rescore(trained["run_dir"], "jpeg_incompressibility")
    assert pol.nfe == before
    assert all(s["images"] == "stored" for s in out["scores"])  # the images the training reward saw
    assert decodes["rows"] == 0
    assert calls["score"] == 2 and calls["rollout"] == calls["complete"] == calls["update"] == 0
    names = set(Run.open(trained["run_dir"]).tables.read_rewards(0).column("reward_name").to_pylist())
    assert names == {"jpeg_compressibility", "jpeg_incompressibility"}
    again = rescore(trained["run_dir"], "jpeg_incompressibility")  # cached: nothing recomputed
    assert calls["score"] == 2 and again["scores"] == out["scores"]


def test_rescore_without_stored_images_loads_only_the_vae(trained, tmp_path, monkeypatch, decodes):
    import shutil

    from stepgrpo.flows.rescore import rescore
    from stepgrpo.storage.run import Run

    copy = tmp_path / "copy"
    shutil.copytree(trained["run_dir"], copy)
    for d in copy.glob("iter_*/images"):
        shutil.rmtree(d)
    monkeypatch.setattr(workspace, "_policies", {})  # a fresh process: nothing loaded
    monkeypatch.setattr(workspace, "_decoders", {})
    out = rescore(str(copy), "shapes")
    assert [s["images"] for s in out["scores"]] == ["decoded+stored"] * 2
    assert workspace._policies == {} and len(workspace._decoders) == 1  # the VAE alone was loaded
    # 2 iterations x 6 trajectories x 5 states, each distinct latent decoded once: a group's 3
    # trajectories share x_0 and so the completion of x_0 (2 groups x 2 repeats fewer)
    assert decodes["rows"] == 2 * (6 * 5 - 2 * 2)
    # decoding again gives the bytes the training run stored, so the rewards are the same
    ours, theirs = Run.open(copy), Run.open(trained["run_dir"])
    for i in (0, 1):
        assert (
            ours.stages.read_images(i, "completions/remaining").images.tobytes()
            == theirs.stages.read_images(i, "completions/remaining").images.tobytes()
        )
        assert torch.equal(
            ours.tables.reward_grid(i, "jpeg_compressibility"), theirs.tables.reward_grid(i, "jpeg_compressibility")
        )
    again = rescore(str(copy), "shapes", iterations=[0])  # cached task
    assert again["scores"][0] == out["scores"][0] and decodes["rows"] == 52


def test_credit_recomputes_advantages_from_stored_rewards(trained, calls):
    from stepgrpo.flows.credit import credit
    from stepgrpo.storage.run import Run

    out = credit(trained["run_dir"], "turning_point")
    assert calls["credit"] == 2 and calls["rollout"] == calls["complete"] == calls["score"] == 0
    run = Run.open(trained["run_dir"])
    schemes = set(run.tables.read_advantages(1).column("scheme").to_pylist())
    assert schemes == {"stepwise", "turning_point"}
    grid = run.tables.advantage_grid(1, "turning_point", out["advantages"][1]["options_digest"])
    assert grid.shape == (6, 4) and bool(torch.isfinite(grid).all())


def test_nan_rewards_fail_the_stage_naming_the_rows(trained, monkeypatch):
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.rewards import REWARDS
    from stepgrpo.storage.run import Run

    class NanReward:
        name, version = "nan_test", "1"

        def __call__(self, images, prompts, metadata):
            scores = torch.zeros(len(prompts))
            scores[1] = float("nan")
            return RewardOutput(scores=scores)

    # a reward registered as a plugin would be
    monkeypatch.setitem(REWARDS._items, "nan_test", NanReward)
    monkeypatch.setitem(REWARDS._facts, "nan_test", {"identity": lambda: ("nan_test", "1")})
    with pytest.raises(StageError, match=r"NaN/inf .*\(traj 0, k 1\)"):
        rescore(trained["run_dir"], "nan_test", iterations=[0])
    assert Run.open(trained["run_dir"]).tables.read_rewards(0, "nan_test").num_rows == 0


def test_evaluate_flow_reuses_the_stored_evaluation(trained, calls):
    from stepgrpo.flows.evaluate import evaluate

    out = evaluate(trained["run_dir"])
    assert calls["evaluate"] == 0 and out == trained["evaluations"][-1]
    base = evaluate(trained["run_dir"], iteration=-1, overrides=["run.eval_prompts=2"])
    assert calls["evaluate"] == 1 and base["prompts"] == 2


def test_psi_kernel_calibrates_then_trains(harness, tiny, tmp_path, calls):
    from stepgrpo.flows.train import train

    out = train(
        overrides=[
            *tiny,
            "sampler.kernel=psi",
            "credit.scheme=dense",
            "run.iterations=1",
            "calibration.rounds=2",
            "calibration.prompts=2",
            "sampler.sde_window_size=2",
        ],
        run_dir=str(tmp_path / "psi"),
    )
    psi = json.loads((tmp_path / "psi" / "calibration" / "psi.json").read_text())
    assert len(psi["psi"]) == 4 and [r["round"] for r in psi["rounds"]] == [-1, 0, 1]  # -1: the starting table
    start = psi["rounds"][0]["psi"]
    # calibrated with the training window: steps 0-1 moved by +-eps2 (0.1) a round, 2-3 (ODE) kept
    assert psi["psi"][2:] == start[2:]
    for k in (0, 1):
        moved = (psi["psi"][k] - start[k]) / 0.1
        assert abs(moved - round(moved)) < 1e-4 and round(moved) in (-2, 0, 2)
    assert calls["calibrate"] == 1 and out["iterations"][0]["iteration"] == 0


def test_outcome_without_completion_scores_final_samples_only(harness, tiny, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    out = train(
        overrides=[
            *tiny,
            "completion.method=null",
            "credit.scheme=outcome",
            "run.iterations=1",
            "optim.ema_decay=0.5",
            "optim.optimizer_steps=2",
            "sampler.sde_window_start=1",
            "sampler.sde_window_size=2",
        ],
        run_dir=str(tmp_path / "outcome"),
    )
    run = Run.open(out["run_dir"])
    assert set(run.tables.read_rewards(0).column("k").to_pylist()) == {0, 4}  # R_0: the ODE sample of x_0
    assert not (Path(out["run_dir"]) / "iter_0" / "completions").exists()
    assert list(run.stages.read_images(0, "rollout").k) == [0, 4]  # the ODE and the SDE final images only
    ckpt = run.checkpoints.load_checkpoint(0)
    assert set(ckpt.tensors) == {"lora", "optimizer", "ema", "rng", "signal"}  # signal: the summed half-gradients
    assert ckpt.state["update"]["trained_steps"] == 2.0
    # one compute axis: MLflow's cumulative NFEs count what `compare` and `inspect --json` count, the
    # ODE reference included (an outcome run scores R_0 on it)
    from mlflow.tracking import MlflowClient

    from stepgrpo.reporting.costs import iteration_costs

    client = MlflowClient(out["tracking_uri"])
    experiment = client.get_experiment_by_name("stepgrpo").experiment_id
    (mlrun,) = client.search_runs([experiment], filter_string="tags.`stepgrpo.run_id` = 'outcome'")
    (total,) = client.get_metric_history(mlrun.info.run_id, "cost/nfe_total")
    assert run.stage_manifest(0, "rollout")["inputs"]["nfe_ode"] > 0
    assert total.value == sum(row["nfe"] for row in iteration_costs(run))
    # and the same function gives the seconds axis: the live view sums what the stored stages say
    (seconds,) = client.get_metric_history(mlrun.info.run_id, "cost/seconds_total")
    assert seconds.value == pytest.approx(sum(row["seconds"] for row in iteration_costs(run)))
    # and the forward-equivalent passes (a backward row = 2 forwards): GRPO's update backpropagates
    # the policy's forward of each row, not the KL reference's
    (passes,) = client.get_metric_history(mlrun.info.run_id, "cost/passes_total")
    (row,) = iteration_costs(run)
    backward = run.stage_manifest(0, "checkpoint")["inputs"]["backward"]
    assert passes.value == row["passes"] == row["nfe"] + 2 * backward
    assert row["nfe_stages"]["update"] == 2 * backward  # kl_beta > 0: the policy's forward and the reference's


def test_states_after_the_sde_window_are_not_recomputed(harness, tiny, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.images import dequantize
    from stepgrpo.storage.run import Run
    from stepgrpo_core.completions import complete

    out = train(
        overrides=[*tiny, "completion.method=remaining", "run.iterations=1", "sampler.sde_window_size=2"],
        run_dir=str(tmp_path / "window"),
    )
    run = Run.open(out["run_dir"])
    m = run.stage_manifest(0, "completions/remaining")
    assert m["attrs"]["nfe"] == 6 * (4 + 3)  # B = 6; x_0 and x_1 need T - k steps, x_2.. x_4 are x_T
    grid = run.tables.reward_grid(0, "jpeg_compressibility")
    assert grid.shape == (6, 5) and bool(torch.isfinite(grid).all())  # every k has its row
    for k in (2, 3):
        assert torch.equal(grid[:, k], grid[:, 4])
    # the same as recomputing every state's completion
    cfg = load_config(None, [*tiny, "completion.method=remaining", "run.iterations=1", "sampler.sde_window_size=2"])
    pol = workspace.policy_at(run, cfg, 0)
    data = run.stages.read_rollout(0)
    texts, _, meta = stored_prompts(run)
    with torch.no_grad():
        full = complete(
            "remaining",
            pol.velocity,
            torch.from_numpy(data.states),
            torch.from_numpy(data.sigmas),
            encode(pol, texts, data.prompt_ids),
            64,
        )
    stored = run.stages.read_completion(0, "remaining").latents
    torch.testing.assert_close(full.latents, torch.from_numpy(stored), rtol=0, atol=1e-5)
    reward = workspace.reward(cfg.reward)
    images = dequantize(pol.decoder.decode_uint8(full.latents.reshape(30, *full.latents.shape[2:])))
    rows = data.prompt_ids.repeat(5)
    again = reward(images, [texts[int(p)] for p in rows], [meta[int(p)] for p in rows]).scores.reshape(6, 5)
    # latents equal to 1e-5 can still round to another 8-bit level in a pixel or two, which moves
    # the JPEG size (the reward, in kB) by a byte or so
    torch.testing.assert_close(again.double(), grid.double(), rtol=0, atol=3e-3)


def test_outcome_runs_store_the_ode_sample_of_each_group(harness, tiny, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run
    from stepgrpo_core.rollout import rollout

    overrides = [*tiny, "completion.method=null", "credit.scheme=outcome", "run.iterations=1"]
    out = train(overrides=overrides, run_dir=str(tmp_path / "ode"))
    run = Run.open(out["run_dir"])
    assert run.stage_manifest(0, "rollout")["inputs"]["nfe_ode"] == 2 * 4  # one ODE sample per group, T = 4
    data = run.stages.read_rollout(0)
    ode_final = torch.from_numpy(run.stages.read_array(0, "rollout", "ode_final"))
    cfg = load_config(None, overrides)
    pol = workspace.policy_at(run, cfg, 0)
    texts, _, _ = stored_prompts(run)
    ode = rollout(
        pol.velocity,
        torch.from_numpy(data.states[:, 0]),
        torch.from_numpy(data.sigmas),
        encode(pol, texts, data.prompt_ids),
        kernel="ode",
    ).states[:, -1]
    torch.testing.assert_close(ode_final, ode, rtol=0, atol=1e-5)
    grid = run.tables.reward_grid(0, "jpeg_compressibility")
    assert bool(torch.isfinite(grid[:, 0]).all()) and bool(torch.isfinite(grid[:, -1]).all())
    assert torch.equal(grid[0:3, 0], grid[0:1, 0].expand(3))  # shared within a group


def test_shared_x0_false_gives_each_member_its_own_noise_and_R0(harness, tiny, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    overrides = [*tiny, "completion.method=null", "credit.scheme=outcome", "run.iterations=1"]
    out = train(overrides=[*overrides, "sampler.shared_x0=false"], run_dir=str(tmp_path / "own"))
    run = Run.open(out["run_dir"])
    assert run.stage_manifest(0, "rollout")["inputs"]["nfe_ode"] == 6 * 4  # one ODE sample per member
    x0 = torch.from_numpy(run.stages.read_array(0, "rollout", "states")[:, 0]).reshape(6, -1)
    assert len({tuple(row.tolist()) for row in x0}) == 6  # no two members share x_0
    grid = run.tables.reward_grid(0, "jpeg_compressibility")
    assert len(set(grid[0:3, 0].tolist())) > 1  # R_0 per member
    # the shared default keys its rollout as runs made before the option (no field in its key)
    shared = train(overrides=overrides, run_dir=str(tmp_path / "shared"))
    assert (
        Run.open(shared["run_dir"]).stage_manifest(0, "rollout")["digest"] != run.stage_manifest(0, "rollout")["digest"]
    )
    # without the ODE reference: no pass, nothing stored, one image a trajectory scored, and the
    # same training (outcome credit reads R_T only): the same samples, advantages and weights
    bare = train(
        overrides=[*overrides, "sampler.shared_x0=false", "sampler.ode_reference=false"], run_dir=str(tmp_path / "bare")
    )
    lean = Run.open(bare["run_dir"])
    assert lean.stage_manifest(0, "rollout")["inputs"]["nfe_ode"] == 0
    assert not lean.stages.has_array(0, "rollout", "ode_final") and lean.stages.read_rollout(0).ode_final is None
    assert set(lean.tables.read_rewards(0).column("k").to_pylist()) == {4}
    assert list(lean.stages.read_images(0, "rollout").k) == [4]
    assert bool(torch.isnan(lean.tables.reward_grid(0, "jpeg_compressibility")[:, 0]).all())
    np.testing.assert_array_equal(
        lean.stages.read_array(0, "rollout", "states"), run.stages.read_array(0, "rollout", "states")
    )
    torch.testing.assert_close(lean.tables.reward_grid(0, "jpeg_compressibility")[:, -1], grid[:, -1], rtol=0, atol=0)
    torch.testing.assert_close(
        lean.checkpoints.load_checkpoint(0).tensors["lora"],
        run.checkpoints.load_checkpoint(0).tensors["lora"],
        rtol=0,
        atol=0,
    )
    assert lean.stage_manifest(0, "rollout")["digest"] != run.stage_manifest(0, "rollout")["digest"]
    # re-scored offline with another reward: the stored x_T images alone
    from stepgrpo.flows.rescore import rescore

    (scored,) = rescore(bare["run_dir"], "jpeg_incompressibility")["scores"]
    assert scored["images"] == "stored"
    assert set(lean.tables.read_rewards(0, "jpeg_incompressibility").column("k").to_pylist()) == {4}


def test_substeps_complete_the_window_s_last_state_by_the_same_method(harness, tiny, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    out = train(
        overrides=[*tiny, "completion.method=substeps:2", "run.iterations=1", "sampler.sde_window_size=2"],
        run_dir=str(tmp_path / "substeps"),
    )
    run = Run.open(out["run_dir"])
    m = run.stage_manifest(0, "completions/substeps-2")
    assert m["attrs"]["deterministic_from"] == 3  # x_0, x_1 and the window's last state x_2
    assert m["attrs"]["nfe"] == 6 * 2 * 3
    grid = run.tables.reward_grid(0, "jpeg_compressibility")
    assert torch.equal(grid[:, 3], grid[:, 4])  # after the window's last state: the sample's own reward
    assert not torch.equal(grid[:, 2], grid[:, 4])  # x_2 by 2 substeps, not by the rollout's own ODE


def test_rollout_step_rewards_cost_no_transformer_call_and_rescore_without_one(
    harness, tiny, tmp_path, monkeypatch, decodes
):
    """Completion `rollout`: the complete stage loads no policy and counts 0 NFEs; its latents are
    the Tweedie estimate `x_k - sigma_k v_k` of the velocities the rollout stored, computed by hand
    here; a stored run re-scored with another reward loads no transformer; the credit-quality
    check judges other methods on the same rows, with their NFEs."""
    import shutil

    from stepgrpo.flows.quality import credit_quality
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    sets = [*tiny, "credit.scheme=dense", "completion.method=rollout", "run.iterations=1", "sampler.sde_window_size=2"]
    import stepgrpo.tasks.complete

    counted: dict[str, int] = {}
    compute = stepgrpo.tasks.complete.compute

    def nfe_counted(*args, **kwargs):  # transformer rows of every loaded policy during the stage
        before = sum(p.nfe for p, _ in workspace._policies.values())
        compute(*args, **kwargs)
        counted["complete"] = sum(p.nfe for p, _ in workspace._policies.values()) - before

    def no_model(*args, **kwargs):
        raise AssertionError("the complete stage ran the model")

    monkeypatch.setattr(stepgrpo.tasks.complete, "compute", nfe_counted)
    monkeypatch.setattr(stepgrpo.tasks.complete, "complete_chunks", no_model)
    out = train(overrides=sets, run_dir=str(tmp_path / "rollout"))
    assert counted == {"complete": 0}
    run = Run.open(out["run_dir"])
    m = run.stage_manifest(0, "completions/rollout")
    assert m["attrs"]["nfe"] == 0 and m["attrs"]["deterministic_from"] == 3  # x_0, x_1 and the window's last
    data = run.stages.read_rollout(0)
    assert data.velocities.shape == (6, 4, *data.states.shape[2:])
    latents = run.stages.read_completion(0, "rollout").latents
    sigmas = data.sigmas.astype(np.float32)
    for k in range(3):  # x0_hat = x_k - sigma_k v_k, by hand from the stored arrays
        hand = data.states[:, k].astype(np.float32) - sigmas[k] * data.velocities[:, k].astype(np.float32)
        np.testing.assert_array_equal(latents[:, k], hand.astype(latents.dtype))
    np.testing.assert_array_equal(latents[:, 3], data.states[:, -1])  # after the window: the sample itself
    # the rollout's velocities are the policy's: the same as `tweedie` recomputing them
    pol = workspace.policy_at(run, load_config(None, sets), 0)
    x = torch.from_numpy(data.states[:, 1]).to(pol.dtype)
    cond = encode(pol, stored_prompts(run).texts, data.prompt_ids)
    v = pol.velocity(x, torch.full((6,), float(sigmas[1])), cond)
    torch.testing.assert_close(v, torch.from_numpy(data.velocities[:, 1]), rtol=1e-4, atol=1e-5)
    listed = json.loads(_cli_json(out["run_dir"]))
    costs = [it["nfe_stages"] for it in listed["iterations"]]
    assert costs[0]["complete"] == 0 and costs[0]["rollout"] == 6 * 4
    # the diagnostics table's numbers, clipping included, for scripts
    (diag,) = listed["diagnostics"]
    assert diag["iteration"] == 0 and "clip_frac_first" in diag and "clip_frac_later_by_step" in diag
    stored = Run.open(out["run_dir"]).checkpoint_state(0)["update"]
    assert diag["clip_frac_first"] == UpdateStats.model_validate(stored).clip_frac_first

    copy = tmp_path / "copy"
    shutil.copytree(out["run_dir"], copy)
    for d in copy.glob("iter_*/images"):
        shutil.rmtree(d)
    monkeypatch.setattr(workspace, "_policies", {})  # a fresh process: nothing loaded
    monkeypatch.setattr(workspace, "_decoders", {})
    scored = rescore(str(copy), "shapes")
    assert [s["images"] for s in scored["scores"]] == ["decoded+stored"]
    assert workspace._policies == {} and len(workspace._decoders) == 1  # the VAE alone

    check = credit_quality(
        out["run_dir"], iteration=0, continuations=2, schemes=["outcome", "dense"], methods=["tweedie", "remaining"]
    )
    names = [r["scheme"] for r in check["gradient"]["uniform"]["rows"]]
    assert names == ["outcome", "dense", "dense:tweedie", "dense:remaining"]
    assert {k: v["nfe_per_trajectory"] for k, v in check["methods"].items()} == {
        "rollout": 0.0,
        "tweedie": 3.0,
        "remaining": 4.0 + 3.0,  # x_0, x_1: from the window's end on the ODE completion is the sample
    }
    rows = {r["scheme"]: r for r in check["gradient"]["uniform"]["rows"]}
    assert rows["dense"]["raw"] == pytest.approx(rows["dense:tweedie"]["raw"], abs=1e-6)  # the same estimate


def test_the_oracle_bound_trains_on_monte_carlo_true_advantages(harness, tiny, tmp_path):
    """bench/_lib/oracle.py (benchmark only): every state's value from continuations with common random
    numbers, stored as value rows; the oracle scheme's advantages through the ordinary credit stage
    are `A*` at outcome's scale on the trained steps; the update trains on them."""
    from bench._lib.oracle import ORACLE, oracle_train
    from stepgrpo.storage.run import Run
    from stepgrpo_core.quality import oracle_advantages
    from stepgrpo_core.registry import allow

    sets = [*tiny, "run.iterations=1", "sampler.sde_window_size=2"]
    out = oracle_train(None, sets, str(tmp_path / "oracle"), 2)
    allow(ORACLE)
    run = Run.open(out["run_dir"])
    values = run.tables.reward_grid(0, "jpeg_compressibility-value")
    finals = run.tables.reward_grid(0, "jpeg_compressibility")[:, -1]
    assert torch.equal(values[:, -1], finals) and torch.equal(values[:, 2], finals)  # x_2 on: deterministic
    assert not torch.equal(values[:, 0], values[:, 1])
    adv = run.tables.read_advantages(0, ORACLE).to_pandas().sort_values(["traj", "k"])
    trained = torch.tensor([True, True, False, False])
    expected = oracle_advantages(values.double(), trained).reshape(-1).numpy()
    np.testing.assert_allclose(adv["value"].to_numpy(), expected, rtol=1e-5, atol=1e-6)
    assert run.stage_manifest(0, "checkpoint") is not None


def _cli_json(run_dir: str) -> str:
    """`stepgrpo inspect RUN --json`'s output."""
    from typer.testing import CliRunner

    from stepgrpo_cli.app import app

    result = CliRunner().invoke(app, ["inspect", run_dir, "--json"])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_credit_quality_is_stored_reused_and_computed_again_when_damaged(trained, monkeypatch):
    from stepgrpo.flows.quality import credit_quality
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks import quality

    out = credit_quality(run=trained["run_dir"], iteration=1, continuations=2)
    # every scheme judged but those that credit a branched rollout's nodes or siblings (this run branches not)
    from stepgrpo_core.credit import SCHEMES, reads_branch, reads_tree

    branched = [s for s in SCHEMES.names() if reads_tree(s) or reads_branch(s)]
    assert {"dense", "outcome", "stepwise", "turning_point"} <= set(out["schemes"])
    assert not set(out["schemes"]) & set(branched)
    assert sorted(s.split(":")[0] for s in out["skipped"]) == sorted(branched)
    assert [r["step"] for r in out["steps"]] == [0, 1, 2]  # the trained steps (T = 4, the final one not)
    assert out["nfe"] == 6 * 2 * (4 + 3 + 2 + 1)  # B x M continuations of x_0 .. x_3
    assert out["score_rows"] == 6 * 3 and out["groups"] == 2
    for label in ("uniform", "noise"):
        rows = {r["scheme"]: r for r in out["gradient"][label]["rows"]}
        assert set(rows) == set(out["schemes"]) and "diff" not in rows["outcome"] and "diff" in rows["dense"]
    values = torch.tensor(out["values"], dtype=torch.float64)
    grid = Run.open(trained["run_dir"]).tables.reward_grid(1, "jpeg_compressibility").double()
    torch.testing.assert_close(values[:, -1], grid[:, -1])  # V(x_T) = R_T
    record = Path(out["record"])
    assert record.parent.name == "credit_quality" and record.is_file()
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    shown = CliRunner().invoke(app, ["inspect", trained["run_dir"]])
    assert shown.exit_code == 0 and "credit quality iter_1 (M = 2, 2 groups): dense" in shown.output

    def no_compute(*args, **kwargs):
        raise AssertionError("a stored check was computed again")

    with monkeypatch.context() as m:
        m.setattr(quality, "compute", no_compute)
        again = credit_quality(run=trained["run_dir"], iteration=1, continuations=2)
    assert again["values"] == out["values"] and again["seconds"] == out["seconds"]
    # a damaged record is found by verify, set aside, and computed again to the same numbers
    data = json.loads(record.read_text())
    data["gradient"]["uniform"]["rows"][0]["cosine"] = 0.999
    record.write_text(json.dumps(data))
    problems = Run.open(trained["run_dir"]).verify_all()
    assert any("credit_quality" in what for what, _ in problems)
    redone = credit_quality(run=trained["run_dir"], iteration=1, continuations=2)
    assert redone["values"] == out["values"] and redone["gradient"] == out["gradient"]
    assert any(p.name.startswith(record.name) and p != record for p in record.parent.iterdir())  # the kept copy
    # logged as an MLflow run of its own, tagged with its parent
    from mlflow.tracking import MlflowClient

    client = MlflowClient(trained["tracking_uri"])
    exp = client.get_experiment_by_name("stepgrpo")
    (child,) = client.search_runs([exp.experiment_id], filter_string="tags.`stepgrpo.kind` = 'credit-quality'")
    assert child.data.tags["stepgrpo.parent_run_id"] == "tiny-a"
    assert "gradient_uniform/dense/cosine" in child.data.metrics


def test_a_stopped_credit_quality_check_resumes_at_the_first_unfinished_state(trained, monkeypatch):
    from stepgrpo.flows.quality import credit_quality
    from stepgrpo.loops import judging as quality  # the check's continuation loop

    original, seen = quality.continue_states, []

    def stop_at_two(*args, **kwargs):
        k = args[3]
        seen.append(k)
        if k == 2 and stop:
            raise RuntimeError("stopped at state 2")
        return original(*args, **kwargs)

    monkeypatch.setattr(quality, "continue_states", stop_at_two)
    stop = True
    with pytest.raises(RuntimeError, match="stopped at state 2"):
        credit_quality(run=trained["run_dir"], iteration=0, continuations=2, seed=5)
    stop, seen[:] = False, []
    out = credit_quality(run=trained["run_dir"], iteration=0, continuations=2, seed=5)
    assert min(seen) == 2  # states 0 and 1 were read back
    assert out["nfe"] == 6 * 2 * (4 + 3 + 2 + 1)  # counted as if computed
    assert not any(p.name.startswith(".partial") for p in Path(out["record"]).parent.iterdir())


def _stored_overrides(trained: dict) -> list[str]:
    from stepgrpo.storage.run import Run

    cfg = Run.open(trained["run_dir"]).config
    return [
        f"{k}={json.dumps(v)}"
        for k, v in load_config(None, []).model_validate(cfg).flat().items()
        if not k.endswith(".options")
    ]


SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shapes"


@pytest.mark.skipif(not (SHIPPED / "model_index.json").is_file(), reason="the shipped shapes model is not built yet")
def test_end_to_end_on_the_shipped_shapes_model(harness, tmp_path):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    out = train(
        config_path=str(SHIPPED.parents[1] / "configs" / "demo.yaml"),
        run_dir=str(tmp_path / "shapes"),
        overrides=[
            "reward.name=shapes",
            "run.iterations=2",
            "run.prompts_per_iteration=2",
            "run.group_size=4",
            "run.eval_prompts=8",
            "sampler.steps=4",
            "sampler.eval_steps=4",
        ],
    )
    assert [e["label"] for e in out["evaluations"]] == ["base", "iter_1"]
    for e in out["evaluations"]:
        assert 0.0 <= e["reward_mean"] <= 1.0 and 0.0 <= e["reward_strict"] <= 1.0
    grid = Run.open(out["run_dir"]).tables.reward_grid(1, "shapes")
    # the demo is outcome credit: R_0 (the ODE sample of each group's noise) and R_T are scored
    assert grid.shape == (8, 5) and bool(torch.isfinite(grid[:, [0, 4]]).all()) and bool(grid[:, 1:4].isnan().all())


def test_full_fine_tuning_of_the_shipped_model_checkpoints_and_exports_the_transformer(harness, tmp_path, calls):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    over = [
        "model.finetune=full",
        "optim.ema_decay=0.5",
        "optim.kl_reference=ema",
        "optim.kl_beta=0.01",
        "optim.lr=1e-4",
        "optim.lr_schedule=warmup",
        "optim.warmup_iterations=2",
        "run.iterations=2",
        "run.prompts_per_iteration=2",
        "run.group_size=4",
        "run.eval_prompts=4",
        "sampler.steps=4",
        "sampler.eval_steps=4",
    ]
    out = train(
        config_path=str(SHIPPED.parents[1] / "configs" / "demo.yaml"), run_dir=str(tmp_path / "full"), overrides=over
    )
    run = Run.open(out["run_dir"])
    files = sorted(p.name for p in run.stage_path(1, "checkpoint").iterdir())
    assert "transformer.safetensors" in files and "ema.safetensors" in files and "lora.safetensors" not in files
    weights = load_file(str(run.stage_path(1, "checkpoint") / "ema.safetensors"))
    exported = SD3Transformer2DModel.from_pretrained(out["run_dir"] + "/transformer")
    assert set(weights) == {n for n, _ in exported.named_parameters()}  # every weight was trained
    assert all(torch.equal(p, weights[n]) for n, p in exported.named_parameters())  # the EMA is what is exported
    base = SD3Transformer2DModel.from_pretrained(str(SHIPPED / "transformer"))
    assert any(not torch.equal(p, dict(base.named_parameters())[n]) for n, p in exported.named_parameters())
    calls.clear()
    train(config_path=str(SHIPPED.parents[1] / "configs" / "demo.yaml"), run_dir=str(tmp_path / "full"), overrides=over)
    assert sum(calls.values()) == 0, calls  # resumes from its checkpoints like a LoRA run


def test_the_credit_flow_loads_no_model(trained, monkeypatch):
    from stepgrpo import rewards
    from stepgrpo.flows.credit import credit

    def refuse(*args, **kwargs):
        raise AssertionError("the credit flow loaded a model")

    for name in ("policy", "decoder", "model_identity"):
        monkeypatch.setattr(workspace, name, refuse)
    monkeypatch.setattr(rewards, "build_reward", refuse)
    out = credit(trained["run_dir"], "dense")
    assert [a["scheme"] for a in out["advantages"]] == ["dense", "dense"]


# ------------------------------------------------- the run directory is the truth (issue: reliability)


def _copy(trained: dict, tmp_path: Path, name: str = "copy") -> Path:
    import shutil

    copy = tmp_path / name
    shutil.copytree(trained["run_dir"], copy)
    return copy


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x10
    path.write_bytes(bytes(data))


def _edit_a_value(part: Path) -> None:
    """Change one reward value of a Parquet part, keeping the file valid (a flipped value byte)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(part)
    values = table.column("value").to_pylist()
    values[0] += 1.0
    pq.write_table(table.set_column(table.schema.get_field_index("value"), "value", pa.array(values)), part)


def test_planted_result_records_run_nothing(trained, tiny, tmp_path, calls):
    """Records that made Prefect unpickle code on resume (a record naming its own serializer) are
    never read: stage tasks persist nothing and Prefect reads nothing from a run directory."""
    import base64
    import pickle

    from stepgrpo.flows.rescore import rescore
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    copy = _copy(trained, tmp_path)
    sentinel = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(sentinel)!r}, 'w').write('ran')",))

    record = {
        "metadata": {
            "storage_key": "k",
            "expiration": None,
            "serializer": {"type": "pickle", "picklelib": "pickle"},
            "prefect_version": "3",
            "storage_block_id": None,
        },
        "result": base64.b64encode(pickle.dumps(Payload())).decode(),
    }
    planted = copy / "prefect-results"
    planted.mkdir(exist_ok=True)
    for name in [p.name for p in planted.iterdir()] + ["rescore", "score", "rollout", "0" * 64]:
        (planted / name).write_text(json.dumps(record))
    again = train(overrides=tiny, run_dir=str(copy))
    rescored = rescore(str(copy), "jpeg_compressibility")
    assert not sentinel.exists()
    assert sum(calls.values()) == 0  # resumed from the stored stages, nothing computed
    assert [e["reward_mean"] for e in again["evaluations"]] == [e["reward_mean"] for e in trained["evaluations"]]
    assert [s["reward_mean"] for s in rescored["scores"]] == [
        float(Run.open(copy).tables.reward_grid(i, "jpeg_compressibility")[:, -1].mean()) for i in (0, 1)
    ]


def test_a_moved_run_resumes_rescores_and_recredits(trained, tiny, tmp_path, calls):
    from stepgrpo.flows.credit import credit
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.flows.train import train

    moved = _copy(trained, tmp_path, "elsewhere")
    exported = (moved / "lora" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns
    again = train(overrides=tiny, run_dir=str(moved))
    assert sum(calls.values()) == 0, calls
    assert (moved / "lora" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns == exported  # not rewritten
    assert [e["scores"] for e in again["evaluations"]] == [e["scores"] for e in trained["evaluations"]]
    rescore(str(moved), "jpeg_incompressibility")
    credit(str(moved), "dense")
    assert calls["score"] <= 2 and calls["rollout"] == calls["update"] == 0


def test_resume_recomputes_a_damaged_stage_and_keeps_the_damaged_copy(trained, tiny, tmp_path, calls):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    copy = _copy(trained, tmp_path)
    run = Run.open(copy)
    digest = run.stage_manifest(1, "rollout")["digest"]
    chunk = sorted((copy / "iter_1" / "rollout.zarr" / "states").glob("c.*"))[-1]
    _flip(chunk)
    (copy / "iter_0" / "completions" / "remaining.zarr" / "_published.json").unlink()  # a half-deleted stage
    part = copy / "rewards" / f"part-{run.tables.rewards_digest(0, 'jpeg_compressibility', '1')[:32]}.parquet"
    _edit_a_value(part)
    train(overrides=tiny, run_dir=str(copy))
    assert calls["rollout"] == 1 and calls["complete"] == 1 and calls["score"] == 1, calls
    assert calls["update"] == 0  # the recomputed stages have the digests their downstream stages were keyed on
    run = Run.open(copy)
    assert run.stage_manifest(1, "rollout")["digest"] == digest and run.verify_all() == []
    assert list((copy / "iter_1").glob("rollout.zarr.damaged-*")) and list((copy / "rewards").glob("part-*.damaged-*"))


def test_offline_flows_and_verify_detect_a_flipped_byte(trained, tmp_path):
    from typer.testing import CliRunner

    from stepgrpo.flows.credit import credit
    from stepgrpo.flows.evaluate import evaluate
    from stepgrpo.flows.rescore import rescore
    from stepgrpo_cli import app

    copy = _copy(trained, tmp_path)
    _flip(sorted((copy / "iter_0" / "rollout.zarr" / "states").glob("c.*"))[0])
    with pytest.raises(StageError, match="iteration 0 rollout"):
        rescore(str(copy), "shapes")
    with pytest.raises(StageError, match="iteration 0 rollout"):
        credit(str(copy), "dense")
    result = CliRunner().invoke(app, ["inspect", str(copy), "--verify"])
    assert result.exit_code == 1 and "iteration 0 rollout" in result.output
    _flip(copy / "checkpoints" / "iter_1" / "lora.safetensors")
    with pytest.raises(StageError, match="checkpoint 1"):
        evaluate(str(copy))
    clean = CliRunner().invoke(app, ["inspect", trained["run_dir"], "--verify"])
    assert clean.exit_code == 0 and "verify" in clean.output


def test_a_second_process_is_refused_while_one_owns_the_run(trained, tmp_path):
    import subprocess
    import sys
    import time

    from stepgrpo.runs import owned

    copy = _copy(trained, tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from stepgrpo.runs import owned\nimport time\nwith owned({str(copy)!r}):\n"
            "    print('held', flush=True)\n    time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StageError, match=f"in use: held by pid {holder.pid}"):
            with owned(copy):
                pass
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.2)
    with owned(copy):  # the kernel released the dead holder's lock
        pass


def test_retention_prunes_finished_iterations_and_the_run_still_resumes(harness, tiny, tmp_path, calls):
    from typer.testing import CliRunner

    from stepgrpo.flows.credit import credit
    from stepgrpo.flows.evaluate import evaluate
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.flows.train import train
    from stepgrpo.storage.pruned import PrunedError
    from stepgrpo.storage.run import Run
    from stepgrpo_cli.app import app

    keep = [*tiny, "run.iterations=3", "storage.keep=last", "storage.keep_last=1", "storage.checkpoint_every=2"]
    run_dir = tmp_path / "pruned"
    train(overrides=keep, run_dir=str(run_dir))
    run = Run.open(run_dir)
    for i in (0, 1):  # finished, and older than the last one: latents, completions and images gone
        assert not (run.stage_path(i, "rollout") / "states").exists()
        assert run.pruned(i, "rollout")["removed"] == ["states", "ode_final", "velocities"]
        assert run.pruned(i, "completions/remaining")["removed"] == ["latents"]
        assert run.pruned(i, "images/remaining") is not None
        assert run.stages.read_array(i, "rollout", "group_ids").shape == (6,)  # the plan and log-probs stay
    assert run.pruned(2, "rollout") is None and run.stages.read_rollout(2).states.shape[0] == 6
    # checkpoints: iter_1 (every 2nd) and iter_2 (the latest, evaluated) keep their weights
    assert "lora" in run.pruned(0, "checkpoint")["removed"]
    assert run.pruned(1, "checkpoint") is None and run.pruned(2, "checkpoint") is None
    assert run.verify_all() == []  # what a pruned stage kept still verifies

    calls.clear()
    train(overrides=keep, run_dir=str(run_dir))  # resumes over the pruned iterations
    assert sum(calls.values()) == 0, calls
    assert len(credit(str(run_dir), "outcome")["advantages"]) == 3  # the tables suffice
    with pytest.raises(StageError, match=r"iteration\(s\) \[0, 1\] were pruned .*iterations that keep them: \[2\]"):
        rescore(str(run_dir), "shapes")
    assert len(rescore(str(run_dir), "shapes", iterations=[2])["scores"]) == 1
    with pytest.raises(PrunedError, match="checkpoint iteration 0.*pruned"):
        evaluate(str(run_dir), iteration=0, overrides=["run.eval_prompts=2"])

    # `stepgrpo prune` applies other settings to the existing run and says what it freed
    result = CliRunner().invoke(app, ["prune", str(run_dir), "--keep", "tables", "--dry-run"])
    assert result.exit_code == 0 and "would prune iteration 2 rollout" in result.output, result.output
    assert Run.open(run_dir).pruned(2, "rollout") is None
    result = CliRunner().invoke(app, ["prune", str(run_dir), "--keep", "tables"])
    assert result.exit_code == 0 and "freed" in result.output and "MiB" in result.output, result.output
    assert Run.open(run_dir).pruned(2, "rollout")["why"].startswith("stepgrpo prune: keep=tables")
    result = CliRunner().invoke(app, ["rescore", str(run_dir), "--reward", "shapes"])
    assert result.exit_code == 1 and "cannot be re-scored" in result.output, result.output


EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "stepgrpo-redness"


def test_an_installed_plugin_rescores_and_recredits_a_stored_run_offline(
    trained, tmp_path, monkeypatch, calls, decodes
):
    """The example package, installed (offline, into a folder of its own), is found by its entry
    points: `redness` re-scores the stored images (no transformer, no VAE), `group_rank` re-credits."""
    import shutil
    import subprocess
    import sys

    from stepgrpo.flows.credit import credit
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.storage.run import Run

    site = tmp_path / "site"
    source = shutil.copytree(EXAMPLE_PLUGIN, tmp_path / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(source)], check=True, capture_output=True)  # builds in src
    monkeypatch.syspath_prepend(str(site))
    run_dir = shutil.copytree(trained["run_dir"], tmp_path / "run")
    monkeypatch.setattr(workspace, "_policies", {})  # a fresh process: nothing loaded
    monkeypatch.setattr(workspace, "_decoders", {})

    out = rescore(str(run_dir), "redness", {"sharpness": 2.0})
    assert workspace._policies == {} and workspace._decoders == {} and decodes["rows"] == 0
    assert calls["score"] == 2 and calls["rollout"] == calls["complete"] == calls["update"] == 0
    version = "1+" + options_digest({"sharpness": 2.0})[:8]  # the options are part of the rows' identity
    assert {(s["reward_name"], s["reward_version"]) for s in out["scores"]} == {("redness", version)}
    run = Run.open(run_dir)
    grid = run.tables.reward_grid(0, "redness")
    assert torch.isfinite(grid).all() and grid.shape[0] == run.stage_manifest(0, "rollout")["counts"]["trajectories"]
    credited = credit(str(run_dir), "group_rank", reward="redness")
    assert [a["scheme"] for a in credited["advantages"]] == ["group_rank"] * 2
    assert run.tables.advantage_grid(0, "group_rank").abs().sum() > 0
    # the same objects by reference, without the entry points: the identity (and so the rows) is the same
    again = rescore(str(run_dir), "stepgrpo_redness:Redness", {"sharpness": 2.0})
    assert again["scores"] == out["scores"] and calls["score"] == 2  # cached: nothing scored again
    other = rescore(str(run_dir), "redness", {"sharpness": 3.0})  # other options: new rows, never the old ones
    assert calls["score"] == 4 and {s["reward_version"] for s in other["scores"]} != {version}
    assert not torch.equal(
        run.tables.reward_grid(0, "redness", version),
        run.tables.reward_grid(0, "redness", other["scores"][0]["reward_version"]),
    )


def _flip_key_bit(manifest: Path) -> None:
    """Flip one bit of the stage key recorded in a `_published.json` (the JSON stays valid)."""
    text = manifest.read_text()
    key = json.loads(text)["inputs"]["key"]
    flipped = key[:-1] + ("1" if key[-1] != "1" else "0")
    manifest.write_text(text.replace(key, flipped))


DAMAGE = {
    # name: (how to damage a copy of the trained run, what `inspect --verify` names)
    "a flipped bit of a stage key": (
        lambda r: _flip_key_bit(r / "iter_1" / "rollout.zarr" / "_published.json"),
        "iteration 1 rollout",
    ),
    "a flipped byte of the exported LoRA": (lambda r: _flip(r / "lora" / "pytorch_lora_weights.safetensors"), "lora"),
    "a truncated exported LoRA": (
        lambda r: (r / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"x"),
        "lora",
    ),
    "an edited evaluation record": (
        lambda r: (r / "eval" / "base.json").write_text(
            (r / "eval" / "base.json").read_text().replace('"label"', '"label" ', 1).replace("0.", "1.", 1)
        ),
        "eval/base.json",
    ),
    "a garbled retention record": (
        lambda r: (r / "iter_0" / "rollout.zarr" / "_pruned.json").write_text("{garbled"),
        "_pruned.json",
    ),
    "JSON nested thousands deep": (
        lambda r: (r / "iter_0" / "rollout.zarr" / "_published.json").write_text("[" * 5000 + "]" * 5000),
        "_published.json",
    ),
    "a 5000-digit integer": (
        lambda r: (r / "checkpoints" / "iter_0" / "_published.json").write_text('{"n": ' + "9" * 5000 + "}"),
        "_published.json",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_every_stored_file_a_command_reads_is_verified_or_named(trained, tmp_path, case):
    """`inspect --verify` names the damaged file; `inspect` and `runs` name it or carry on; a stray
    `iter_-1/` folder is not read."""
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    damage, named = DAMAGE[case]
    copy = _copy(trained, tmp_path, "r")
    (copy / "iter_-1").mkdir()
    clean = CliRunner().invoke(app, ["inspect", str(copy), "--verify"])
    assert clean.exit_code == 0, clean.output
    damage(copy)
    result = CliRunner().invoke(app, ["inspect", str(copy), "--verify"])
    assert result.exit_code == 1 and named in result.output, (case, result.output)
    shown = CliRunner().invoke(app, ["inspect", str(copy)])  # shows the run, or stops naming the damaged file
    assert shown.exception is None or isinstance(shown.exception, SystemExit), shown.output
    assert shown.exit_code == 0 or (str(copy) in shown.output and "damaged" in shown.output), shown.output
    listed = CliRunner().invoke(app, ["runs", "--root", str(tmp_path)])
    assert listed.exit_code == 0 and "r" in listed.output, listed.output


def test_a_key_mismatch_shows_both_whole_keys(trained, tiny, tmp_path):
    from stepgrpo.tasks.base import check_key
    from stepgrpo.tasks.keys import Key

    with pytest.raises(StageError) as err:
        check_key("a" * 64, Key("b" * 64, "c" * 64), "iteration 0 rollout")
    assert "a" * 64 in str(err.value) and "b" * 64 in str(err.value)


def test_rescore_finds_the_completions_of_a_substeps_run(trained, tmp_path):
    """The stored folder of `substeps:5` is `completions/substeps-5`: a re-score finds it."""
    from stepgrpo.runs import check_rescorable
    from stepgrpo.storage.run import Run

    copy = _copy(trained, tmp_path)
    (copy / "iter_0" / "completions" / "remaining.zarr").rename(copy / "iter_0" / "completions" / "substeps-5.zarr")
    check_rescorable(Run.open(copy), "substeps:5", [0])  # raised "completion method 'substeps:5' must match"


def test_the_exported_lora_is_readable_carries_a_model_card_and_pushes_to_the_hub(trained, tmp_path, monkeypatch):
    """`lora/` as a colleague gets it: every file readable by others (as `save_pretrained` writes
    them), a hub model card (base model, scheme, reward, iterations, the held-out gain with its
    interval, the command, a sample grid) and the config it names; `stepgrpo export --push-to-hub`
    uploads the folder, its own seal left out, through `huggingface_hub` (a local stand-in here)."""
    import shutil
    import stat

    import huggingface_hub
    import yaml
    from typer.testing import CliRunner

    from stepgrpo.storage.run import Run
    from stepgrpo_cli import app

    run_dir = tmp_path / "tiny-a"
    shutil.copytree(trained["run_dir"], run_dir)
    lora = run_dir / "lora"
    names = {p.name for p in lora.iterdir()}
    assert {"pytorch_lora_weights.safetensors", "README.md", "samples.png", "config.yaml"} <= names
    for f in lora.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f"{f.name} is not readable by others"
    card = (lora / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    # a local base: no hub id claimed, no path of this machine published (the card, config.yaml)
    assert "base_model" not in meta and "base-model-local" in meta["tags"] and meta["library_name"] == "diffusers"
    assert "lora" in meta["tags"] and "credit-stepwise" in meta["tags"]
    assert str(tmp_path.parent) not in card and str(Path(trained["model_path"]).parent) not in card
    exported = yaml.safe_load((lora / "config.yaml").read_text())
    assert exported["run"]["runs_root"] == "runs" and exported["model"]["path"] == Path(trained["model_path"]).name
    for text in ("jpeg_compressibility", "| iterations | 2 x", "Paired gain", "95 % interval", "(samples.png)"):
        assert text in card, text
    assert "stepgrpo train --config config.yaml --run-id tiny-a" in card
    assert yaml.safe_load((lora / "config.yaml").read_text())["credit"]["scheme"] == "stepwise"
    # the card's "Use" block, as a colleague runs it: the base model, then this LoRA
    use = card.split("```python\n", 1)[1].split("```", 1)[0].replace("path/to/this/folder", str(lora))
    use = use.replace("path/to/the/base/model", trained["model_path"])
    namespace: dict = {}
    exec(use, namespace)
    adapters = namespace["pipe"].get_list_adapters()
    assert adapters and any(adapters.values()), adapters
    # and it samples as the run evaluated: the run's steps and guidance
    stored = yaml.safe_load((lora / "config.yaml").read_text())
    assert f"num_inference_steps={stored['sampler']['eval_steps']}" in use and namespace["image"].size
    assert "pipe.fuse_lora()" in card and 'pipe.save_pretrained("merged")' in card

    pushed: dict = {}

    class LocalHub:  # the hub's client, writing into a folder
        def create_repo(self, repo_id, repo_type, private, exist_ok):
            pushed.update(repo=repo_id, private=private)
            return f"local://{repo_id}"

        def upload_folder(self, repo_id, folder_path, ignore_patterns, commit_message):
            target = tmp_path / "hub" / repo_id
            shutil.copytree(folder_path, target, ignore=shutil.ignore_patterns(*ignore_patterns))
            pushed["message"] = commit_message

    monkeypatch.setattr(huggingface_hub, "HfApi", LocalHub)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    result = CliRunner().invoke(app, ["export", str(run_dir), "--push-to-hub", "me/tiny-lora", "--private"])
    assert result.exit_code == 0, result.output
    assert pushed == {"repo": "me/tiny-lora", "private": True, "message": "stepgrpo export of run tiny-a"}
    hub = tmp_path / "hub" / "me" / "tiny-lora"
    assert sorted(p.name for p in hub.iterdir()) == sorted(names - {"_export.json"})
    assert Run.open(run_dir).verify_all() == []  # the export's seal still holds


def test_export_rebuilds_a_deleted_lora_and_exports_an_earlier_checkpoint(trained, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from stepgrpo.storage.run import Run
    from stepgrpo_cli import app

    run_dir = tmp_path / "tiny-a"
    shutil.copytree(trained["run_dir"], run_dir)
    weights = (run_dir / "lora" / "pytorch_lora_weights.safetensors").read_bytes()
    shutil.rmtree(run_dir / "lora")
    rebuilt = CliRunner().invoke(app, ["export", str(run_dir)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").read_bytes() == weights  # the same bytes again
    assert Run.open(run_dir).verify_all() == []
    refused = CliRunner().invoke(app, ["export", str(run_dir), "--iteration", "0"])
    assert refused.exit_code == 1 and "give --out DIR" in refused.output
    early = tmp_path / "iter-0"
    done = CliRunner().invoke(app, ["export", str(run_dir), "--iteration", "0", "--out", str(early)])
    assert done.exit_code == 0, done.output
    assert (early / "pytorch_lora_weights.safetensors").read_bytes() != weights and (early / "README.md").is_file()
    # its card: iteration 0 was not evaluated, so it claims no "after training" number and shows no
    # samples of another checkpoint; its title and iterations are the checkpoint's, not the run's
    card = (early / "README.md").read_text()
    assert "Paired gain" not in card and "after training" not in card
    assert "This checkpoint (iter_0) was not evaluated" in card and "--iteration 0" in card
    assert "after iteration 0 of 2" in card and "| iterations | 1 of the run's 2 x" in card
    assert not (early / "samples.png").exists()
    assert "Paired gain" in (run_dir / "lora" / "README.md").read_text()


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (`run-<id>.wandb`): a 7-byte W&B header, then
    LevelDB's log format (32 KiB blocks; each piece: crc32c 4, length 2, type 1 (full, first,
    middle, last)), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, records = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_a_run_tracked_with_wandb_logs_its_metrics_by_compute_offline(harness, tiny, tmp_path, monkeypatch):
    """`tracking.backend: wandb` (W&B offline, as without an account): the training run's metrics,
    its held-out reward against cumulative NFEs (W&B's own x-axis), its recipe tags and its config
    go to a W&B run under the runs root, never into the run directory; MLflow gets no run."""
    import json

    from stepgrpo.flows.train import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    root = tmp_path / "runs"
    sets = [*tiny, "run.iterations=1", "run.eval_prompts=2", "tracking.backend=wandb", "tracking.project=p"]
    out = train(overrides=sets, run_dir=str(root / "wb"))
    (folder,) = (root / "wandb").glob("offline-run-*")
    assert out["tracking_uri"] == str(folder)
    records = wandb_records(next(folder.glob("run-*.wandb")))
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}  # "a/b": nested
        for r in records
        if r.HasField("history")
    ]
    evals = [e["reward_mean"] for e in out["evaluations"]]
    by_nfe = [(row["heldout/nfe_total"], row["heldout/reward_by_nfe"]) for row in rows]
    assert [r for _, r in by_nfe] == pytest.approx(evals) and by_nfe[0][0] == 0 < by_nfe[1][0]
    by_passes = [(row["heldout/passes_total"], row["heldout/reward_by_passes"]) for row in rows]
    assert [r for _, r in by_passes] == pytest.approx(evals) and by_passes[0][0] == 0 < by_passes[1][0]
    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.run import Run

    # one compute axis: W&B's x-axis counts what `compare` and `inspect --json` count
    assert by_nfe[1][0] == sum(row["nfe"] for row in iteration_costs(Run.open(root / "wb")))
    assert "reward/mean" in rows[0] and "eval/mean" in rows[1]
    runs = [r.run for r in records if r.HasField("run")]  # the run, then its updates (the notes)
    assert {"scheme:stepwise", "reward:jpeg_compressibility", "completion:remaining"} <= set(runs[0].tags)
    assert runs[0].run_group == "wb" and runs[0].job_type == "train"  # the group its offline runs join
    assert runs[-1].notes.startswith("**stepwise @ remaining**") and "Paired gain" in runs[-1].notes
    config = {u.key for r in records if r.HasField("config") for u in r.config.update}
    assert {"credit.scheme", "optim.lr", "stepgrpo.torch_threads"} <= config
    assert not (root / "mlflow.db").exists()
    assert not [p for p in (root / "wb").rglob("*") if "wandb" in p.name]
    # an offline command on the run logs to the run's backend: a W&B run grouped with the training run's
    from stepgrpo.flows.rescore import rescore

    scores = rescore(str(root / "wb"), "shapes", {})["scores"]
    (other,) = [f for f in (root / "wandb").glob("offline-run-*") if f != folder]
    records = wandb_records(next(other.glob("run-*.wandb")))
    runs = [r.run for r in records if r.HasField("run")]
    assert runs[0].run_group == "wb" and runs[0].job_type == "rescore" and "kind:rescore" in runs[0].tags
    rows = [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.HasField("history")
    ]
    means = [json.loads(row["reward_mean"]) for row in rows if "reward_mean" in row]
    assert means == pytest.approx([s["reward_mean"] for s in scores])
    assert not (root / "mlflow.db").exists()


def test_compare_puts_runs_side_by_side_at_equal_compute(trained, tmp_path, monkeypatch):
    """`stepgrpo compare`: each evaluation at the cumulative training NFEs before it (the base at 0),
    read from the stored runs; the table, the JSON and the chart."""
    import json

    from PIL import Image
    from typer.testing import CliRunner

    from stepgrpo.reporting.costs import iteration_costs
    from stepgrpo.storage.run import Run
    from stepgrpo_cli import app

    run_dir = Path(trained["run_dir"])
    result = CliRunner().invoke(app, ["compare", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    (curve,) = out["runs"]
    costs = iteration_costs(Run.open(run_dir))
    spent, passes = sum(row["nfe"] for row in costs), sum(row["passes"] for row in costs)
    assert curve["recipe"] == "stepwise@remaining"
    assert [(p["label"], p["nfe"]) for p in curve["points"]] == [("base", 0), ("iter_1", spent)]
    # the default axis: forward + 2 x backward passes, the budget every run reached
    assert out["axis"] == "passes" and out["budget"] == passes == curve["points"][-1]["passes"]
    assert [p["reward_mean"] for p in curve["points"]] == [e["reward_mean"] for e in trained["evaluations"]]
    chart = tmp_path / "compare.png"
    from rich.console import Console

    cli = importlib.import_module("stepgrpo_cli.shell")  # the consoles every command prints on
    monkeypatch.setattr(cli, "console", Console(width=200))  # one line a run, whatever the terminal
    result = CliRunner().invoke(
        app, ["compare", str(run_dir), str(run_dir), "--out", str(chart)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "stepwise@remaining" in result.output and Image.open(chart).size[0] > 400
    assert "at equal passes" in result.output
    bad = CliRunner().invoke(app, ["compare", str(run_dir), "--x", "hours"])
    assert bad.exit_code != 0 and "one of passes, nfe, seconds" in bad.output


def test_evaluate_under_the_shapes_protocol_writes_a_bundle_with_the_same_bytes_each_time(trained, tmp_path):
    """`stepgrpo evaluate RUN --protocol shapes`: every (prompt, sample) pair from its own seed, the
    numbers and the evidence in `evidence/`, which `inspect --verify` checks; evaluated again on
    this machine, the same checkpoint gives byte-identical per-image digests and scores."""
    import shutil

    from stepgrpo.flows.evaluate import evaluate_protocol
    from stepgrpo.storage.run import Run

    torch.set_num_threads(1)  # the two evaluations' bytes are compared (the session's one thread, pinned)
    copy = tmp_path / "run"
    shutil.copytree(trained["run_dir"], copy)
    out = evaluate_protocol(run=str(copy), protocol="shapes", iteration=-1)
    bundle = Path(out["bundle"])
    assert bundle.parent == copy / "evidence" and bundle.name == "shapes-base"
    names = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert names == {"report.json", "samples.jsonl", "config.json", "environment.json", "CHECKSUMS.sha256"}
    report = out["report"]
    assert report["prompts"] == 126 and report["pairs"] == 252 and report["samples_per_prompt"] == {"2": 126}
    assert report["protocol"]["name"] == "shapes" and "sha256" in report["seeds_rule"]
    shared = (bundle / "config.json").read_text()  # no path of this machine in evidence one shares
    assert str(Path(trained["model_path"]).parent) not in shared and str(tmp_path) not in shared
    env = json.loads((bundle / "environment.json").read_text())
    assert {"stepgrpo", "packages", "device", "wall_seconds"} <= set(env) and env["packages"]["torch"]
    rows = [json.loads(line) for line in (bundle / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 252 and len({r["seed"] for r in rows}) == 252
    assert not Run.open(copy).verify_all()
    from stepgrpo.config import validate_config
    from stepgrpo.reporting.card import model_card, protocol_reports

    (shown,) = protocol_reports(Run.open(copy), {"base"})  # the export's model card carries the headline
    card = model_card(validate_config(Run.open(copy).config), "x", [], False, [shown])
    assert f"| shapes | base | mean shapes: **{report['results']['headline']['value']:.4f}** | 252 |" in card
    first = (bundle / "samples.jsonl").read_bytes()
    shutil.move(bundle, tmp_path / "first")
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    result = CliRunner().invoke(app, ["evaluate", str(copy), "--protocol", "shapes", "--iteration", "-1"])
    assert result.exit_code == 0, result.output
    assert "shapes (base): mean shapes" in result.output and "evidence:" in result.output
    assert (bundle / "samples.jsonl").read_bytes() == first  # the same bytes, evaluated again from the CLI
    from stepgrpo.reporting.tracking import find_mlflow_run

    client, _ = find_mlflow_run(copy, Run.open(copy).run_id)  # the bundle is an artifact of its MLflow run
    (mlrun,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
                if r.info.run_name.endswith("evaluate shapes-base")]  # fmt: skip
    logged = {a.path for a in client.list_artifacts(mlrun.info.run_id, "evidence/shapes-base")}
    assert "evidence/shapes-base/samples.jsonl" in logged and "evidence/shapes-base/CHECKSUMS.sha256" in logged
    assert json.loads((bundle / "report.json").read_text())["results"] == report["results"]
    # a bundle another run made, copied in under this name (its checksums whole): no evidence of this
    # checkpoint; evaluate refuses it naming what differs, and the card leaves it out
    from stepgrpo.storage.bundle import CHECKSUMS, write_bundle

    with pytest.raises(Exception, match="made without its images"):  # --images never returns it silently
        evaluate_protocol(run=str(copy), protocol="shapes", iteration=-1, images=True)
    shutil.move(bundle, tmp_path / "second")
    files = {p.relative_to(tmp_path / "second").as_posix(): p.read_bytes() for p in (tmp_path / "second").rglob("*")
             if p.is_file() and p.name != CHECKSUMS}  # fmt: skip
    files["report.json"] = json.dumps(report | {"run_id": "another-run"}).encode()
    write_bundle(bundle, files)
    with pytest.raises(Exception, match=r"not this checkpoint's \(run_id 'another-run'"):
        evaluate_protocol(run=str(copy), protocol="shapes", iteration=-1)
    assert protocol_reports(Run.open(copy), {"base"}) == []
    # a damaged bundle (one byte changed) is kept aside, never deleted, and evaluated again
    shutil.rmtree(bundle)
    shutil.move(tmp_path / "second", bundle)
    damaged = bytearray((bundle / "samples.jsonl").read_bytes())
    damaged[10] ^= 1
    (bundle / "samples.jsonl").write_bytes(bytes(damaged))
    evaluate_protocol(run=str(copy), protocol="shapes", iteration=-1)
    (aside,) = (copy / "evidence").glob("shapes-base.damaged-*")
    assert (aside / "samples.jsonl").read_bytes() == bytes(damaged)
    assert (bundle / "samples.jsonl").read_bytes() == first  # computed again, the same bytes
    assert not Run.open(copy).verify_all()  # the kept-aside copy is known damaged, not reported again
    assert len(protocol_reports(Run.open(copy), {"base"})) == 1


def test_the_python_api_exports_compares_and_evaluates_a_protocol(trained, tmp_path, monkeypatch):
    """`stepgrpo.export`, `stepgrpo.compare` and `stepgrpo.evaluate(protocol=)`: what the commands do."""
    import stepgrpo
    from stepgrpo.flows import api

    folder = stepgrpo.export(trained["run_dir"], iteration=0, out=tmp_path / "iter0")
    assert folder == tmp_path / "iter0" and (folder / "README.md").is_file()
    found = stepgrpo.compare([trained["run_dir"], trained["run_dir"]], x="nfe")
    assert found["axis"] == "nfe" and len(found["runs"]) == len(found["read"]) == 2
    assert found["read"][0]["reward_mean"] == found["read"][1]["reward_mean"]
    asked = {}
    monkeypatch.setattr(api, "evaluate_protocol", lambda run, protocol, **kw: asked.update(kw, protocol=protocol) or 7)
    assert stepgrpo.evaluate(trained["run_dir"], protocol="shapes", iteration=0) == 7
    assert asked == {"protocol": "shapes", "iteration": 0, "overrides": ()}
