"""`shapes`: a small GenEval for the synthetic shapes task, by classical image analysis (no weights).

Detection, per image (`[H, W, 3]` uint8):

1. colour segmentation: every pixel takes the nearest palette colour (background included, RGB
   distance); a pixel farther than `MAX_COLOUR_DIST` from every palette colour (e.g. a blend of
   blue and white at an edge, which is nearer purple than blue) counts as background;
2. objects: 4-connected components of each object colour (`scipy.ndimage.label`) with at least
   `MIN_AREA` pixels (scaled with the image area); smaller ones are noise;
3. shape from three descriptors of the component's bounding box: `top` = share of the pixels in
   its top half (an upward triangle ~0.3, circles and squares ~0.5), `extent` = area / box area
   (square 1.0, circle ~0.8, triangle ~0.6) and `corners` = fill of the four 2x2 corner blocks
   (square 1.0, a square with one or two pixels rounded off each corner 0.5-0.75, circle <= 0.25),
   after filling holes. Extent alone does not separate them: a 9 px digital circle has extent
   0.85 and soft generated squares fall below 0.93. Anything else is an object of unknown shape;
4. the centroid of each object, for relations (image y grows downwards).

Constraints, one per category, each 0 or 1 (the prompt's structured spec comes from `metadata`
or is parsed from the prompt):

- count: the number of objects equals the number the prompt asks for (1-4, or 2 for relations);
- colour: the set of object colours equals the prompt's set of colours;
- shape: the set of object shapes equals the prompt's set of shapes;
- spatial (relation prompts only, NaN otherwise): exactly one object has the first phrase's colour
  *and* shape, exactly one has the second's, and their centroids satisfy the relation by more
  than `RELATION_MARGIN` pixels. This is also where attribute binding is checked: a blue square
  next to a red circle for "a red square left of a blue circle" passes colour and shape, not this.

Weighting: `score` is the mean over the applicable categories, with equal weights (3 for count
prompts, 4 for relation prompts), and `strict` is 1 when all are met (GenEval's metric). So right
colours alone earn at most 1/3 (count prompts) or 1/4 (relation prompts), and a wrong count,
colour, shape or position costs exactly its own category.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import ndimage

from stepgrpo.images import to_uint8
from stepgrpo.rewards.base import REWARDS, RewardOutput
from stepgrpo.shapes import data

CATEGORIES = ("count", "colour", "shape", "spatial")
MAX_COLOUR_DIST = 90.0  # RGB distance; half the closest pair of palette colours is ~62
MIN_AREA = 12  # pixels at 32x32 (the smallest rendered shape, an 8 px triangle, has 40)
RELATION_MARGIN = 3.0  # px at 32x32; rendered relations hold by at least data.RELATION_MARGIN (6)
TRIANGLE_TOP = 0.42  # top-half share below this (and extent below TRIANGLE_EXTENT) -> triangle
TRIANGLE_EXTENT = 0.85  # generated triangles have blunt apexes: extent up to ~0.8
SQUARE_CORNERS = 0.45  # corner fill at or above this (and extent >= SQUARE_EXTENT) -> square
SQUARE_EXTENT = 0.8
CIRCLE_EXTENT = (0.65, 0.92)  # a circle's extent range (pi / 4 = 0.785 for a perfect disc)


@dataclass(frozen=True)
class Detection:
    """One detected object."""

    colour: str
    shape: str | None  # None: not recognisably a circle, square or triangle
    centre: tuple[float, float]  # (x, y) centroid in pixels
    area: int


_PALETTE_NAMES = ["background", *data.COLOURS]
_PALETTE = np.array([data.BACKGROUND, *data.COLOURS.values()], np.float32)  # [1 + colours, 3]


def classify(mask: np.ndarray) -> str | None:
    """Shape of one component given its `[h, w]` bool mask cropped to its bounding box."""
    mask = ndimage.binary_fill_holes(mask)  # off-palette speckles inside a generated shape are not holes
    h, w = mask.shape
    area = mask.sum()
    extent = area / (h * w)
    top = mask[: h // 2].sum() + (mask[h // 2].sum() / 2 if h % 2 else 0)  # middle row counts half
    top = top / area
    k = max(1, round(min(h, w) / 5))  # 2x2 corner blocks at 8-12 px
    corners = np.mean([mask[:k, :k].mean(), mask[:k, -k:].mean(), mask[-k:, :k].mean(), mask[-k:, -k:].mean()])
    if top < TRIANGLE_TOP and extent < TRIANGLE_EXTENT:
        return "triangle"
    if corners >= SQUARE_CORNERS and extent >= SQUARE_EXTENT:
        return "square"
    if CIRCLE_EXTENT[0] <= extent < CIRCLE_EXTENT[1] and corners < SQUARE_CORNERS and abs(top - 0.5) < 0.1:
        return "circle"
    return None


def detect(image: np.ndarray) -> list[Detection]:
    """Objects in one `[H, W, 3]` uint8 image."""
    h, w, _ = image.shape
    dist = np.linalg.norm(image[:, :, None, :].astype(np.float32) - _PALETTE, axis=-1)  # [H, W, P]
    labels = dist.argmin(-1)
    labels[dist.min(-1) > MAX_COLOUR_DIST] = 0
    min_area = MIN_AREA * (h * w) / (data.SIZE * data.SIZE)
    found = []
    for index in range(1, len(_PALETTE_NAMES)):
        components, n = ndimage.label(labels == index)  # default structure: 4-connectivity
        for sl, comp in zip(ndimage.find_objects(components), range(1, n + 1)):
            mask = components[sl] == comp
            area = int(mask.sum())
            if area < min_area:
                continue
            ys, xs = np.nonzero(mask)
            # pixel centres, so a rendered shape's centroid matches its drawn centre
            centre = (float(xs.mean() + sl[1].start + 0.5), float(ys.mean() + sl[0].start + 0.5))
            found.append(Detection(_PALETTE_NAMES[index], classify(mask), centre, area))
    return found


def check(spec: Mapping[str, Any], found: Sequence[Detection], size: int = data.SIZE) -> dict[str, float]:
    """Per-category 0/1 results (NaN where not applicable) of one image's detections against a spec."""
    objects = spec["objects"]
    out = {
        "count": float(len(found) == sum(o["count"] for o in objects)),
        "colour": float({d.colour for d in found} == {o["colour"] for o in objects}),
        "shape": float({d.shape for d in found} == {o["shape"] for o in objects}),
        "spatial": float("nan"),
    }
    if spec["relation"] is not None:
        a, b = ([d for d in found if (d.colour, d.shape) == (o["colour"], o["shape"])] for o in objects)
        margin = RELATION_MARGIN * size / data.SIZE
        ok = len(a) == 1 and len(b) == 1 and data.relation_holds(spec["relation"], a[0].centre, b[0].centre, margin)
        out["spatial"] = float(ok)
    return out


class ShapesReward:
    """The `shapes` scorer: `(images [N, 3, H, W] in [0, 1], prompts, metadata) -> RewardOutput`."""

    name = "shapes"
    version = "2"

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]] | None = None
    ) -> RewardOutput:
        arr = to_uint8(images)
        if len(prompts) != len(arr):
            raise ValueError(f"got {len(arr)} images but {len(prompts)} prompts")
        metadata = metadata if metadata else [{}] * len(arr)
        if len(metadata) != len(arr):
            raise ValueError(f"got {len(arr)} images but {len(metadata)} metadata dicts (pass [] for none)")
        rows = []
        for img, prompt, meta in zip(arr, prompts, metadata):
            spec = meta if "objects" in meta else data.parse(prompt)
            rows.append(check(spec, detect(img), size=img.shape[0]))
        sub = {c: torch.tensor([r[c] for r in rows], dtype=torch.float32) for c in CATEGORIES}
        stacked = torch.stack([sub[c] for c in CATEGORIES], dim=1)  # [N, 4], NaN where not applicable
        applicable = ~stacked.isnan()
        met = torch.nan_to_num(stacked, nan=0.0)
        scores = met.sum(1) / applicable.sum(1)
        strict = (met.sum(1) == applicable.sum(1)).float()
        return RewardOutput(scores=scores, strict=strict, sub=sub)


@REWARDS.register("shapes", identity=lambda: (ShapesReward.name, ShapesReward.version))
def shapes_reward() -> ShapesReward:
    """Factory: the `shapes` scorer takes no options."""
    return ShapesReward()
