"""`geneval`: GenEval's rules on hand-made detections, and the scorer on tiny random-weight models.

The models are a tiny `Mask2FormerForUniversalSegmentation` (Swin backbone from a config, no
pretrained weights) and a tiny `CLIPModel`, saved with their processors to temporary directories
and loaded through the factory's `from_pretrained` path; no hub access (HF_HUB_OFFLINE).
"""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_rewards import tiny_clip_dir  # noqa: E402

from stepgrpo.images import to_pil  # noqa: E402
from stepgrpo.rewards import REWARDS, build_reward  # noqa: E402
from stepgrpo.rewards.geneval import (  # noqa: E402
    COLOURS,
    TEMPLATES,
    Detection,
    Requirement,
    aggregate,
    check,
    crop,
    needs_colour,
    relative_position,
    select,
    validate_spec,
)

LABELS = {0: "dog", 1: "cat", 2: "traffic light"}


def det(label, score, box, colour=None):
    return Detection(label, score, tuple(float(v) for v in box), colour)


def met(reqs):
    return [(r.kind, r.clause, r.met) for r in reqs]


# ---- rules on hand-made detections ----


def test_relative_position_worked_examples():
    a, b = (0, 0, 20, 20), (40, 0, 60, 20)
    # offset x = 10 - 50 = -40; margin 0.1 * (20 + 20) = 4 -> shrunk -36; dx = -36 / 40 = -0.9 < -0.5
    assert relative_position(a, b) == {"left of"}
    assert relative_position(b, a) == {"right of"}
    # offset -3 is inside the margin 4 in x, 0 in y -> no relation at all
    assert relative_position((0, 0, 20, 20), (3, 0, 23, 20)) == set()
    # diagonal: offset (-30, -30), shrunk (-26, -26), / 42.43 = -0.61 each -> two relations
    assert relative_position((0, 0, 20, 20), (30, 30, 50, 50)) == {"left of", "above"}
    # mostly vertical: offset (-10, 40), shrunk (-6, 36) / 41.2 = (-0.15, 0.87) -> below only
    assert relative_position((0, 40, 20, 60), (10, 0, 30, 20)) == {"below"}
    # a larger margin swallows the horizontal offset: 40 - 1.0 * 40 = 0
    assert relative_position(a, b, position_threshold=1.0) == set()


def test_counting_needs_at_least_and_exclude_makes_it_exact():
    spec = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]}
    two = [det("dog", 0.95, (0, 0, 10, 10)), det("dog", 0.92, (20, 0, 30, 10)), det("cat", 0.99, (0, 20, 9, 29))]
    assert met(check(spec, two)) == [("count", 0, True), ("exclude", 0, True)]
    three = two + [det("dog", 0.91, (40, 0, 50, 10))]
    assert met(check(spec, three)) == [("count", 0, True), ("exclude", 0, False)]
    assert met(check(spec, two[:1])) == [("count", 0, False), ("exclude", 0, True)]
    assert "expected dog>=2, found 1" in check(spec, two[:1])[0].reason


def test_select_thresholds_per_tag_max_objects_and_overlap():
    dogs = [det("dog", s, (i * 10, 0, i * 10 + 8, 8)) for i, s in enumerate([0.95, 0.5, 0.31, 0.3, 0.1])]
    # strictly above 0.3 (GenEval's `>`), best first
    assert [d.score for d in select(dogs, "two_object")] == [0.95, 0.5, 0.31]
    # counting prompts use the 0.9 threshold
    assert [d.score for d in select(dogs, "counting")] == [0.95]
    assert [d.score for d in select(dogs, "colors", max_objects=2)] == [0.95, 0.5]
    # suppression: a box overlapping a better one by IoU >= max_overlap goes; off at 1.0 (default)
    twin = [det("dog", 0.9, (0, 0, 10, 10)), det("dog", 0.8, (1, 0, 11, 10)), det("cat", 0.8, (1, 0, 11, 10))]
    # IoU of the dogs = 90 / 110 = 0.82
    assert len(select(twin, "counting", counting_threshold=0.5)) == 3
    assert [d.label for d in select(twin, "counting", counting_threshold=0.5, max_overlap=0.8)] == ["dog", "cat"]
    assert len(select(twin, "counting", counting_threshold=0.5, max_overlap=0.85)) == 3


def test_colour_reads_only_the_most_confident_objects():
    spec = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]}
    found = [det("dog", 0.6, (0, 0, 5, 5)), det("dog", 0.9, (10, 0, 15, 5)), det("cat", 0.9, (0, 10, 5, 15))]
    assert needs_colour(spec, found) == [1]  # the 0.9 dog only
    red_best = [det("dog", 0.6, (0, 0, 5, 5), "blue"), det("dog", 0.9, (10, 0, 15, 5), "red"), found[2]]
    assert met(check(spec, red_best)) == [("count", 0, True), ("color", 0, True)]
    blue_best = [det("dog", 0.6, (0, 0, 5, 5), "red"), det("dog", 0.9, (10, 0, 15, 5), "blue"), found[2]]
    reqs = check(spec, blue_best)
    assert met(reqs) == [("count", 0, True), ("color", 0, False)] and "blue" in reqs[1].reason
    with pytest.raises(ValueError, match="no colour"):
        check(spec, found)
    # no dog: colour is not judged and fails with the count
    assert met(check(spec, found[2:])) == [("count", 0, False), ("color", 0, False)]
    two_red = {"tag": "colors", "include": [{"class": "dog", "count": 2, "color": "red"}]}
    assert needs_colour(two_red, found) == [0, 1]


def test_color_attr_two_objects_each_with_its_colour():
    spec = {
        "tag": "color_attr",
        "include": [{"class": "dog", "count": 1, "color": "red"}, {"class": "cat", "count": 1, "color": "blue"}],
    }
    swapped = [det("dog", 0.9, (0, 0, 5, 5), "blue"), det("cat", 0.9, (10, 0, 15, 5), "red")]
    assert met(check(spec, swapped)) == [
        ("count", 0, True),
        ("color", 0, False),
        ("count", 1, True),
        ("color", 1, False),
    ]
    right = [det("dog", 0.9, (0, 0, 5, 5), "red"), det("cat", 0.9, (10, 0, 15, 5), "blue")]
    assert all(r.met for r in check(spec, right))


def test_position_against_the_target_clause():
    spec = {
        "tag": "position",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
    }
    left = [det("cat", 0.9, (40, 0, 60, 20)), det("dog", 0.9, (0, 0, 20, 20))]
    assert met(check(spec, left)) == [("count", 0, True), ("count", 1, True), ("position", 1, True)]
    right = [det("cat", 0.9, (0, 0, 20, 20)), det("dog", 0.9, (40, 0, 60, 20))]
    assert met(check(spec, right))[-1] == ("position", 1, False)
    # no cat: the target clause failed, so the position fails too ("no target")
    reqs = check(spec, left[1:])
    assert met(reqs) == [("count", 0, False), ("count", 1, True), ("position", 1, False)]
    assert "no target" in reqs[-1].reason


def test_two_object_and_exclude():
    spec = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    assert met(check(spec, [det("dog", 0.9, (0, 0, 5, 5))])) == [("count", 0, True), ("count", 1, False)]
    single = {
        "tag": "single_object",
        "include": [{"class": "dog", "count": 1}],
        "exclude": [{"class": "cat", "count": 1}],
    }
    assert met(check(single, [det("dog", 0.9, (0, 0, 5, 5)), det("cat", 0.4, (9, 9, 12, 12))]))[-1] == (
        "exclude",
        0,
        False,
    )


def test_aggregate_strict_vs_partial():
    rows = [
        [
            Requirement("count", 0, True),
            Requirement("color", 0, False),
            Requirement("count", 1, True),
            Requirement("color", 1, True),
        ],
        [Requirement("count", 0, True), Requirement("exclude", 0, True)],
        [Requirement("count", 0, False), Requirement("count", 1, True), Requirement("position", 1, False)],
    ]
    out = aggregate(rows)
    # fractions met: 3/4, 2/2, 1/3; strict only where all are met
    assert torch.allclose(out.scores, torch.tensor([0.75, 1.0, 1 / 3]))
    assert torch.equal(out.strict, torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(out.sub["count"], torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(out.sub["color"].isnan(), torch.tensor([False, True, True]))
    assert out.sub["color"][0] == 0.5 and out.sub["exclude"][1] == 1.0 and out.sub["position"][2] == 0.0


def test_metadata_is_required_and_checked():
    with pytest.raises(ValueError, match="structured metadata"):
        validate_spec({})
    with pytest.raises(ValueError, match="not one of the detector's classes"):
        validate_spec({"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}, ["dog", "cat"])
    with pytest.raises(ValueError, match="color must be one of"):
        validate_spec({"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "teal"}]})
    with pytest.raises(ValueError, match="earlier include clause"):
        validate_spec({"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["left of", 0]}]})
    with pytest.raises(ValueError, match="count"):
        validate_spec({"tag": "counting", "include": [{"class": "dog", "count": 0}]})


def test_crop_puts_the_mask_on_grey_and_cuts_the_box():
    image = np.zeros((6, 6, 3), np.uint8) + 10
    mask = np.zeros((6, 6), bool)
    mask[1:3, 2:5] = True
    mask[1, 2] = False
    out = crop(image, Detection("dog", 0.9, (2.0, 1.0, 5.0, 3.0), mask=mask))
    assert out.shape == (2, 3, 3)
    assert (out[0, 0] == 153).all() and (out[1, 1] == 10).all()


# ---- the scorer on tiny random-weight models saved to disk ----


def tiny_mask2former_dir(path):
    """Save a random COCO-style Mask2Former (3 classes, 64 px input) and its image processor to `path`.

    The class head's bias makes every query a confident "dog", so detections are certain to exist.
    """
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    backbone = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    # feature sizes are multiples of 32: the pixel decoder uses GroupNorm(32, .)
    config = Mask2FormerConfig(
        backbone_config=backbone,
        use_pretrained_backbone=False,
        hidden_dim=32,
        feature_size=32,
        mask_feature_size=32,
        encoder_layers=1,
        decoder_layers=2,
        num_queries=8,
        encoder_feedforward_dim=32,
        dim_feedforward=32,
        num_attention_heads=2,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
    )
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(config)
    with torch.no_grad():
        model.class_predictor.bias.zero_()
        model.class_predictor.bias[0] = 20.0  # "dog"
    model.save_pretrained(path)
    Mask2FormerImageProcessor(size={"height": 64, "width": 64}).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return tiny_mask2former_dir(tmp_path_factory.mktemp("m2f")), tiny_clip_dir(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def reward(model_dirs):
    detector, clip = model_dirs
    options = {"detector": detector, "clip": clip, "counting_threshold": 0.3, "batch_size": 2}
    return build_reward({"name": "geneval", "options": options})


def reference_dogs(detector_dir, images):
    """Dogs scoring above 0.3 per image, counted the plain way with transformers."""
    from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

    model = Mask2FormerForUniversalSegmentation.from_pretrained(detector_dir).eval()
    processor = AutoImageProcessor.from_pretrained(detector_dir)
    with torch.no_grad():
        out = model(**processor(images=to_pil(images), return_tensors="pt"))
    results = processor.post_process_instance_segmentation(
        out, threshold=0.3, target_sizes=[images.shape[-2:]] * len(images)
    )
    return [sum(s["label_id"] == 0 and s["score"] > 0.3 for s in r["segments_info"]) for r in results]


def test_registered_and_versioned(reward):
    assert "geneval" in REWARDS
    assert reward.name == "geneval"
    # not the published checkpoints, and non-default thresholds: all in the version
    assert reward.version.startswith("1+") and reward.version.endswith("+t0.3,c0.3,m16,o1,p0.1")


def test_counts_match_a_direct_detection(reward, model_dirs):
    images = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    dogs = reference_dogs(model_dirs[0], images)
    assert all(1 <= k <= 8 for k in dogs), dogs
    exact = [
        {"tag": "counting", "include": [{"class": "dog", "count": k}], "exclude": [{"class": "dog", "count": k + 1}]}
        for k in dogs
    ]
    out = reward(images, ["p"] * 3, exact)
    assert torch.equal(out.strict, torch.ones(3)) and torch.equal(out.scores, torch.ones(3))
    # one more dog than detected: count fails, exclude holds -> 1/2
    more = [
        {
            "tag": "counting",
            "include": [{"class": "dog", "count": k + 1}],
            "exclude": [{"class": "dog", "count": k + 2}],
        }
        for k in dogs
    ]
    out = reward(images, ["p"] * 3, more)
    assert torch.equal(out.strict, torch.zeros(3)) and torch.equal(out.scores, torch.full((3,), 0.5))
    cats = reward(images, ["p"] * 3, [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}] * 3)
    assert torch.equal(cats.scores, torch.zeros(3)) and torch.isnan(cats.sub["color"]).all()


def test_exactly_one_colour_of_the_ten_passes(reward):
    image = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    meta = [{"tag": "colors", "include": [{"class": "dog", "count": 1, "color": c}]} for c in COLOURS]
    out = reward(image.expand(len(COLOURS), -1, -1, -1), ["p"] * len(COLOURS), meta)  # one colour asked per row
    assert out.strict.sum() == 1  # the best dog has exactly one colour
    assert torch.equal(out.scores, (1 + out.strict) / 2)  # count met everywhere; colour in one row


def test_colour_classifier_matches_a_direct_clip(reward, model_dirs):
    from transformers import CLIPModel, CLIPProcessor

    gen = torch.Generator().manual_seed(3)
    crops = [(torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy() for h, w in [(10, 7), (5, 12), (10, 7)]]
    classes = ["dog", "traffic light", "cat"]
    got = reward.colours(crops, classes)
    model, processor = CLIPModel.from_pretrained(model_dirs[1]).eval(), CLIPProcessor.from_pretrained(model_dirs[1])
    with torch.no_grad():
        expected = []
        for c, cls in zip(crops, classes):
            img = model.get_image_features(**processor(images=[c], return_tensors="pt"))
            img = torch.nn.functional.normalize(getattr(img, "pooler_output", img), dim=-1)[0]
            texts = [t.format(colour=col, cls=cls) for col in COLOURS for t in TEMPLATES]
            txt = model.get_text_features(
                **processor.tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
            )
            txt = torch.nn.functional.normalize(getattr(txt, "pooler_output", txt), dim=-1)
            clf = torch.nn.functional.normalize(txt.reshape(len(COLOURS), len(TEMPLATES), -1).mean(1), dim=-1)
            expected.append(COLOURS[int((clf @ img).argmax())])
    assert got == expected


def test_missing_metadata_is_a_clear_error(reward):
    images = torch.rand(1, 3, 48, 48)
    with pytest.raises(ValueError, match=r"prompt 0 \('a dog'\).*structured metadata"):
        reward(images, ["a dog"], [{}])
    with pytest.raises(ValueError, match="structured metadata"):
        reward(images, ["a dog"], [])
