"""The synthetic `shapes` task: prompt grammar, structured specs, held-out split, renderer.

Two prompt families, both with a structured spec (the reward's `metadata`):

- counts: "a red circle", "three blue squares"
  -> {"objects": [{"count": 3, "colour": "blue", "shape": "square"}], "relation": None}
- relations: "a red circle left of a green triangle"
  -> {"objects": [{"count": 1, "colour": "red", "shape": "circle"},
                  {"count": 1, "colour": "green", "shape": "triangle"}], "relation": "left of"}
  The two objects always differ in colour or shape, so a checker can tell which one is which.

Images are `S x S` (S = 32) RGB on a plain white background; shapes are 8-12 px, drawn with hard
edges (every pixel is exactly a palette colour), separated by at least `GAP` pixels so that
4-connected components never merge. Triangles point up.

The held-out split is a fixed function of the prompt text (a hash), so it never depends on the
order in which prompts are listed and a held-out prompt can never reach training.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stepgrpo.images import from_uint8

SIZE = 32  # image side in pixels
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
WORD_COUNTS = {w: n for n, w in COUNT_WORDS.items()}
# Palette: far apart in RGB so the nearest-palette segmentation of a clean render is exact.
BACKGROUND = (255, 255, 255)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
}
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
SINGULARS = {p: s for s, p in PLURALS.items()}
RELATIONS = ("left of", "right of", "above", "below")
MIN_SIDE, MAX_SIDE = 8, 12  # object bounding-box side in pixels (inclusive)
GAP = 2  # minimum empty pixels between two objects' bounding boxes
HELD_OUT_MOD = 8  # one prompt in 8 (by hash) is held out


def vocabulary() -> list[str]:
    """Every word the grammar can produce, sorted (the tokenizers are trained on these)."""
    words = set(COUNT_WORDS.values()) | set(COLOURS) | set(SHAPES) | set(PLURALS.values())
    for rel in RELATIONS:
        words.update(rel.split())
    return sorted(words)


def object_phrase(count: int, colour: str, shape: str) -> str:
    """(2, "red", "circle") -> "two red circles"."""
    return f"{COUNT_WORDS[count]} {colour} {shape if count == 1 else PLURALS[shape]}"


def prompt_of(spec: dict[str, Any]) -> str:
    """The prompt text of a structured spec (inverse of `parse`)."""
    phrases = [object_phrase(o["count"], o["colour"], o["shape"]) for o in spec["objects"]]
    if spec["relation"] is None:
        return phrases[0]
    return f"{phrases[0]} {spec['relation']} {phrases[1]}"


_OBJECT = r"(a|two|three|four) (\w+) (\w+)"
_RELATION_RE = re.compile(rf"^{_OBJECT} ({'|'.join(RELATIONS)}) {_OBJECT}$")
_COUNT_RE = re.compile(rf"^{_OBJECT}$")


def _object(count_word: str, colour: str, noun: str) -> dict[str, Any]:
    count = WORD_COUNTS[count_word]
    shape = noun if count == 1 else SINGULARS.get(noun, "")
    if colour not in COLOURS or shape not in SHAPES:
        raise ValueError(f"not a shapes-grammar object: {count_word!r} {colour!r} {noun!r}")
    return {"count": count, "colour": colour, "shape": shape}


def parse(prompt: str) -> dict[str, Any]:
    """Prompt text -> structured spec; raises ValueError naming the prompt if it is not in the grammar."""
    text = " ".join(prompt.lower().split())
    m = _RELATION_RE.match(text)
    if m:
        g = m.groups()
        return {"objects": [_object(*g[0:3]), _object(*g[4:7])], "relation": g[3]}
    m = _COUNT_RE.match(text)
    if m:
        return {"objects": [_object(*m.groups())], "relation": None}
    raise ValueError(
        f"prompt {prompt!r} is not in the shapes grammar (e.g. 'two red circles', "
        "'a blue square left of a green triangle')"
    )


def all_specs() -> list[dict[str, Any]]:
    """Every prompt spec of the grammar: 60 count prompts, then 840 relation prompts."""
    specs: list[dict[str, Any]] = []
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    for n in COUNT_WORDS:
        for c, s in pairs:
            specs.append({"objects": [{"count": n, "colour": c, "shape": s}], "relation": None})
    for rel in RELATIONS:
        for a in pairs:
            for b in pairs:
                if a != b:
                    objs = [{"count": 1, "colour": x[0], "shape": x[1]} for x in (a, b)]
                    specs.append({"objects": objs, "relation": rel})
    return specs


def is_held_out(prompt: str) -> bool:
    """Fixed split by a hash of the prompt text (independent of list order and Python's hash seed)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return digest[0] % HELD_OUT_MOD == 0


def split(held_out: bool) -> list[dict[str, Any]]:
    """The specs of the training (`held_out=False`) or held-out (`True`) prompts."""
    return [s for s in all_specs() if is_held_out(prompt_of(s)) == held_out]


# ----------------------------------------------------------------------------------------------
# Renderer


def shape_mask(shape: str, side: int) -> np.ndarray:
    """`[side, side]` bool mask of one shape filling its bounding box (triangles point up)."""
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float64) + 0.5  # pixel centres
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "circle":
        r = side / 2
        return (xx - r) ** 2 + (yy - r) ** 2 <= r * r
    if shape == "triangle":
        # apex at the top centre, base on the bottom row: |x - c| <= (y / side) * side / 2
        c = side / 2
        return np.abs(xx - c) <= yy / 2 + 0.25
    raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")


@dataclass(frozen=True)
class Placement:
    """One drawn object: its top-left corner, side and identity."""

    x: int
    y: int
    side: int
    colour: str
    shape: str

    @property
    def centre(self) -> tuple[float, float]:
        """(x, y) of the bounding-box centre in pixels."""
        return self.x + self.side / 2, self.y + self.side / 2


def _separated(a: Placement, b: Placement) -> bool:
    return (
        a.x + a.side + GAP <= b.x or b.x + b.side + GAP <= a.x or a.y + a.side + GAP <= b.y or b.y + b.side + GAP <= a.y
    )


RELATION_MARGIN = 6.0  # rendered relations hold with at least this centre offset (px)


def relation_holds(rel: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    """Whether centre `a` is `rel` centre `b` by more than `margin` pixels (image y grows downwards)."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    if rel == "left of":
        return dx > margin
    if rel == "right of":
        return -dx > margin
    if rel == "above":
        return dy > margin
    if rel == "below":
        return -dy > margin
    raise ValueError(f"unknown relation {rel!r}; known relations: {', '.join(RELATIONS)}")


def place(spec: dict[str, Any], rng: np.random.Generator, max_tries: int = 2000) -> list[Placement]:
    """Random non-overlapping placements satisfying the spec (rejection sampling).

    Sides are drawn in [MIN_SIDE, MAX_SIDE]; when a crowded layout (four objects) keeps failing,
    the largest allowed side shrinks towards MIN_SIDE so a layout always exists.
    """
    objects = [(o["colour"], o["shape"]) for o in spec["objects"] for _ in range(o["count"])]
    for attempt in range(max_tries):
        hi = max(MIN_SIDE, MAX_SIDE - attempt // 200)
        placed: list[Placement] = []
        for colour, shape in objects:
            side = int(rng.integers(MIN_SIDE, hi + 1))
            for _ in range(20):
                x, y = (int(v) for v in rng.integers(0, SIZE - side + 1, size=2))
                p = Placement(x, y, side, colour, shape)
                if all(_separated(p, q) for q in placed):
                    placed.append(p)
                    break
            else:
                break
        if len(placed) != len(objects):
            continue
        if spec["relation"] is not None and not relation_holds(
            spec["relation"], placed[0].centre, placed[1].centre, RELATION_MARGIN
        ):
            continue
        return placed
    raise RuntimeError(f"could not place {prompt_of(spec)!r} in {max_tries} tries")


def draw(placements: Sequence[Placement]) -> np.ndarray:
    """`[SIZE, SIZE, 3]` uint8 image of the placements on the background."""
    img = np.empty((SIZE, SIZE, 3), np.uint8)
    img[:] = BACKGROUND
    for p in placements:
        mask = shape_mask(p.shape, p.side)
        img[p.y : p.y + p.side, p.x : p.x + p.side][mask] = COLOURS[p.colour]
    return img


def render(spec: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """A ground-truth `[SIZE, SIZE, 3]` uint8 image of `spec`, deterministic given `rng`'s state."""
    return draw(place(spec, rng))


def sample_batch(
    specs: Sequence[dict[str, Any]], batch: int, rng: np.random.Generator
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """A training batch: random specs (half count, half relation prompts) and their renders.

    Returns images `[batch, 3, SIZE, SIZE]` float in [0, 1], the prompts and the specs. Drawing
    the two families equally often keeps the 60 count prompts from being swamped by the
    relation prompts.
    """
    counts = [s for s in specs if s["relation"] is None]
    relations = [s for s in specs if s["relation"] is not None]
    chosen = []
    for _ in range(batch):
        pool = counts if (rng.random() < 0.5 and counts) or not relations else relations
        chosen.append(pool[int(rng.integers(len(pool)))])
    images = np.stack([render(s, rng) for s in chosen])
    return from_uint8(images), [prompt_of(s) for s in chosen], chosen
