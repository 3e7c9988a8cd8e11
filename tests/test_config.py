"""The validated config: shipped files validate, bad input names the field and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepgrpo.config import STAGE_FIELDS, Config, ConfigError, load_config, stage_fields, validate_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = [
    "demo",
    "flow_grpo_pickscore",
    "densegrpo_geneval",
    "tpgrpo_pickscore",
    "stepwise_pickscore",
    "shapes_outcome",
    "shapes_stepwise",
    "shapes_dense",
    "shapes_turning_point",
]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.run.name == name


def test_paper_recipes_carry_the_papers_hyper_parameters():
    flow = load_config(CONFIGS / "flow_grpo_pickscore.yaml")
    assert (flow.sampler.kernel, flow.sampler.noise, flow.credit.scheme) == ("flow", 0.7, "outcome")
    assert (flow.run.group_size, flow.sampler.steps, flow.sampler.eval_steps) == (24, 10, 40)
    assert (flow.optim.lr, flow.optim.clip_range, flow.optim.kl_beta) == (3e-4, 1e-4, 0.01)
    assert (flow.model.lora_rank, flow.model.lora_alpha, flow.model.guidance_scale) == (32, 64, 4.5)
    dense = load_config(CONFIGS / "densegrpo_geneval.yaml")
    assert dense.reward.name == "geneval"
    assert (dense.sampler.kernel, dense.completion.method, dense.credit.scheme) == ("psi", "remaining", "dense")
    assert (dense.optim.kl_beta, dense.calibration.eps1, dense.calibration.eps2) == (0.04, 2, 0.01)
    step = load_config(CONFIGS / "stepwise_pickscore.yaml")
    assert (step.sampler.kernel, step.completion.method, step.credit.scheme) == ("ddim", "substeps:5", "stepwise")
    tp = load_config(CONFIGS / "tpgrpo_pickscore.yaml")
    assert (tp.completion.method, tp.credit.scheme) == ("remaining", "turning_point")
    assert tp.credit.options == {"consistency": True, "first_step": True, "balance": True}
    # the authors' code: cps SDE on steps 0-8 (all trained, the last an ODE step), clip 1e-5, KL 1e-4
    assert (tp.sampler.kernel, tp.sampler.noise, tp.sampler.window()) == ("cps", 0.7, (0, 9))
    assert (tp.optim.clip_range, tp.optim.kl_beta, tp.trained_steps()) == (1e-5, 1e-4, list(range(9)))
    # Flow-GRPO's code: 48 prompts x 24, 2 AdamW steps an iteration, steps 0-8 trained (timestep_fraction 0.99)
    for cfg in (flow, dense, tp, step):
        assert (cfg.run.prompts_per_iteration, cfg.run.group_size, cfg.optim.optimizer_steps) == (48, 24, 2)
    assert flow.trained_steps() == list(range(9))


def test_overrides_are_parsed_as_yaml():
    cfg = load_config(None, ["optim.lr=1e-3", "optim.train_steps=[0, 2]", "completion.method=null", "run.seed=7"])
    assert cfg.optim.lr == 1e-3 and cfg.optim.train_steps == (0, 2)
    assert cfg.completion.method is None and cfg.run.seed == 7
    assert cfg.trained_steps() == [0, 2]


@pytest.mark.parametrize(
    "override, must_say",
    [
        ("optim.lrr=1", ["optim.lrr", "unknown field", "lr", "weight_decay"]),
        ("bogus.x=1", ["bogus", "unknown field", "sampler", "optim"]),
        ("sampler.kernel=brownian", ["sampler.kernel", "brownian", "flow", "ddim", "cps"]),
        ("completion.method=magic", ["completion.method", "remaining", "tweedie"]),
        ("completion.method=substeps:x", ["completion.method", "positive step count"]),
        ("credit.scheme=vibes", ["credit.scheme", "vibes", "stepwise", "turning_point"]),
        ("reward.name=nope", ["reward.name", "nope", "shapes"]),
        ("model.dtype=float8", ["model.dtype", "float32", "bfloat16"]),
        ("run.group_size=1", ["run.group_size", "greater than or equal to 2"]),
        ("sampler.sde_window_start=12", ["sde window", "10 steps"]),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(override, must_say):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for text in must_say:
        assert text in str(err.value), (text, str(err.value))


def test_trained_steps_must_lie_in_the_sde_window():
    with pytest.raises(ConfigError, match="outside the SDE window"):
        load_config(None, ["sampler.sde_window_start=2", "sampler.sde_window_size=3", "optim.train_steps=[0]"])
    cfg = load_config(None, ["sampler.sde_window_start=2", "sampler.sde_window_size=3"])
    assert cfg.trained_steps() == [2, 3, 4]


def test_bad_override_syntax_and_missing_file():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/config.yaml")


def test_stage_fields_follow_the_caching_contract():
    base = Config()
    reward = load_config(None, ["reward.name=jpeg_compressibility"])
    scheme = load_config(None, ["credit.scheme=stepwise"])
    # a new reward changes score's key but neither rollout's nor complete's
    for stage in ("rollout", "complete", "credit"):
        assert stage_fields(base, stage) == stage_fields(reward, stage), stage
    assert stage_fields(base, "score") != stage_fields(reward, "score")
    # a new scheme changes only credit's own fields
    for stage in set(STAGE_FIELDS) - {"credit"}:
        assert stage_fields(base, stage) == stage_fields(scheme, stage), stage
    assert stage_fields(base, "credit") != stage_fields(scheme, "credit")


def test_flat_config_round_trips_through_overrides():
    cfg = load_config(None, ["credit.options={global_std: false}", "optim.ema_decay=0.9"])
    flat = cfg.flat()
    assert flat["credit.options.global_std"] is False and flat["optim.ema_decay"] == 0.9
    assert Config().digest() != cfg.digest()


def test_scheme_options_and_step_rewards_are_checked():
    with pytest.raises(ConfigError, match=r"valid options: \['balance', 'balance_over', 'consistency', 'first_step'\]"):
        load_config(None, ["credit.scheme=turning_point", "credit.options={wobble: true}"])
    with pytest.raises(ConfigError, match="needs step rewards"):
        load_config(None, ["credit.scheme=dense", "completion.method=null"])


def test_the_final_step_is_not_trained_by_default():
    assert load_config(None, []).trained_steps() == list(range(9))  # T = 10: steps 0..8, as Flow-GRPO
    assert load_config(None, ["optim.train_final_step=true"]).trained_steps() == list(range(10))
    assert load_config(None, ["sampler.sde_window_start=7"]).trained_steps() == [7, 8]
    assert load_config(None, ["optim.train_steps=[9]"]).trained_steps() == [9]  # named explicitly
    with pytest.raises(ConfigError, match="train_final_step"):
        load_config(None, ["sampler.sde_window_start=9"])


def test_optimizer_steps_must_fit_the_batch():
    cfg = load_config(None, ["optim.optimizer_steps=16"])  # 4 prompts x 4 samples
    assert cfg.optim.optimizer_steps == 16
    with pytest.raises(ConfigError, match="optim.optimizer_steps=17 exceeds the 16 trajectories"):
        load_config(None, ["optim.optimizer_steps=17"])
    with pytest.raises(ConfigError, match="grad_accum: unknown field"):
        load_config(None, ["optim.grad_accum=2"])


def test_a_config_starts_from_its_base(tmp_path):
    outcome = load_config(CONFIGS / "shapes_outcome.yaml")
    stepwise = load_config(CONFIGS / "shapes_stepwise.yaml")
    assert (stepwise.credit.scheme, stepwise.completion.method) == ("stepwise", "substeps:5")
    assert stepwise.optim == outcome.optim and stepwise.sampler == outcome.sampler
    assert stepwise.run.name == "shapes_stepwise" and stepwise.run.iterations == outcome.run.iterations
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="is its own base"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml.*does not exist"):
        load_config(tmp_path / "c.yaml")


def test_shapes_recipes_share_the_outcome_base():
    base = load_config(CONFIGS / "shapes_outcome.yaml")
    assert (base.reward.name, base.model.guidance_scale, base.sampler.window()) == ("shapes", 1.0, (0, 3))
    assert (base.optim.optimizer_steps, base.optim.kl_beta, base.run.eval_prompts, base.run.eval_seeds) == (
        1,
        0.0,
        126,
        2,
    )
    for name, scheme in [("stepwise", "stepwise"), ("dense", "dense"), ("turning_point", "turning_point")]:
        cfg = load_config(CONFIGS / f"shapes_{name}.yaml")
        assert cfg.credit.scheme == scheme and cfg.optim == base.optim and cfg.model == base.model
    demo, clip = load_config(CONFIGS / "demo.yaml"), load_config(CONFIGS / "shapes_outcome_clip.yaml")
    assert demo.optim == clip.optim and demo.sampler == base.sampler and demo.run.iterations < base.run.iterations
    assert (clip.optim.optimizer_steps, clip.optim.clip_range) == (4, 1e-4)  # the clip recipe: the PPO clip acts


def test_the_run_form_is_the_typed_config_every_field_described_names_as_choices():
    """The train flow's Prefect parameter schema (the UI's run form): every config field, with its
    description, and the registered names as the choices of reward, scheme and kernel."""
    from prefect.utilities.callables import parameter_schema

    from stepgrpo.config import Config
    from stepgrpo.flows.train import train
    from stepgrpo.rewards import REWARDS
    from stepgrpo_core.credit import SCHEMES
    from stepgrpo_core.kernels import KERNELS

    schema = parameter_schema(train.fn).model_dump()
    assert list(schema["properties"])[:2] == ["config", "config_path"]
    assert schema["properties"]["config"]["description"].startswith("The run's config")
    defs = schema["definitions"]
    for section, field in Config.model_fields.items():
        sub = defs[field.annotation.__name__]
        assert set(sub["properties"]) == set(field.annotation.model_fields), section
        for name, prop in sub["properties"].items():
            assert prop.get("description"), f"{section}.{name} has no description"
        assert defs["Config"]["properties"][section]["description"]
    assert defs["SamplerConfig"]["properties"]["kernel"]["enum"] == KERNELS.names()
    assert defs["CreditConfig"]["properties"]["scheme"]["enum"] == SCHEMES.names()
    assert defs["RewardConfig"]["properties"]["name"]["enum"] == REWARDS.names()
    method = defs["CompletionConfig"]["properties"]["method"]["anyOf"][0]["pattern"]
    import re

    assert all(re.match(method, m) for m in ("remaining", "tweedie", "substeps:4")) and not re.match(method, "nope")


def test_config_show_prints_yaml_that_loads_back_with_every_description(tmp_path):
    import yaml

    from stepgrpo.config import describe

    cfg = load_config(CONFIGS / "shapes_stepwise.yaml", ["optim.lr=2e-4"])
    text = describe(cfg)
    assert validate_config(yaml.safe_load(text)) == cfg
    assert "# AdamW learning rate (Flow-GRPO: 3e-4)." in text and "  lr: 0.0002" in text


def test_a_flow_takes_the_config_or_a_path_not_both():
    from stepgrpo.config import config_from

    cfg = load_config(CONFIGS / "demo.yaml")
    assert config_from(cfg, None, ["optim.lr=1e-3"]).optim.lr == 1e-3
    assert config_from(cfg.model_dump(mode="json")) == cfg  # what a deployment's form sends
    assert config_from(None, CONFIGS / "demo.yaml") == cfg
    with pytest.raises(ConfigError, match="not both"):
        config_from(cfg, "configs/demo.yaml")


def test_fields_added_later_stay_out_of_stored_runs_keys_at_their_old_behaviour():
    from stepgrpo.config import stage_fields

    cfg = load_config(None, [])
    assert "sampler.shared_x0" not in stage_fields(cfg, "rollout")
    assert "optim.step_weighting" not in stage_fields(cfg, "update")
    own = load_config(None, ["sampler.shared_x0=false", "optim.step_weighting=noise"])
    assert stage_fields(own, "rollout")["sampler.shared_x0"] is False
    assert stage_fields(own, "update")["optim.step_weighting"] == "noise"
    assert stage_fields(own, "complete") == stage_fields(cfg, "complete")


def test_stage_keys_name_what_changed_only_where_it_changed():
    from stepgrpo.tasks.keys import code_facts

    w3 = ["sampler.sde_window_size=3"]
    assert code_facts("complete", load_config(None, [*w3, "completion.method=remaining"])) == {}
    assert code_facts("complete", load_config(None, [*w3, "completion.method=substeps:5"])) == {
        "completes_window_end": True
    }
    assert code_facts("complete", load_config(None, ["completion.method=substeps:5"])) == {}  # no window
    assert code_facts("rollout", load_config(None, [])) == {}  # flow: version 1
    assert code_facts("rollout", load_config(None, ["sampler.kernel=ddim"])) == {"kernel_version": "2"}
    assert code_facts("calibrate", load_config(None, [*w3, "sampler.kernel=psi"])) == {"calibrates_in_window": True}


def test_the_run_form_marks_the_fields_that_take_no_null_required_and_shows_each_default():
    """The Prefect run form (the train flow's parameter schema): `(Optional)` only where null means
    something (`model.resolution`: the model's own size); every field says its default."""
    from prefect.utilities.callables import parameter_schema

    from stepgrpo.flows.train import train

    forms = parameter_schema(train.fn).model_dump()["definitions"]
    model = forms["ModelConfig"]
    assert "lora_rank" in model["required"] and "resolution" not in model["required"]
    assert model["properties"]["lora_rank"]["description"].endswith("Default: `32`.")
    assert model["properties"]["resolution"]["description"].endswith("Default: `null`.")
    assert forms["Config"]["required"] == list(Config.model_fields)  # every section
    assert forms["CompletionConfig"]["required"] == []  # method: null is outcome credit's "no completion"


def test_a_papers_optimizer_preset_is_written_where_it_is_named(tmp_path):
    from stepgrpo.config import OPTIMIZER_PRESETS, stage_fields

    fields, source = OPTIMIZER_PRESETS.get("flow_grpo")(), OPTIMIZER_PRESETS.facts("flow_grpo")["paper"]
    assert "flow_grpo" in source and "clip_range" in source  # every value with where it came from
    cfg = load_config(None, ["optim.preset=flow_grpo"])
    assert {k: getattr(cfg.optim, k) for k in fields} == fields
    # later --sets win; a preset named after a field replaces it
    cfg = load_config(None, ["optim.clip_range=0.3", "optim.preset=tp_grpo", "optim.kl_beta=0"])
    assert (cfg.optim.clip_range, cfg.optim.kl_beta, cfg.optim.preset) == (1e-5, 0.0, "tp_grpo")
    # in a file: the file's own optim keys win over its preset, and a file on top wins over both
    (tmp_path / "base.yaml").write_text("optim:\n  preset: flow_grpo\n  optimizer_steps: 4\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\noptim:\n  kl_beta: 0.0\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.optim.clip_range, cfg.optim.optimizer_steps, cfg.optim.kl_beta) == (1e-4, 4, 0.0)
    with pytest.raises(ConfigError, match="optim.preset 'ppo' is not one of 'flow_grpo'"):
        load_config(None, ["optim.preset=ppo"])
    (tmp_path / "bad.yaml").write_text("optim:\n  preset: ppo\n")
    with pytest.raises(ConfigError, match="bad.yaml: optim.preset 'ppo'"):
        load_config(tmp_path / "bad.yaml")
    # no preset: the update's cache key is what it was before presets existed
    assert not [k for k in stage_fields(load_config(None), "update") if "preset" in k]


def test_a_clip_that_cannot_act_says_so_where_the_user_set_it(tmp_path):
    from stepgrpo.config import config_file, user_set

    sets = ["optim.optimizer_steps=1", "optim.clip_range=0.01"]
    (note,) = load_config(None, sets).notes(user_set(None, sets))
    assert "optim.clip_range=0.01 never acts" in note and "optimizer_steps" in note
    assert load_config(None, ["optim.optimizer_steps=2"]).notes(user_set(None, ["optim.clip_range=0.2"])) == []
    one_step = ["optim.optimizer_steps=1", "optim.inner_epochs=2"]
    assert load_config(None, one_step).notes(user_set(None, [*one_step, "optim.clip_range=0.2"])) == []
    # a shipped recipe's own clip is not questioned; the user's file on top of it, or a --set, is
    shipped = load_config("shapes_dense")
    assert shipped.optim.optimizer_steps == 1 and shipped.notes(user_set("shapes_dense")) == []
    assert shipped.notes(user_set("shapes_dense", ["optim.clip_range=0.05"]))
    (tmp_path / "mine.yaml").write_text(f"base: {config_file('shapes_dense')}\noptim:\n  clip_range: 0.02\n")
    assert load_config(tmp_path / "mine.yaml").notes(user_set(tmp_path / "mine.yaml"))
    (tmp_path / "lr.yaml").write_text(f"base: {config_file('shapes_dense')}\noptim:\n  lr: 1e-4\n")
    assert load_config(tmp_path / "lr.yaml").notes(user_set(tmp_path / "lr.yaml")) == []


def test_yaml_aliases_are_followed_within_a_bound():
    from stepgrpo.config import load_yaml

    assert load_yaml("a: &x {b: 1}\nc: *x", "here") == {"a": {"b": 1}, "c": {"b": 1}}  # plain reuse reads
    with pytest.raises(ConfigError, match="here: a YAML alias refers to the value it is part of"):
        load_yaml("a: &a [1, *a]", "here")
