"""OCR reward: does the image show the text quoted in the prompt? (Flow-GRPO's text-rendering task.)

Flow-GRPO (Liu et al. 2025) reads the image with PaddleOCR and scores

    r = 1 - min(d, L) / L,    d = edit_distance(recognised, target),  L = len(target)

where `target` is the first double-quoted span of the prompt, and both strings are lowercased
with spaces removed; if `target` occurs inside the recognised text, d = 0 (extra text is not
penalised). Recognised pieces are concatenated in detection order. We run the same PP-OCR models
through rapidocr-onnxruntime, whose wheel ships the weights (no download), with its default
confidence threshold (0.5, PaddleOCR's `drop_score` default too). Scores lie in [0, 1].

Tiny images need no upscaling here: rapidocr itself enlarges inputs below its `min_side_len`
before detection (measured: black text on white at 32x16 and 32x32 pixels reads correctly).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from PIL import Image

from stepgrpo.images import to_pil
from stepgrpo.rewards.base import REWARDS, RewardOutput


def quoted_text(prompt: str) -> str:
    """The first double-quoted span of `prompt`: 'a sign that says "OPEN"' -> 'OPEN'."""
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].strip():
        raise ValueError(
            f"the ocr reward needs the target text in double quotes in the prompt, got {prompt!r}; "
            'write prompts like: a sign that says "OPEN"'
        )
    return parts[1]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_score(recognised: str, target: str) -> float:
    """Flow-GRPO's formula on normalised strings (lowercase, no spaces), in [0, 1]."""
    recognised = recognised.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("the quoted target text is empty after removing spaces")
    distance = 0 if target in recognised else edit_distance(recognised, target)
    return 1.0 - min(distance, len(target)) / len(target)


class OcrReward:
    """PP-OCR (rapidocr-onnxruntime) text match against the prompt's quoted text."""

    name = "ocr"
    version = "1"

    def __init__(self) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ImportError(
                "the ocr reward needs rapidocr-onnxruntime; install it with "
                "`pip install 'stepgrpo[ocr]'` (in a checkout of stepgrpo: `pip install -e '.[ocr]'`; the "
                "package includes the PP-OCR weights)"
            ) from err
        self.engine = RapidOCR()

    def read(self, image: Image.Image) -> str:
        """All recognised text in detection order, concatenated."""
        result, _ = self.engine(image)
        return "".join(text for _, text, _ in result) if result else ""

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(prompts)} prompts")
        targets = [quoted_text(p) for p in prompts]  # fail before the slow part
        scores = [text_score(self.read(img), t) for img, t in zip(to_pil(images), targets)]
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))


@REWARDS.register("ocr", identity=lambda: (OcrReward.name, OcrReward.version))
def ocr() -> OcrReward:
    """Flow-GRPO's OCR reward in [0, 1]."""
    return OcrReward()
