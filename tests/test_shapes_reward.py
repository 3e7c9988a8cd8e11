"""The `shapes` scorer: ground truth scores 1 strict; each kind of mistake costs exactly its category."""

import math

import numpy as np
import pytest
import torch

from stepgrpo.images import from_uint8
from stepgrpo.rewards.base import REWARDS
from stepgrpo.rewards.shapes import ShapesReward, detect
from stepgrpo.shapes import data


@pytest.fixture(scope="module")
def reward():
    return ShapesReward()


def _score(reward, images, specs):
    return reward(from_uint8(np.stack(images)), [data.prompt_of(s) for s in specs], specs)


def test_registered():
    r = REWARDS.get("shapes")()
    assert r.name == "shapes" and r.version


def test_ground_truth_scores_one_strict(reward):
    rng = np.random.default_rng(123)
    specs = [data.all_specs()[i] for i in rng.integers(0, 900, 400)]
    out = _score(reward, [data.render(s, rng) for s in specs], specs)
    assert out.scores.min() == 1.0 and out.strict.min() == 1.0
    for s, sp in zip(specs, out.sub["spatial"]):
        assert math.isnan(sp) == (s["relation"] is None)


def test_detects_every_rendered_shape():
    for shape in data.SHAPES:
        for side in range(data.MIN_SIDE, data.MAX_SIDE + 1):
            img = data.draw([data.Placement(10, 10, side, "blue", shape)])
            (d,) = detect(img)
            assert (d.colour, d.shape) == ("blue", shape)
            # a triangle's centroid sits a sixth of its height below its box centre
            assert d.centre == pytest.approx((10 + side / 2, 10 + side / 2), abs=side / 6 + 0.5)


def _with(spec, **change):
    """A copy of `spec` with every object's fields changed."""
    return {"objects": [o | change for o in spec["objects"]], "relation": spec["relation"]}


@pytest.mark.parametrize(
    "prompt", ["a red circle", "three yellow squares", "two purple triangles", "four blue circles"]
)
def test_each_mistake_costs_exactly_its_category(reward, prompt):
    spec = data.parse(prompt)
    o = spec["objects"][0]
    rng = np.random.default_rng(1)
    wrong = {
        # one more object (one fewer for four)
        "count": _with(spec, count=o["count"] + 1 if o["count"] < 4 else 3),
        "colour": _with(spec, colour="green"),
        "shape": _with(spec, shape="square" if o["shape"] != "square" else "triangle"),
    }
    images = [data.render(w, rng) for w in wrong.values()]
    out = _score(reward, images, [spec] * len(images))
    for i, category in enumerate(wrong):
        for c in ("count", "colour", "shape"):
            assert out.sub[c][i] == (0.0 if c == category else 1.0), (category, c)
        assert out.scores[i] == pytest.approx(2 / 3) and out.strict[i] == 0


@pytest.mark.parametrize("relation,opposite", [("left of", "right of"), ("above", "below")])
def test_wrong_position_and_wrong_binding_cost_only_spatial(reward, relation, opposite):
    spec = data.parse(f"a red square {relation} a blue circle")
    rng = np.random.default_rng(2)
    swapped = {"objects": spec["objects"], "relation": opposite}
    # binding: the colours are there, the shapes are there, but on the wrong objects
    rebound = data.parse(f"a blue square {relation} a red circle")
    images = [data.render(spec, rng), data.render(swapped, rng), data.render(rebound, rng)]
    out = _score(reward, images, [spec] * 3)
    assert out.strict.tolist() == [1.0, 0.0, 0.0]
    assert out.sub["spatial"].tolist() == [1.0, 0.0, 0.0]
    assert out.scores[1:].tolist() == [0.75, 0.75]


def test_noise_and_blank_score_zero(reward):
    prompts = ["two red circles", "a green triangle above a yellow square"]
    noise = torch.rand(2, 3, data.SIZE, data.SIZE, generator=torch.Generator().manual_seed(0))
    assert reward(noise, prompts, []).scores.tolist() == [0.0, 0.0]
    assert reward(torch.ones(2, 3, data.SIZE, data.SIZE), prompts, []).scores.tolist() == [0.0, 0.0]


def test_metadata_is_optional_and_checked(reward):
    img = from_uint8(data.render(data.parse("two red circles"), np.random.default_rng(0))[None])
    assert reward(img, ["two red circles"], []).strict.item() == 1.0
    with pytest.raises(ValueError, match="prompts"):
        reward(img, ["a", "b"], [])
    with pytest.raises(ValueError, match="shapes grammar"):
        reward(img, ["a photo of a cat"], [])
