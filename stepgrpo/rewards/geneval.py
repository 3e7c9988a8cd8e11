"""`geneval`: GenEval's object-detector reward (Ghosh et al. 2023), as trained on by Flow-GRPO and DenseGRPO.

Every prompt carries GenEval's structured metadata (one line of its `evaluation_metadata.jsonl`):

    {"tag": "counting" | "colors" | "position" | "color_attr" | "two_object" | "single_object",
     "include": [{"class": "dog", "count": 2, "color": "red", "position": ["left of", 0]}, ...],
     "exclude": [{"class": "dog", "count": 3}, ...]}

`color` and `position` are optional; `position` is `[relation, index of an earlier include clause]`.

Pipeline, per image (shapes: `N` images, `Q` detections of one image):

1. detection: a COCO instance-segmentation Mask2Former (`Mask2FormerForUniversalSegmentation`),
   post-processed by transformers into `Q` (class, score, binary mask); the box of each detection is
   its mask's bounding box (as mmdet's Mask2Former derives it);
2. selection (`select`), per class: scores above `threshold` (0.3), or above `counting_threshold`
   (0.9) for `counting` prompts, best first, at most `max_objects` (16), then greedy suppression of
   boxes overlapping a kept one by IoU >= `max_overlap` (1.0: off, GenEval's default);
3. colour (`ColourClassifier`): the most confident `count` objects of each clause with a `color`
   are cut out (mask over a #999 grey background, cropped to the box) and classified zero-shot by
   CLIP ViT-L/14 among GenEval's ten colours, with its three templates per colour averaged;
4. rules (`check`): GenEval's `evaluate`, split into requirements that each pass or fail:
   - `count` per include clause: at least `count` objects of the class;
   - `color` per include clause with a colour: all of its `count` most confident objects have it;
   - `position` per include clause with a position: each of its objects stands in the relation to
     each object of the target clause (`relative_position`: box centres, with the offset reduced by
     `position_threshold` (0.1) times the two boxes' summed width/height, and the relation's
     direction taking over half of the unit offset);
   - `exclude` per exclude clause: fewer than `count` objects of the class.
   As in GenEval, a clause's colour is judged only when its count passed, its position only when
   count and colour passed (otherwise they fail), and a position whose target clause failed fails.

Output: `strict` = all requirements met (GenEval's per-image correctness; its score is the mean
per tag), `scores` = the fraction met (a partial score to train on, in the spirit of Flow-GRPO's
reward server), `sub` = the fraction met per requirement kind (`count`, `color`, `position`,
`exclude`), NaN where the prompt has none.

What differs from GenEval's released evaluator:
- detector: GenEval ran mmdetection's Mask2Former Swin-S COCO checkpoint; the default here is the
  transformers port `facebook/mask2former-swin-small-coco-instance` with transformers' image
  processor and instance post-processing (input resizing, and masks binarised at logit 0 on a
  fixed 384 x 384 grid before resizing to the image, follow transformers rather than mmdet's
  test pipeline; both score an instance as class probability x mean mask probability), so
  detections and scores differ slightly and absolute GenEval numbers are not directly comparable
  to published ones. Class names come from the checkpoint's
  `id2label`; a metadata class it does not know is an error rather than a silent miss;
- colour: transformers' `openai/clip-vit-large-patch14` and `CLIPProcessor` instead of open_clip's
  ViT-L-14 (the same OpenAI weights; preprocessing differs only in resampling details);
- both models run in fp32 by default, as GenEval's did: a threshold rule flips on rounding;
- the partial score: Flow-GRPO's reward server has its own partial-credit formula; ours is the
  plain fraction of requirements above and is not claimed to reproduce its numbers. `strict`
  reproduces GenEval's rules;
- the optional NMS (`max_overlap`) uses exclusive-end boxes; GenEval adds 1 px to widths.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from stepgrpo.images import from_uint8, to_pil, to_uint8
from stepgrpo.policy.devices import resolve_device, resolve_dtype
from stepgrpo.rewards.base import REWARDS, RewardOutput
from stepgrpo.rewards.clip_models import ClipEmbedder, _tag

DETECTOR = "facebook/mask2former-swin-small-coco-instance"
CLIP_MODEL = "openai/clip-vit-large-patch14"  # GenEval: open_clip ViT-L-14, pretrained="openai"
THRESHOLD = 0.3  # GenEval's detection score threshold
COUNTING_THRESHOLD = 0.9  # ... and its threshold for `counting` prompts
MAX_OBJECTS = 16  # GenEval's most detections kept per class
MAX_OVERLAP = 1.0  # GenEval's NMS IoU threshold; 1.0 disables it
POSITION_THRESHOLD = 0.1  # GenEval's margin, a fraction of the two boxes' summed size
DTYPE = "float32"
BATCH_SIZE = 8
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TEMPLATES = ("a photo of a {colour} {cls}", "a photo of a {colour}-colored {cls}", "a photo of a {colour} object")
CROP_BACKGROUND = 153  # GenEval's `bgcolor` #999 behind a masked crop
RELATIONS = ("left of", "right of", "above", "below")
KINDS = ("count", "color", "position", "exclude")
NO_OFFSET = 1e-3  # px; GenEval: a reduced offset below this in both axes is no relation
METADATA_HELP = (
    "geneval needs GenEval's structured metadata for every prompt: "
    '{"tag": "counting"|"colors"|"position"|"color_attr"|"two_object"|"single_object", '
    '"include": [{"class": <COCO name>, "count": <int>, '
    '"color"?: <colour>, "position"?: [<relation>, <clause index>]}], '
    '"exclude"?: [{"class": <COCO name>, "count": <int>}]} (a line of GenEval\'s evaluation_metadata.jsonl)'
)

Box = tuple[float, float, float, float]  # (x0, y0, x1, y1) in pixels, x1 and y1 exclusive


@dataclass(frozen=True)
class Detection:
    """One detected object."""

    label: str  # COCO class name
    score: float  # detector confidence in [0, 1]
    box: Box
    colour: str | None = None  # one of COLOURS once classified; only needed objects are
    mask: np.ndarray | None = field(default=None, compare=False, repr=False)  # [H, W] bool, or None: box only


@dataclass(frozen=True)
class Requirement:
    """One pass/fail check of a prompt's metadata against an image's detections."""

    kind: str  # one of KINDS
    clause: int  # index of the clause in `include` (count, color, position) or `exclude`
    met: bool
    reason: str = ""  # why it failed; empty when met


# ---------------------------------------------------------------------------------- rules


def validate_spec(meta: Mapping[str, Any], labels: Sequence[str] | None = None) -> Mapping[str, Any]:
    """Check one prompt's metadata; `labels`: the detector's class names (None: not checked)."""
    if not isinstance(meta, Mapping) or "include" not in meta or "tag" not in meta:
        raise ValueError(f"{METADATA_HELP}; got {dict(meta) if isinstance(meta, Mapping) else meta!r}")
    known = set(labels) if labels is not None else None
    for group in ("include", "exclude"):
        for i, clause in enumerate(meta.get(group) or []):
            where = f"metadata {group}[{i}] = {clause!r}"
            if "class" not in clause or not isinstance(clause.get("count"), int) or clause["count"] < 1:
                raise ValueError(f"{where}: needs 'class' and an integer 'count' >= 1")
            if known is not None and clause["class"] not in known:
                known_names = sorted(known)
                raise ValueError(
                    f"{where}: class {clause['class']!r} is not one of the detector's classes {known_names}"
                )
            if group == "include" and "color" in clause and clause["color"] not in COLOURS:
                raise ValueError(f"{where}: color must be one of {COLOURS}")
            if group == "include" and "position" in clause:
                relation, target = clause["position"]
                if relation not in RELATIONS or not (isinstance(target, int) and 0 <= target < i):
                    raise ValueError(f"{where}: position is [one of {RELATIONS}, index of an earlier include clause]")
    return meta


def _by_class(detections: Sequence[Detection]) -> dict[str, list[int]]:
    """Class -> indices into `detections`, most confident first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i in sorted(range(len(detections)), key=lambda i: -detections[i].score):
        groups[detections[i].label].append(i)
    return groups


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes (0 for empty ones)."""
    iw = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    ih = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def select(
    detections: Sequence[Detection],
    tag: str,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = MAX_OVERLAP,
) -> list[Detection]:
    """GenEval's per-class filtering: score above the tag's threshold, best `max_objects`, then greedy
    suppression at IoU >= `max_overlap` (1.0: none). Returns the kept ones, best first per class."""
    cutoff = counting_threshold if tag == "counting" else threshold
    kept = []
    for indices in _by_class(detections).values():
        ordered = [detections[i] for i in indices if detections[i].score > cutoff][:max_objects]
        while ordered:
            best = ordered.pop(0)
            kept.append(best)
            if max_overlap < 1.0:
                ordered = [d for d in ordered if box_iou(best.box, d.box) < max_overlap]
    return kept


def needs_colour(spec: Mapping[str, Any], detections: Sequence[Detection]) -> list[int]:
    """Indices of the detections whose colour `check` reads: the `count` most confident objects of
    each include clause with a `color`."""
    groups = _by_class(detections)
    wanted: set[int] = set()
    for clause in spec["include"]:
        if "color" in clause:
            wanted.update(groups.get(clause["class"], [])[: clause["count"]])
    return sorted(wanted)


def relative_position(a: Box, b: Box, position_threshold: float = POSITION_THRESHOLD) -> set[str]:
    """GenEval's relations of box `a` to box `b` (image y grows downwards).

    offset = centre(a) - centre(b); each axis is shrunk towards 0 by `position_threshold` times the
    two boxes' summed size on that axis; a relation holds when its direction carries more than half
    of the unit offset, e.g. `dx = shrunk_x / |offset| < -0.5` -> "left of".
    """
    ca = np.array([(a[0] + a[2]) / 2, (a[1] + a[3]) / 2])
    cb = np.array([(b[0] + b[2]) / 2, (b[1] + b[3]) / 2])
    size = np.array([a[2] - a[0] + b[2] - b[0], a[3] - a[1] + b[3] - b[1]])
    offset = ca - cb
    shrunk = np.maximum(np.abs(offset) - position_threshold * size, 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < NO_OFFSET):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return found


def check(
    spec: Mapping[str, Any], detections: Sequence[Detection], position_threshold: float = POSITION_THRESHOLD
) -> list[Requirement]:
    """GenEval's `evaluate` as a list of requirements, from an image's selected detections.

    Colour reads `Detection.colour` of the objects `needs_colour` names; it must be set there.
    """
    groups = _by_class(detections)
    out: list[Requirement] = []
    matched: list[list[Detection] | None] = []  # per include clause: its objects, None if it failed
    for i, clause in enumerate(spec["include"]):
        cls, count = clause["class"], clause["count"]
        found = [detections[j] for j in groups.get(cls, [])[:count]]
        ok = len(found) >= count
        out.append(Requirement("count", i, ok, "" if ok else f"expected {cls}>={count}, found {len(found)}"))
        if "color" in clause:
            colour, reason = clause["color"], "count failed"
            if ok:
                if any(d.colour is None for d in found):
                    raise ValueError(
                        f"include[{i}]: a {cls} detection has no colour (classify what needs_colour names)"
                    )
                seen = [d.colour for d in found]
                ok = seen.count(colour) >= count
                reason = f"expected {colour} {cls}>={count}, found colours {seen}"
            out.append(Requirement("color", i, ok, "" if ok else reason))
        if "position" in clause:
            relation, target = clause["position"]
            reason = "count or colour failed"
            if ok and matched[target] is None:
                ok, reason = False, f"no target for {cls} to be {relation}"
            elif ok:
                for obj in found:
                    for other in matched[target]:
                        rels = relative_position(obj.box, other.box, position_threshold)
                        if relation not in rels:
                            ok, reason = False, f"expected {cls} {relation} target, found {sorted(rels)}"
                            break
                    if not ok:
                        break
            out.append(Requirement("position", i, ok, "" if ok else reason))
        matched.append(found if ok else None)
    for i, clause in enumerate(spec.get("exclude") or []):
        n = len(groups.get(clause["class"], []))
        ok = n < clause["count"]
        reason = "" if ok else f"expected {clause['class']}<{clause['count']}, found {n}"
        out.append(Requirement("exclude", i, ok, reason))
    return out


def aggregate(rows: Sequence[Sequence[Requirement]]) -> RewardOutput:
    """`N` images' requirements -> scores (fraction met), strict (all met), sub (fraction per kind)."""

    def fraction(reqs: Sequence[Requirement]) -> float:
        return sum(r.met for r in reqs) / len(reqs) if reqs else math.nan

    scores = torch.tensor([fraction(r) for r in rows], dtype=torch.float32)
    strict = torch.tensor([float(all(q.met for q in r)) for r in rows], dtype=torch.float32)
    sub = {k: torch.tensor([fraction([q for q in r if q.kind == k]) for r in rows], dtype=torch.float32) for k in KINDS}
    return RewardOutput(scores=scores, strict=strict, sub=sub)


# --------------------------------------------------------------------------------- models


class Detector:
    """Mask2Former instance segmentation: `[N, 3, H, W]` in [0, 1] -> per image, its detections.

    model: hub id or directory of a `Mask2FormerForUniversalSegmentation`; processor: of its image
    processor (default: model). Detections scoring below `min_score` are dropped.
    """

    def __init__(
        self,
        model: str,
        processor: str | None = None,
        device: str | None = None,
        dtype: str | None = DTYPE,
        batch_size: int = BATCH_SIZE,
    ) -> None:
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.processor = AutoImageProcessor.from_pretrained(processor or model)
        self.model = Mask2FormerForUniversalSegmentation.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        self.labels = {int(k): v for k, v in self.model.config.id2label.items()}
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, min_score: float) -> list[list[Detection]]:
        pil = to_pil(images)
        size = tuple(images.shape[-2:])
        found: list[list[Detection]] = []
        for start in range(0, len(pil), self.batch_size):
            inputs = self.processor(images=pil[start : start + self.batch_size], return_tensors="pt")
            out = self.model(pixel_values=inputs["pixel_values"].to(self.device, self.dtype))
            # post-process in fp32 on the CPU: transformers writes its CPU label map with the masks
            out.class_queries_logits = out.class_queries_logits.float().cpu()
            out.masks_queries_logits = out.masks_queries_logits.float().cpu()
            results = self.processor.post_process_instance_segmentation(
                out, threshold=min_score, target_sizes=[size] * len(out.class_queries_logits), return_binary_maps=True
            )
            found += [self._detections(r) for r in results]
        return found

    def _detections(self, result: Mapping[str, Any]) -> list[Detection]:
        info = result["segments_info"]
        if not info:  # no binary maps then, only an empty label map
            return []
        masks = result["segmentation"].bool().numpy()  # [Q, H, W]
        out = []
        for seg, mask in zip(info, masks):
            ys, xs = np.nonzero(mask)
            box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
            out.append(Detection(self.labels[seg["label_id"]], float(seg["score"]), box, mask=mask))
        return out


def crop(image: np.ndarray, detection: Detection) -> np.ndarray:
    """GenEval's colour crop of one `[H, W, 3]` uint8 image: the object's mask over #999 grey, cut to its box."""
    if detection.mask is not None:
        image = np.where(detection.mask[..., None], image, np.uint8(CROP_BACKGROUND))
    x0, y0, x1, y1 = (int(round(v)) for v in detection.box)
    return image[y0:y1, x0:x1]


class ColourClassifier:
    """CLIP zero-shot colour of object crops among `COLOURS`, with GenEval's templates.

    Each colour's text embedding is the mean of its unit template embeddings, renormalised (as
    clip_benchmark's zero-shot classifier that GenEval calls); the colour is the best cosine.
    """

    def __init__(self, embedder: ClipEmbedder) -> None:
        self.embedder = embedder
        self._classifiers: dict[str, torch.Tensor] = {}  # class name -> [len(COLOURS), D]

    def classifier(self, cls: str) -> torch.Tensor:
        if cls not in self._classifiers:
            texts = [t.format(colour=c, cls=cls) for c in COLOURS for t in TEMPLATES]
            emb = self.embedder.texts(texts).reshape(len(COLOURS), len(TEMPLATES), -1).mean(1)
            self._classifiers[cls] = torch.nn.functional.normalize(emb, dim=-1)
        return self._classifiers[cls]

    def __call__(self, crops: Sequence[np.ndarray], classes: Sequence[str]) -> list[str]:
        """`crops`: `[h_i, w_i, 3]` uint8 arrays; `classes`: each crop's class name -> colour names."""
        feats: list[torch.Tensor | None] = [None] * len(crops)
        by_shape: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, c in enumerate(crops):  # crops of one size go through CLIP as one batch
            by_shape[c.shape].append(i)
        for indices in by_shape.values():
            emb = self.embedder.images(from_uint8(np.stack([crops[i] for i in indices])))
            for i, e in zip(indices, emb):
                feats[i] = e
        return [COLOURS[int((self.classifier(cls) @ f).argmax())] for f, cls in zip(feats, classes)]


# --------------------------------------------------------------------------------- reward


@dataclass(frozen=True)
class Rules:
    """GenEval's thresholds (see the module docstring)."""

    threshold: float = THRESHOLD  # detection score threshold
    counting_threshold: float = COUNTING_THRESHOLD  # the threshold for `counting` prompts
    max_objects: int = MAX_OBJECTS  # most detections kept per class
    max_overlap: float = MAX_OVERLAP  # NMS IoU; 1.0: no suppression
    position_threshold: float = POSITION_THRESHOLD  # relation margin, fraction of the boxes' size

    def __post_init__(self) -> None:
        for name in ("threshold", "counting_threshold", "position_threshold"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"geneval option {name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.max_overlap <= 1.0:
            raise ValueError(f"geneval option max_overlap must be in (0, 1], got {self.max_overlap}")
        if self.max_objects < 1:
            raise ValueError(f"geneval option max_objects must be >= 1, got {self.max_objects}")


class GenEval:
    """The `geneval` scorer: `(images [N, 3, H, W] in [0, 1], prompts, metadata) -> RewardOutput`."""

    name = "geneval"

    def __init__(self, detector: Detector, colours: ColourClassifier, rules: Rules, version: str) -> None:
        self.detector = detector
        self.colours = colours
        self.rules = rules
        self.version = version

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        n = images.shape[0]
        if len(prompts) != n:
            raise ValueError(f"got {n} images but {len(prompts)} prompts")
        if len(metadata) != n:
            raise ValueError(f"got {n} images but {len(metadata)} metadata dicts; {METADATA_HELP}")
        labels = list(self.detector.labels.values())
        specs = []
        for i, meta in enumerate(metadata):
            try:
                specs.append(validate_spec(meta, labels))
            except ValueError as err:
                raise ValueError(f"prompt {i} ({prompts[i]!r}): {err}") from None
        r = self.rules
        raw = self.detector(images, min(r.threshold, r.counting_threshold))
        kept = [
            select(d, s["tag"], r.threshold, r.counting_threshold, r.max_objects, r.max_overlap)
            for d, s in zip(raw, specs)
        ]
        # one CLIP pass over every crop whose colour a rule reads
        arr = to_uint8(images)
        wanted = [(i, j) for i, (s, d) in enumerate(zip(specs, kept)) for j in needs_colour(s, d)]
        names = self.colours([crop(arr[i], kept[i][j]) for i, j in wanted], [kept[i][j].label for i, j in wanted])
        for (i, j), colour in zip(wanted, names):
            kept[i][j] = replace(kept[i][j], colour=colour)
        return aggregate([check(s, d, r.position_threshold) for s, d in zip(specs, kept)])


def _identity(
    detector: str,
    clip: str,
    threshold: float,
    counting_threshold: float,
    max_objects: int,
    max_overlap: float,
    position_threshold: float,
    **_: Any,
) -> tuple[str, str]:
    rules = Rules(threshold, counting_threshold, max_objects, max_overlap, position_threshold)
    options = (
        ""
        if rules == Rules()
        else (f"+t{threshold:g},c{counting_threshold:g},m{max_objects},o{max_overlap:g},p{position_threshold:g}")
    )
    return "geneval", "1" + _tag(detector, DETECTOR) + _tag(clip, CLIP_MODEL) + options


@REWARDS.register("geneval", identity=_identity, hub=("detector", "detector_processor", "clip", "clip_processor"))
def geneval(
    detector: str = DETECTOR,
    detector_processor: str | None = None,
    clip: str = CLIP_MODEL,
    clip_processor: str | None = None,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = MAX_OVERLAP,
    position_threshold: float = POSITION_THRESHOLD,
    device: str | None = None,
    dtype: str | None = DTYPE,
    batch_size: int = BATCH_SIZE,
) -> GenEval:
    """GenEval: Mask2Former (COCO) detections + CLIP ViT-L/14 colours + GenEval's rules."""
    rules = Rules(threshold, counting_threshold, max_objects, max_overlap, position_threshold)
    _, version = _identity(detector, clip, threshold, counting_threshold, max_objects, max_overlap, position_threshold)
    embedder = ClipEmbedder(clip, clip_processor, device, dtype, batch_size)
    detect = Detector(detector, detector_processor, device, dtype, batch_size)
    return GenEval(detect, ColourClassifier(embedder), rules, version)
