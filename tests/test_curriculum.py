"""The gain-variance curriculum's arithmetic (`stepgrpo_core.curriculum`) and its config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepgrpo.config import ConfigError, load_config
from stepgrpo_core.curriculum import draw, group_spread, prompt_weights


def test_group_spread_is_the_mean_within_group_variance_of_the_step_gains():
    rewards = torch.tensor(
        [
            [0.0, 0.2, 0.5],  # group 7: gains (0.2, 0.3) and (0.4, 0.1)
            [0.0, 0.4, 0.5],
            [0.1, 0.1, 0.1],  # group 3: constant
            [0.1, 0.1, 0.1],
        ]
    )
    first, spread = group_spread(rewards, torch.tensor([7, 7, 3, 3]))
    # groups in sorted id order: 3 (rows 2, 3) then 7 (rows 0, 1)
    assert first.tolist() == [2, 0]
    assert spread[0] == 0.0
    # Var of (0.2, 0.4) is 0.01, of (0.3, 0.1) is 0.01: their mean
    assert spread[1].item() == pytest.approx(0.01)


def test_with_final_rewards_only_the_spread_is_the_groups_reward_variance():
    nan = float("nan")
    rewards = torch.tensor([[nan, nan, 1.0], [nan, nan, 0.0], [nan, nan, 0.5], [nan, nan, 0.5]])
    _, spread = group_spread(rewards, torch.tensor([0, 0, 1, 1]))
    assert spread.tolist() == pytest.approx([0.25, 0.0])
    with pytest.raises(ValueError, match="no final reward"):
        group_spread(torch.full((2, 3), nan), torch.tensor([0, 0]))


def test_weights_floor_for_no_spread_one_for_unseen_and_average_one():
    # prompts 0..3: 0 spread 0.3 (twice: mean 0.2), 1 spread 0 (no spread), 2 spread 0.4, 3 never seen
    weights, seen = prompt_weights(4, np.array([0, 0, 1, 2]), np.array([0.3, 0.1, 0.0, 0.4]), floor=0.2)
    assert seen.tolist() == [True, True, True, False]
    # mean spreads (0.2, 0.0, 0.4), average 0.2: relative (1, 0, 2)
    assert weights.tolist() == pytest.approx([1.0, 0.2, 0.2 + 0.8 * 2, 1.0])
    assert weights[seen].mean() == pytest.approx(1.0)
    none, _ = prompt_weights(3, np.array([0, 1]), np.array([0.0, 0.0]), floor=0.3)
    assert none.tolist() == pytest.approx([0.3, 0.3, 1.0])  # nothing spread: the unseen prompt leads
    with pytest.raises(ValueError, match="floor"):
        prompt_weights(2, np.array([0]), np.array([1.0]), floor=1.5)


def test_the_draw_follows_the_weights_without_replacement():
    g = torch.Generator().manual_seed(0)
    weights = np.array([0.0, 1.0, 1.0, 4.0])
    counts = np.zeros(4)
    for _ in range(2000):
        counts[draw(weights, 1, g)] += 1
    assert counts[0] == 0  # weight 0: never drawn
    assert 3.0 < counts[3] / counts[1] < 5.5  # in proportion to the weights (4): 1333 against 333 expected
    for _ in range(50):
        assert len(set(draw(weights, 3, g).tolist())) == 3  # distinct
    # more than the prompts with weight: a second pass, as the uniform draw's permutation repeats
    assert sorted(draw(np.array([1.0, 1.0]), 4, g).tolist()) == [0, 0, 1, 1]
    again = draw(weights, 2, torch.Generator().manual_seed(5)), draw(weights, 2, torch.Generator().manual_seed(5))
    assert again[0].tolist() == again[1].tolist()  # seeded: a resumed run draws the same


def test_curriculum_config_is_validated():
    cfg = load_config(None, ["curriculum.draw=gain_variance", "curriculum.window=8"])
    assert (cfg.curriculum.draw, cfg.curriculum.window) == ("gain_variance", 8)
    assert load_config().curriculum.draw == "uniform"
    with pytest.raises(ConfigError, match="curriculum.draw"):
        load_config(None, ["curriculum.draw=hardest"])
    with pytest.raises(ConfigError, match="curriculum.floor"):
        load_config(None, ["curriculum.floor=2"])


def test_a_run_made_before_the_curriculum_resumes_under_its_defaults(tmp_path):
    """A stored config without the section compares equal to the defaults it now gets."""
    from stepgrpo.runs import check_resumable
    from stepgrpo.storage.run import Run

    cfg = load_config()
    old = cfg.model_dump(mode="json")
    del old["curriculum"]
    Run.create(tmp_path, "old", old)
    check_resumable(cfg, tmp_path / "old")  # no error
    from stepgrpo.errors import StageError

    with pytest.raises(StageError, match="curriculum.draw"):
        check_resumable(load_config(None, ["curriculum.draw=gain_variance"]), tmp_path / "old")
