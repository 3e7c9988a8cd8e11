"""What the runs report: paired held-out gains with their interval, the training-reward summary."""

from __future__ import annotations

import math

import pytest
import torch

from stepgrpo.loops.scoring import reward_summary
from stepgrpo.reporting.report import paired_gain


def test_paired_gain_is_the_mean_difference_with_a_t_interval():
    before = {"scores": [0.5, 0.5, 0.5], "prompts": 3, "seeds": 1}
    after = {"scores": [0.6, 0.7, 0.5], "prompts": 3, "seeds": 1}
    mean, lo, hi = paired_gain(before, after)
    # differences 0.1, 0.2, 0.0: mean 0.1, sample sd 0.1, t(0.975, 2) = 4.303
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert (
        mean == pytest.approx(0.1)
        and lo == pytest.approx(0.1 - half, abs=1e-6)
        and hi == pytest.approx(0.1 + half, abs=1e-6)
    )
    assert paired_gain(before, {**after, "seeds": 2}) is None  # not the same samples


def test_paired_gain_treats_the_prompt_as_the_unit():
    # 2 prompts x 2 seeds, seed-major: differences [0.1, 0.3 | 0.1, 0.3]. Counting the 4 pairs as
    # independent would give sd 0.115 over n = 4; averaged per prompt the differences are 0.1 and
    # 0.3 (n = 2), mean 0.2, sd 0.1414, t(0.975, 1) = 12.706.
    before = {"scores": [0.0, 0.0, 0.0, 0.0], "prompts": 2, "seeds": 2}
    after = {"scores": [0.1, 0.3, 0.1, 0.3], "prompts": 2, "seeds": 2}
    mean, lo, hi = paired_gain(before, after)
    half = 12.706205 * math.sqrt(0.02) / math.sqrt(2)
    assert mean == pytest.approx(0.2) and hi - mean == pytest.approx(half, abs=1e-5) and lo < 0
    assert paired_gain({"prompts": 3, "seeds": 1}, after) is None  # an old record without scores


def test_reward_summary_reads_the_sde_the_ode_reference_and_the_groups():
    nan = float("nan")
    # two groups of two; R_0 (the ODE sample) is shared within a group; the middle state unscored
    grid = torch.tensor([[0.5, nan, 1.0], [0.5, nan, 1.0], [0.0, nan, 0.0], [0.0, nan, 1.0]])
    strict = torch.tensor([[1.0, nan, 1.0], [1.0, nan, 1.0], [0.0, nan, 0.0], [0.0, nan, 1.0]])
    s = reward_summary(grid, strict, torch.tensor([0, 0, 1, 1]))
    assert s["reward_mean"] == pytest.approx(0.75) and s["reward_strict"] == pytest.approx(0.75)
    assert s["ode_reward_mean"] == pytest.approx(0.25) and s["ode_reward_strict"] == pytest.approx(0.5)
    assert s["group_reward_std"] == pytest.approx(0.25)  # stds 0 and 0.5
    assert s["zero_std_groups"] == pytest.approx(0.5)
    assert "reward_per_state" not in s  # not every state has a reward


def test_a_card_of_the_shipped_model_loads_it_from_a_checkout_or_a_wheel():
    """The base is the model stepgrpo ships: the card's Use block finds it through stepgrpo.paths
    (a wheel has no models/shapes in the working directory), and names no hub id."""
    import yaml

    from stepgrpo.config import load_config
    from stepgrpo.reporting.card import model_card, portable

    cfg = load_config("shapes_outcome", ["run.runs_root=/somewhere/of/mine/runs"])
    card = model_card(cfg, "r", [], samples=False)
    meta = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in meta and "base-model-shipped" in meta["tags"]
    use = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert "SHIPPED_ROOT" in use and "/somewhere" not in card
    from stepgrpo.paths import SHIPPED_ROOT

    assert 'str(SHIPPED_ROOT / "models/shapes")' in use and (SHIPPED_ROOT / "models/shapes/model_index.json").is_file()
    assert "text_encoder_3=None" in use  # loaded as its run loaded it (the export test runs such a block)
    assert portable(cfg)["run"]["runs_root"] == "runs"


def test_a_card_names_the_objective_and_the_sampler_it_was_trained_with():
    from stepgrpo.config import load_config
    from stepgrpo.reporting.card import model_card

    grpo = model_card(load_config("shapes_outcome", []), "r", [], samples=False)
    assert "a GRPO LoRA" in grpo and "kernel flow" in grpo
    awm = model_card(load_config("shapes_awm", ["sampler.sde_solver=sa_solver"]), "r", [], samples=False)
    assert "an AWM LoRA" in awm
    assert "`update.objective: awm`" in awm and "| sampler | 10 steps, sa_solver |" in awm and "GRPO" not in awm


def test_the_compare_chart_labels_every_run(tmp_path):
    """Two runs of one recipe: one colour, two labelled lines (not one legend entry for both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stepgrpo.reporting.compare import chart

    points = [{"nfe": 0, "reward_mean": 0.5}, {"nfe": 100, "reward_mean": 0.6}]
    curves = [{"run_id": r, "recipe": "outcome@final", "points": points} for r in ("seed-0", "seed-1")]
    captured = {}
    real = plt.Figure.savefig

    def keep(fig, *a, **k):
        captured["labels"] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        captured["colours"] = {tuple(line.get_color()) for line in fig.axes[0].get_lines()}
        return real(fig, *a, **k)

    plt.Figure.savefig = keep
    try:
        chart(curves, tmp_path / "c.png", "shapes")
    finally:
        plt.Figure.savefig = real
    assert captured["labels"] == ["seed-0 (outcome@final)", "seed-1 (outcome@final)"]
    assert len(captured["colours"]) == 1 and (tmp_path / "c.png").is_file()


def test_an_iteration_line_shows_what_the_objective_measured():
    """GRPO's line: its clip and signal check; an objective without a per-step signal check (AWM):
    its loss and clip, no GRPO diagnostics printed as n/a; no ODE reward where none was sampled."""
    from stepgrpo.reporting.report import iteration_line

    grpo = {"iteration": 3, "reward_mean": 0.7, "ode_reward_mean": 0.71, "clip_frac": 0.004, "signal_cosine": 0.08}
    line = iteration_line(grpo | {"loss": 0.1, "lora_distance": 0.01})
    assert "signal cos +0.080" in line and "(ODE 0.7100)" in line
    awm = iteration_line({"iteration": 3, "reward_mean": 0.7, "loss": -0.2, "clip_frac": 0.0, "lora_distance": 0.01})
    assert "signal" not in awm and "n/a" not in awm and "ODE" not in awm
    assert "loss -0.2000, clip_frac 0.000" in awm
