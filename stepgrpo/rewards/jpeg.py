"""JPEG (in)compressibility, the weight-free rewards of DDPO (Black et al. 2023, Sec. 6.1).

The score is the size of the image saved as JPEG at quality 95, in kilobytes (1 kB = 1000
bytes, as DDPO's code divides by 1000). `jpeg_incompressibility` rewards large files (detail,
texture, noise); `jpeg_compressibility` is its negation (flat, simple images). Scale: a 512x512
photo-like image is tens of kB; a 32x32 image of flat shapes is under 1 kB, so next to a [0, 1]
reward give it a weight that brings it to a comparable range.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stepgrpo.images import to_pil
from stepgrpo.rewards.base import REWARDS, RewardOutput

QUALITY = 95  # DDPO's setting
BYTES_PER_KB = 1000.0


def jpeg_size_kb(images: torch.Tensor, quality: int = QUALITY) -> torch.Tensor:
    """`[N, 3, H, W]` in [0, 1] -> `[N]` float32: JPEG file size in kB at `quality`."""
    sizes = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / BYTES_PER_KB)
    return torch.tensor(sizes, dtype=torch.float32)


def _version(quality: int) -> str:
    return "1" if quality == QUALITY else f"1+q{quality}"  # a different quality gives different numbers


class JpegSize:
    """JPEG size in kB times `sign` (+1: incompressibility, -1: compressibility)."""

    def __init__(self, name: str, sign: float, quality: int = QUALITY) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"jpeg quality must be in [1, 100], got {quality}")
        self.name = name
        self.sign = sign
        self.quality = quality
        self.version = _version(quality)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        return RewardOutput(scores=self.sign * jpeg_size_kb(images, self.quality))


@REWARDS.register("jpeg_incompressibility", identity=lambda quality: ("jpeg_incompressibility", _version(quality)))
def jpeg_incompressibility(quality: int = QUALITY) -> JpegSize:
    """Reward = JPEG size in kB (larger files score higher)."""
    return JpegSize("jpeg_incompressibility", +1.0, quality)


@REWARDS.register("jpeg_compressibility", identity=lambda quality: ("jpeg_compressibility", _version(quality)))
def jpeg_compressibility(quality: int = QUALITY) -> JpegSize:
    """Reward = minus the JPEG size in kB (smaller files score higher)."""
    return JpegSize("jpeg_compressibility", -1.0, quality)
