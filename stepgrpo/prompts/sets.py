"""Prompt sets shipped as code: `run.prompts: geneval` and `run.prompts: ocr`.

Both are generated from a fixed seed, so every machine gets the same prompts, and split into
disjoint train and held-out prompts (`heldout` of them held out).

- `geneval`: GenEval-style prompts over the 80 COCO classes with GenEval's metadata (the format
  of its `evaluation_metadata.jsonl`, which the `geneval` reward checks): the six tasks
  single_object, two_object, counting (2-4, with the `exclude` clause of count + 1), colors,
  position (left of / right of / above / below, `position: [relation, 0]` on the second object)
  and color_attr, in GenEval's templates ("a photo of a red car", "a photo of a dog right of a
  cat"). Flow-GRPO trains on its own GenEval-style file (`dataset/geneval` of its repository);
  this set is the same kind of prompt, not that file.
- `ocr`: Flow-GRPO's text-rendering task: an object that shows a quoted text ('a neon sign that
  reads "OPEN LATE"'); the `ocr` reward scores the first quoted span. The held-out prompts use
  texts no training prompt has.
"""

from __future__ import annotations

import random
from typing import Any

COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book",
    "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
COUNTS = {2: "two", 3: "three", 4: "four"}
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
_PLURAL = {
    "person": "people", "sheep": "sheep", "skis": "pairs of skis", "scissors": "pairs of scissors",
    "knife": "knives", "couch": "couches", "bus": "buses", "sandwich": "sandwiches", "wine glass": "wine glasses",
    "toothbrush": "toothbrushes", "hair drier": "hair driers", "tv": "tvs",
}  # fmt: skip

OCR_SURFACES = (
    "a neon sign that reads", "a wooden sign that says", "a t-shirt printed with", "a coffee mug with the words",
    "a billboard that says", "a book cover titled", "a storefront sign reading", "a chalkboard that says",
    "a poster with the text", "a cake with icing that spells", "a license plate that reads", "a street sign for",
)  # fmt: skip
OCR_TEXTS = (
    "OPEN", "CLOSED", "SALE", "EXIT", "WELCOME", "COFFEE", "BAKERY", "HELLO WORLD", "STOP", "NO PARKING",
    "FRESH BREAD", "OPEN LATE", "BOOKS", "PIZZA", "FLOW", "GRPO", "DREAM BIG", "STAY CALM", "MAIN STREET",
    "HAPPY BIRTHDAY", "GOOD MORNING", "THANK YOU", "LIBRARY", "GARDEN", "MUSEUM", "TAXI", "HOTEL", "CAFE",
    "MARKET", "STUDIO", "ARCADE", "CINEMA", "PHARMACY", "GYM", "SUSHI", "TACOS", "JAZZ", "ROBOTS", "SPACE",
    "OCEAN", "MOUNTAIN", "RIVER", "SUNSET", "WINTER", "SUMMER", "AUTUMN", "SPRING", "KEEP OUT", "LOVE",
    "PEACE", "HOPE", "SMILE", "PARTY", "DANCE", "MUSIC", "TRAIN", "AIRPORT", "SCHOOL", "BANK", "POST",
)  # fmt: skip


def plural(name: str) -> str:
    if name in _PLURAL:
        return _PLURAL[name]
    return name + ("es" if name.endswith(("s", "sh", "ch", "x")) else "s")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def geneval_prompt(tag: str, rng: random.Random) -> dict[str, Any]:
    """One GenEval-style prompt of task `tag`, with its metadata."""
    a, b = rng.sample(COCO_CLASSES, 2)
    if tag == "single_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}], "prompt": f"a photo of {article(a)} {a}"}
    if tag == "two_object":
        include = [{"class": a, "count": 1}, {"class": b, "count": 1}]
        return {"tag": tag, "include": include, "prompt": f"a photo of {article(a)} {a} and {article(b)} {b}"}
    if tag == "counting":
        n = rng.choice(sorted(COUNTS))
        return {
            "tag": tag,
            "include": [{"class": a, "count": n}],
            "exclude": [{"class": a, "count": n + 1}],
            "prompt": f"a photo of {COUNTS[n]} {plural(a)}",
        }
    if tag == "colors":
        c = rng.choice(COLORS)
        return {
            "tag": tag,
            "include": [{"class": a, "count": 1, "color": c}],
            "prompt": f"a photo of {article(c)} {c} {a}",
        }
    if tag == "position":
        rel = rng.choice(RELATIONS)
        include = [{"class": a, "count": 1}, {"class": b, "count": 1, "position": [rel, 0]}]
        return {"tag": tag, "include": include, "prompt": f"a photo of {article(b)} {b} {rel} {article(a)} {a}"}
    if tag == "color_attr":
        c1, c2 = rng.sample(COLORS, 2)
        include = [{"class": a, "count": 1, "color": c1}, {"class": b, "count": 1, "color": c2}]
        return {
            "tag": tag,
            "include": include,
            "prompt": f"a photo of {article(c1)} {c1} {a} and {article(c2)} {c2} {b}",
        }
    raise ValueError(f"unknown GenEval task {tag!r}; tasks: {', '.join(TASKS)}")


def geneval_prompts(total: int = 6000, heldout: int = 600, seed: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """`total` distinct GenEval-style prompts (the six tasks in turn; single_object has only its
    80), the first `heldout` of a seeded shuffle held out: `(metadata rows, splits)`."""
    rng, rows, seen = random.Random(seed), [], set()
    for attempt in range(100 * total):
        if len(rows) == total:
            break
        row = geneval_prompt(TASKS[attempt % len(TASKS)], rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    rng.shuffle(rows)
    return rows, ["test"] * heldout + ["train"] * (total - heldout)


def ocr_prompts(heldout_texts: int = 12, seed: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """Every surface with every text; the prompts of `heldout_texts` texts held out."""
    rng = random.Random(seed)
    texts = list(OCR_TEXTS)
    rng.shuffle(texts)
    test = set(texts[:heldout_texts])
    rows = [{"prompt": f'{s} "{t}"', "text": t} for t in texts for s in OCR_SURFACES]
    return rows, ["test" if r["text"] in test else "train" for r in rows]


PROMPT_SETS = {"geneval": geneval_prompts, "ocr": ocr_prompts}
