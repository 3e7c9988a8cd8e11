"""Typed stage results: JSON round trips (ours and Prefect's serializer), and cache keys that load nothing."""

from __future__ import annotations

import pytest

from stepgrpo.config import load_config
from stepgrpo.results import (
    CalibrateResult,
    CompleteResult,
    CreditResult,
    EvaluateResult,
    PromptsResult,
    Result,
    RolloutResult,
    ScoreResult,
    UpdateResult,
)

EXAMPLES: list[Result] = [
    PromptsResult(digest="p" * 64, rows=252),
    CalibrateResult(digest="c" * 64, key="k", psi=[0.5, 0.25], rounds=[{"round": 0, "psi": [0.5, 0.25]}], seconds=1.5),
    RolloutResult(digest="r" * 64, iteration=3, trajectories=64, nfe=640, nfe_ode=160, seconds=2.0),
    CompleteResult(digest="m" * 64, iteration=3, method="substeps:5", nfe=960, seconds=3.0),
    ScoreResult(
        digest="s" * 64,
        iteration=3,
        reward_name="shapes",
        reward_version="2",
        images="decoded+stored",
        seconds=0.5,
        reward_mean=0.61,
        reward_std=0.2,
        group_reward_std=0.1,
        zero_std_groups=0.25,
        reward_strict=0.4,
        ode_reward_mean=0.6,
        reward_per_state=[0.5, 0.55, 0.61],
    ),
    CreditResult(
        digest="a" * 64,
        iteration=3,
        scheme="turning_point",
        options_digest="o" * 16,
        seconds=0.01,
        adv_mean=0.0,
        adv_std=0.9,
        adv_abs_max=2.5,
        zero_std_ratio=0.125,
        turning_points=7,
        gain_mean=[0.01, -0.02],
    ),
    UpdateResult(
        digest="u" * 64,
        iteration=3,
        seconds=4.0,
        stats={
            "clip_frac": 0.01,
            "optimizer_steps": 2,
            "trained_step_ids": [0, 1, 2],
            "grad_energy_share": [0.5, None, 0.5],
        },
    ),
    EvaluateResult(
        label="iter_3",
        iteration=3,
        key="k",
        reward_name="shapes",
        reward_version="2",
        prompts=2,
        seeds=1,
        reward_mean=0.5,
        reward_std=0.5,
        nfe=20,
        scores=[0.0, 1.0],
        grid="eval/iter_3.png",
        seconds=1.0,
        reward_strict=0.5,
        strict_scores=[0.0, 1.0],
        sub={"counting": 0.75},
    ),
]


@pytest.mark.parametrize("result", EXAMPLES, ids=lambda r: type(r).__name__)
def test_results_round_trip_through_json(result):
    again = type(result).from_json(result.to_json())
    assert again == result and type(again) is type(result)
    assert type(result).model_validate(result.record()) == result
    if isinstance(result, UpdateResult):  # integers stay integers (step ids name metrics)
        assert again.stats.trained_step_ids == [0, 1, 2] and isinstance(again.stats.optimizer_steps, int)


@pytest.mark.parametrize("result", EXAMPLES, ids=lambda r: type(r).__name__)
def test_results_round_trip_through_prefects_json_serializer(result):
    from prefect.serializers import JSONSerializer

    serializer = JSONSerializer()
    assert serializer.loads(serializer.dumps(result)) == result


def test_results_are_frozen_and_refuse_unknown_fields():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        EXAMPLES[0].rows = 3
    with pytest.raises(ValidationError, match="extra"):
        PromptsResult(digest="p", rows=1, surprise=True)


def test_an_evaluation_stored_with_flat_sub_scores_still_reads():
    old = EXAMPLES[-1].record() | {"stage": "evaluate", "sub_counting": 0.75}
    del old["sub"]
    assert EvaluateResult.model_validate(old) == EXAMPLES[-1]


def test_key_inputs_name_what_downstream_stages_read():
    from stepgrpo.tasks.keys import key_inputs

    score, credit = EXAMPLES[4], EXAMPLES[5]
    assert key_inputs({"rewards": score}) == {"rewards": "s" * 64, "reward": ["shapes", "2"]}
    assert key_inputs({"advantages": credit, "checkpoint": None, "psi": None}) == {
        "advantages": "a" * 64,
        "scheme": "turning_point",
        "options_digest": "o" * 16,
        "checkpoint": "init",
        "psi": None,
    }


# ----------------------------------------------------------------- keys without a model


@pytest.fixture
def no_models(monkeypatch):
    """Any attempt to load a policy, a decoder or a reward, or to fingerprint model files, fails."""
    from stepgrpo import rewards
    from stepgrpo.loops import workspace

    def refuse(*args, **kwargs):
        raise AssertionError("a cache key loaded a model")

    for name in ("policy", "decoder", "model_identity"):
        monkeypatch.setattr(workspace, name, refuse)
    monkeypatch.setattr(rewards, "build_reward", refuse)


def test_a_key_computes_from_the_manifest_when_the_model_directory_is_gone(tmp_path, no_models):
    import shutil

    from stepgrpo.runs import MODEL_FACT
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks.keys import stage_key

    model = tmp_path / "model"
    model.mkdir()
    cfg = load_config(
        None, [f"model.path={model}", "reward.name=shapes", "credit.scheme=stepwise", "completion.method=remaining"]
    )
    run = Run.create(tmp_path / "runs", "r", cfg.model_dump(mode="json"), facts={MODEL_FACT: "fingerprint-1"})
    shutil.rmtree(model)  # unreadable: keys must not need it
    keys = {
        stage: stage_key(stage, run, cfg, 0, {"rollout": "r", "checkpoint": None})
        for stage in ("rollout", "complete", "score", "credit", "update", "evaluate", "calibrate")
    }
    assert len(set(keys.values())) == len(keys)
    again = Run.open(run.path)
    assert keys == {s: stage_key(s, again, cfg, 0, {"rollout": "r", "checkpoint": None}) for s in keys}


def test_the_model_fingerprint_alone_changes_model_stages_keys(tmp_path, no_models, monkeypatch):
    from stepgrpo.runs import MODEL_FACT
    from stepgrpo.storage.run import Run
    from stepgrpo.tasks import keys

    cfg = load_config(None, ["completion.method=remaining", "credit.scheme=stepwise"])
    run = Run.create(tmp_path, "r", cfg.model_dump(mode="json"), facts={MODEL_FACT: "one"})
    before = {s: keys.stage_key(s, run, cfg, 0, {}) for s in ("rollout", "credit", "prompts")}
    run.manifest["facts"][MODEL_FACT] = "two"
    after = {s: keys.stage_key(s, run, cfg, 0, {}) for s in before}
    assert before["rollout"] != after["rollout"]
    assert before["credit"] == after["credit"] and before["prompts"] == after["prompts"]  # they read no model


def test_a_run_refuses_model_files_that_changed(tmp_path):
    from stepgrpo.errors import StageError
    from stepgrpo.runs import open_run
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    model = tmp_path / "tiny"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(model))
    cfg = load_config(None, [f"model.path={model}"])
    run = open_run(cfg, tmp_path / "runs" / "r")
    assert run.fact("model_identity")
    assert open_run(cfg, tmp_path / "runs" / "r").fact("model_identity") == run.fact("model_identity")  # resume

    from stepgrpo.loops import workspace

    workspace.model_identity.cache_clear()
    (model / "scheduler" / "scheduler_config.json").write_text("{}")
    try:
        with pytest.raises(StageError, match="changed since the run was created"):
            open_run(cfg, tmp_path / "runs" / "r")
    finally:
        workspace.model_identity.cache_clear()
