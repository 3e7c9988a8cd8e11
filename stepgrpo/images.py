"""The one place where image tensors are converted for reward models and files.

Images inside stepgrpo are float tensors `[N, 3, H, W]` in [0, 1] (what the policy's `decode`
returns). Rewards and writers convert with these helpers, never by hand.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch
from PIL import Image


def quantize(images: torch.Tensor) -> torch.Tensor:
    """`[N, 3, H, W]` float in [0, 1] -> uint8 of the same layout (rounded, clamped, as
    diffusers' `numpy_to_pil`): the 8-bit images every reward is given. One float temporary (the
    clamped copy, then scaled and rounded in place): a batch of large images is not held three
    times over."""
    return images.detach().float().clamp(0, 1).mul_(255).round_().to(torch.uint8)


def dequantize(images: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, 3, H, W]` -> float32 in [0, 1] (exact inverse of `quantize` on its outputs); the
    division in place on the new float copy."""
    return images.to(torch.float32, copy=True).div_(255.0)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """`[N, 3, H, W]` float in [0, 1] -> `[N, H, W, 3]` uint8 (rounded, clamped)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [N, 3, H, W], got {tuple(images.shape)}")
    return quantize(images).permute(0, 2, 3, 1).cpu().numpy()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """`[N, 3, H, W]` float in [0, 1] -> a list of RGB PIL images."""
    return [Image.fromarray(a) for a in to_uint8(images)]


def from_uint8(arr: np.ndarray) -> torch.Tensor:
    """`[N, H, W, 3]` uint8 -> `[N, 3, H, W]` float in [0, 1]."""
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected uint8 images [N, H, W, 3], got {arr.shape}")
    # a copy: the array may be read-only (PIL / OpenCV views), which torch.from_numpy cannot share
    return dequantize(torch.from_numpy(np.array(arr, dtype=np.uint8)).permute(0, 3, 1, 2))


def grid(images: torch.Tensor, ncols: int = 8, pad: int = 2) -> Image.Image:
    """Tile `[N, 3, H, W]` images into one PIL image, `ncols` per row, white padding."""
    arr = to_uint8(images)
    n, h, w, _ = arr.shape
    ncols = max(1, min(ncols, n))
    nrows = (n + ncols - 1) // ncols
    canvas = np.full((nrows * (h + pad) + pad, ncols * (w + pad) + pad, 3), 255, np.uint8)
    for i, img in enumerate(arr):
        r, c = divmod(i, ncols)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = img
    return Image.fromarray(canvas)


def captioned_grid(
    images: torch.Tensor, captions: list[str], ncols: int = 8, tile: int = 128, lines: int = 3
) -> Image.Image:
    """Tile `[N, 3, H, W]` images, each scaled up to at least `tile` pixels (nearest: a small
    model's pixels stay visible) with its caption (prompt, reward) in up to `lines` lines under it."""
    from PIL import ImageDraw, ImageFont

    if len(captions) != len(images):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    font = ImageFont.load_default(size=11)
    pil = to_pil(images)
    h, w = pil[0].height, pil[0].width
    scale = max(1, -(-tile // max(h, w)))
    th, tw = h * scale, w * scale
    line_h, pad = 13, 4
    cell_h = th + lines * line_h + pad
    ncols = max(1, min(ncols, len(pil)))
    nrows = (len(pil) + ncols - 1) // ncols
    canvas = Image.new("RGB", (ncols * (tw + pad) + pad, nrows * (cell_h + pad) + pad), "white")
    # the layout, kept in the PNG's text (`write_grid`), so that `preview` can cut the tiles out again
    canvas.info[LAYOUT_KEY] = json.dumps({"n": len(pil), "ncols": ncols, "w": tw, "h": cell_h, "pad": pad})
    draw = ImageDraw.Draw(canvas)
    for i, (img, text) in enumerate(zip(pil, captions)):
        r, c = divmod(i, ncols)
        x, y = pad + c * (tw + pad), pad + r * (cell_h + pad)
        canvas.paste(img.resize((tw, th), Image.NEAREST), (x, y))
        for j, line in enumerate(_wrap(draw, text, font, tw)[:lines]):
            draw.text((x, y + th + 1 + j * line_h), line, fill="black", font=font)
    return canvas


LAYOUT_KEY = "stepgrpo.grid"


def preview(image: Image.Image, n: int = 16) -> Image.Image:
    """The first `n` captioned tiles of a `captioned_grid` (read back from a PNG), re-tiled square
    (`ceil(sqrt(n))` per row): what MLflow's image view shows readably at its default size, where
    the stored grid of 64 tiles is a thumbnail. A grid without its layout is returned as it is."""
    layout = image.info.get(LAYOUT_KEY)
    if layout is None:
        return image
    g = json.loads(layout)
    k = min(n, g["n"])
    cols = math.ceil(math.sqrt(k))
    rows = math.ceil(k / cols)
    w, h, pad = g["w"], g["h"], g["pad"]
    out = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + pad) + pad), "white")
    for i in range(k):
        (r, c), (r2, c2) = divmod(i, g["ncols"]), divmod(i, cols)
        x, y = pad + c * (w + pad), pad + r * (h + pad)
        out.paste(image.crop((x, y, x + w, y + h)), (pad + c2 * (w + pad), pad + r2 * (h + pad)))
    return out


def _wrap(draw: Any, text: str, font: Any, width: int) -> list[str]:
    """`text` split into lines of at most `width` pixels (an explicit newline starts a line)."""
    out: list[str] = []
    for para in text.split("\n"):
        line = ""
        for word in para.split():
            trial = f"{line} {word}".strip()
            if line and draw.textlength(trial, font=font) > width:
                out.append(line)
                line = word
            else:
                line = trial
        out.append(line)
    return out
