"""Every shipped recipe (configs/*.yaml) reaches its first rollout, on a tiny random-weight model
of its architecture: SD3.5-Medium's (16 latent channels, RMS-normed attention, MMDiT-X dual
attention) for the SD3.5 paper recipes, a tiny FluxPipeline for the FLUX.1-dev one, the shipped shapes
model for the CPU ones.

What each recipe says about the model call is kept: dtype (bf16 in the paper recipes, so the
bf16 latent store is exercised), guidance, kernel, SDE window, noise, steps, completion, credit,
optimizer; what only sets the size is cut to one small group on the CPU: the device, prompts a
iteration and group size, resolution (the tiny model's own), and the prompt files (the paper
recipes' Flow-GRPO files are not shipped: a stand-in file, or the shipped `geneval` set).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stepgrpo.checks import check_config
from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.runs import open_run
from stepgrpo.tasks import prompts as prompts_stage
from stepgrpo.tasks import rollout as rollout_stage
from stepgrpo.tasks.keys import stage_key
from stepgrpo_core.calibration import initial_psi
from stepgrpo_core.kernels import KERNELS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def sd35_like(tmp_path_factory) -> Path:
    from stepgrpo.shapes.model import build_pipeline, sd35_medium_like_spec

    path = tmp_path_factory.mktemp("model") / "tiny-sd35m"
    build_pipeline(sd35_medium_like_spec(), seed=0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def flux_like(tmp_path_factory) -> Path:
    from stepgrpo.shapes.model import tiny_flux_pipeline

    path = tmp_path_factory.mktemp("model") / "tiny-flux"
    tiny_flux_pipeline().save_pretrained(str(path))
    return path


def test_every_recipe_is_covered():
    assert {"flow_grpo_pickscore.yaml", "tpgrpo_pickscore.yaml", "stepwise_pickscore.yaml"} <= set(RECIPES)
    assert {"densegrpo_geneval.yaml", "demo.yaml", "shapes_outcome.yaml"} <= set(RECIPES)


def small_settings(recipe: str, sd35_like, flux_like, tmp_path) -> list[str]:
    """Overrides that run `recipe` on the CPU with a tiny random model of its family, 2 trajectories."""
    shipped = load_config(REPO / "configs" / recipe)
    small = ["model.device=cpu", "model.resolution=null", "run.prompts_per_iteration=1", "run.group_size=2"]
    # one group: as many optimizer steps as it can split into (none where the objective reads whole groups)
    steps = 1 if shipped.update.resolved["whole_groups"] else min(shipped.optim.optimizer_steps, 2)
    small += [f"optim.optimizer_steps={steps}", f"run.runs_root={tmp_path}"]
    if shipped.sampler.branch_tree:  # a tree of 2 leaves: its first split alone
        small.append(f"sampler.branch_tree=[[{shipped.sampler.branch_tree[0][0]},2]]")
    if "FLUX" in shipped.model.path:
        small[1:2] = [f"model.path={flux_like}", "model.resolution=32"]
    elif shipped.model.path != "models/shapes":
        small.append(f"model.path={sd35_like}")
    if shipped.run.prompts.startswith("data/"):
        if shipped.reward.name == "geneval":
            small += ["run.prompts=geneval", "run.heldout_prompts=null"]  # GenEval metadata for the reward
        else:
            (tmp_path / "train.txt").write_text("a photo of a cat\na red car on a street\n")
            (tmp_path / "test.txt").write_text("a blue bird\n")
            small += [f"run.prompts={tmp_path / 'train.txt'}", f"run.heldout_prompts={tmp_path / 'test.txt'}"]
    return small


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_reaches_its_first_rollout(recipe, sd35_like, flux_like, tmp_path, monkeypatch):
    shipped = load_config(REPO / "configs" / recipe)
    cfg = load_config(REPO / "configs" / recipe, small_settings(recipe, sd35_like, flux_like, tmp_path))
    from stepgrpo import checks
    from stepgrpo.rewards import REWARDS

    if REWARDS.facts(cfg.reward.name).get("hub"):  # weights from the hub: named before anything starts
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import: set as the env would have
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        with pytest.raises(StageError, match=f"reward {cfg.reward.name}: .* is not a local path nor in the"):
            check_config(cfg)
        monkeypatch.setattr(checks, "check_reward_weights", lambda *a, **k: None)  # none on this machine
    check_config(cfg)
    for field in ("dtype", "guidance_scale", "lora_rank"):
        assert getattr(cfg.model, field) == getattr(shipped.model, field)
    sampler = cfg.sampler.model_copy(update={"branch_tree": shipped.sampler.branch_tree})  # a tree shrinks
    assert sampler == shipped.sampler and cfg.credit == shipped.credit and cfg.completion == shipped.completion

    run = open_run(cfg, tmp_path / "run")
    prompts = prompts_stage.execute(run, cfg)
    noise: float | torch.Tensor = cfg.sampler.noise
    if KERNELS.facts(cfg.sampler.kernel)["calibrated"]:  # psi: its initial table, before calibration
        from stepgrpo.loops import workspace

        noise = initial_psi(workspace.policy(cfg).sigmas(cfg.sampler.steps).cpu(), cfg.calibration.init_a)
    key = stage_key("rollout", run, cfg, 0, {"prompts": prompts, "checkpoint": None, "psi": None})
    result = rollout_stage.execute(run, cfg, 0, noise, key)
    assert result.trajectories == 2
    data = run.stages.read_rollout(0)
    assert data.states.shape[:2] == (2, cfg.sampler.steps + 1) and bool(
        torch.isfinite(torch.from_numpy(data.states)).all()
    )
    assert run.stage_manifest(0, "rollout")["attrs"]["latent_dtype"] == cfg.model.dtype  # stored as sampled
    start, end = cfg.sampler.window()
    stochastic = torch.isfinite(torch.from_numpy(data.log_probs[0])).tolist()
    # a log-prob inside the SDE window only; all of it but ddim's deterministic last step (std 0 at s' = 0)
    ends = (cfg.sampler.steps - 1,) if cfg.sampler.kernel == "ddim" else ()
    # an ODE rollout (DiffusionNFT) or a multistep solver's (AWM's SA-Solver): no step has a density of its own
    if KERNELS.facts(cfg.sampler.kernel)["deterministic"] or cfg.sampler.sde_solver:
        start = end = 0
    if cfg.sampler.branch_tree:  # a tree: the first leaf holds every transition on its path
        assert [k for k, x in enumerate(stochastic) if x] == [s for s, _ in cfg.sampler.tree() or ()]
        return
    if cfg.sampler.branches():  # branched: one density, at its step
        (b,) = [k for k, x in enumerate(stochastic) if x]
        assert start <= b < end
        return
    assert [k for k, x in enumerate(stochastic) if x] == [k for k in range(start, end) if k not in ends]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if not load_config(REPO / "configs" / r).update.on_transitions])
def test_the_flow_matching_recipes_run_an_update(recipe, sd35_like, flux_like, tmp_path):
    """DiffusionNFT's and AWM's recipes: one iteration through the update, in memory
    (`stepgrpo.loops.reference`), on a tiny random model of their family."""
    from stepgrpo.loops.reference import reference_loop

    small = small_settings(recipe, sd35_like, flux_like, tmp_path)
    cfg = load_config(REPO / "configs" / recipe, [*small, "reward.name=jpeg_compressibility"])  # no hub weights
    (rec,) = reference_loop(cfg, 1)
    stats = rec["update_stats"]
    times = cfg.update.resolved["times"]
    assert stats["optimizer_steps"] == 1
    assert stats["rows"] == 2 * (int(times * cfg.sampler.steps) if times < 1 else times)  # (sample, time) rows
    assert stats["backward_rows"] == stats["rows"]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.endswith("_w9.yaml")])
def test_the_papers_regime_recipes_reach_their_first_update(recipe):
    """The 9-step-window recipes (docs/bench/credit_schemes_w9/README.md) train steps 0-8 of 10:
    one iteration through rollout, completion, scoring, credit and the update, in memory
    (`stepgrpo.loops.reference`, held equal to the pipeline by tests/test_flows.py)."""
    from stepgrpo.loops.reference import reference_loop

    cfg = load_config(REPO / "configs" / recipe, ["run.prompts_per_iteration=1", "run.group_size=2"])
    assert cfg.sampler.window() == (0, 9) and list(cfg.trained_steps()) == list(range(9))
    (rec,) = reference_loop(cfg, 1)
    adv = rec["advantages"]
    assert adv.shape == (2, 10) and bool(torch.isfinite(adv[:, :9]).all())
    if cfg.credit.scheme != "outcome":  # every trained state completed and scored
        assert rec["nfe_complete"] > 0 and bool(torch.isfinite(rec["rewards"]).all())
    assert rec["update_stats"]["grad_norm"] is not None and rec["update_stats"]["grad_norm"] >= 0
