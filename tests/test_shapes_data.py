"""The shapes grammar, its held-out split and the ground-truth renderer."""

import numpy as np
import pytest

from stepgrpo.shapes import data


def test_grammar_covers_the_task():
    assert len(data.COLOURS) >= 5 and set(data.SHAPES) >= {"circle", "square", "triangle"}
    assert set(data.RELATIONS) == {"left of", "right of", "above", "below"}
    specs = data.all_specs()
    # 4 counts x 15 (colour, shape) + 4 relations x 15 x 14 ordered distinct pairs
    assert len(specs) == 4 * 15 + 4 * 15 * 14
    prompts = [data.prompt_of(s) for s in specs]
    assert len(set(prompts)) == len(prompts)
    assert "two red circles" in prompts and "a blue square left of a green triangle" in prompts


def test_parse_inverts_prompt_of():
    for spec in data.all_specs():
        assert data.parse(data.prompt_of(spec)) == spec
    assert data.parse("  Three  GREEN squares ") == {
        "objects": [{"count": 3, "colour": "green", "shape": "square"}],
        "relation": None,
    }


@pytest.mark.parametrize(
    "bad", ["two red circle", "a pink circle", "five red circles", "a red circle near a blue square"]
)
def test_parse_rejects_text_outside_the_grammar(bad):
    with pytest.raises(ValueError, match="not"):
        data.parse(bad)


def test_vocabulary_is_every_word_used():
    words = {w for s in data.all_specs() for w in data.prompt_of(s).split()}
    assert words == set(data.vocabulary())


def test_split_is_disjoint_and_covers_both_families():
    train, held = data.split(held_out=False), data.split(held_out=True)
    tp, hp = {data.prompt_of(s) for s in train}, {data.prompt_of(s) for s in held}
    assert not tp & hp and len(tp | hp) == len(data.all_specs())
    assert 0.08 < len(hp) / len(data.all_specs()) < 0.2
    assert any(s["relation"] is None for s in held) and any(s["relation"] for s in held)
    # a function of the text only: listing order does not matter
    assert all(data.is_held_out(p) for p in hp) and not any(data.is_held_out(p) for p in tp)


def test_render_is_deterministic_given_the_seed():
    spec = data.parse("four purple triangles")
    a = data.render(spec, np.random.default_rng(7))
    b = data.render(spec, np.random.default_rng(7))
    c = data.render(spec, np.random.default_rng(8))
    assert a.shape == (data.SIZE, data.SIZE, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_placements_respect_sizes_gaps_and_relations():
    rng = np.random.default_rng(0)
    for spec in data.all_specs()[::7]:
        placed = data.place(spec, rng)
        assert len(placed) == sum(o["count"] for o in spec["objects"])
        assert all(data.MIN_SIDE <= p.side <= data.MAX_SIDE for p in placed)
        assert all(0 <= p.x <= data.SIZE - p.side and 0 <= p.y <= data.SIZE - p.side for p in placed)
        for i, p in enumerate(placed):
            for q in placed[i + 1 :]:
                assert data._separated(p, q)
        if spec["relation"]:
            assert data.relation_holds(spec["relation"], placed[0].centre, placed[1].centre, data.RELATION_MARGIN)
        # only palette colours and the background are drawn
        img = data.draw(placed)
        colours = {tuple(c) for c in img.reshape(-1, 3)}
        assert colours <= {data.BACKGROUND, *data.COLOURS.values()}


def test_sample_batch_shapes_and_mix():
    images, prompts, specs = data.sample_batch(data.split(False), 64, np.random.default_rng(0))
    assert images.shape == (64, 3, data.SIZE, data.SIZE) and 0 <= images.min() and images.max() <= 1
    assert [data.prompt_of(s) for s in specs] == prompts
    n_count = sum(s["relation"] is None for s in specs)
    assert 16 < n_count < 48  # both families, about half each
