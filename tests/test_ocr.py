"""The OCR reward on PIL-rendered text with the real PP-OCR weights shipped in rapidocr's wheel."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from stepgrpo.images import from_uint8
from stepgrpo.rewards import build_reward
from stepgrpo.rewards.ocr import edit_distance, quoted_text, text_score

pytest.importorskip("rapidocr_onnxruntime")


def render(text: str, size: tuple[int, int] = (256, 96), font_size: int = 36) -> np.ndarray:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((1, size[1] // 4), text, fill="black", font=ImageFont.load_default(size=font_size))
    return np.asarray(image)


def test_formula_worked_examples():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    # substring of the recognised text counts as a perfect match (Flow-GRPO)
    assert text_score("Big SALE today", "sale") == 1.0
    # "OPEM" vs "open": 1 substitution of 4 characters -> 1 - 1/4
    assert text_score("OPEM", "open") == pytest.approx(0.75)
    # distance is capped at the target length, so the score never goes below 0
    assert text_score("a much longer unrelated string", "hi") == 0.0
    assert quoted_text('a neon sign that says "Open Late"') == "Open Late"
    with pytest.raises(ValueError, match="double quotes"):
        quoted_text("a sign with no quoted text")


@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


def test_rendered_text_scores_high_for_its_prompt_and_low_for_another(ocr):
    images = from_uint8(np.stack([render("HELLO WORLD"), render("stepgrpo")]))
    assert images.shape == (2, 3, 96, 256)
    own = ocr(images, ['a sign saying "hello world"', 'a label with "stepgrpo"'], [{}, {}])
    other = ocr(images, ['a sign saying "banana"', 'a label with "quantum"'], [{}, {}])
    assert own.scores.dtype == torch.float32 and own.scores.shape == (2,)
    assert (own.scores >= 0.9).all(), own.scores
    assert (other.scores <= 0.4).all(), other.scores


def test_tiny_images_are_read(ocr):
    # 32x32 pixels, the shipped model's image size
    tiny = from_uint8(render("HI", size=(32, 32), font_size=14)[None])
    assert ocr(tiny, ['a door sign "hi"'], [{}]).scores.item() >= 0.9


def test_prompt_without_quotes_is_an_error(ocr):
    with pytest.raises(ValueError, match="double quotes"):
        ocr(torch.ones(1, 3, 32, 32), ["no quotes here"], [{}])


def test_a_missing_extra_names_the_install_a_user_of_the_package_runs(monkeypatch):
    """Without rapidocr the reward says how to install the extra from the package index (and, apart,
    from a checkout): a user's own project has no `.[ocr]` of stepgrpo's."""
    import sys

    from stepgrpo.rewards import ocr

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)
    with pytest.raises(ImportError, match=r"pip install 'stepgrpo\[ocr\]'"):
        ocr.OcrReward()
