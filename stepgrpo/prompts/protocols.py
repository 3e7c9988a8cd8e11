"""The papers' evaluation protocols, as data: which prompt file (pinned by repository, commit, path
and hash), how many samples a prompt, the seed of each (prompt, sample), the generation settings,
the scorer and the aggregation. `stepgrpo evaluate RUN --protocol NAME` runs one
(`stepgrpo.loops.protocol`) and writes its evidence bundle.

The seeds rule (every protocol): sample `j` of the prompt with text `p` starts from the initial
noise of `torch.Generator().manual_seed(seed(p, j))`, `seed(p, j)` = the first 8 bytes of
`sha256(p + "\\n" + str(j))`, little-endian, masked to 63 bits (`sample_seed`). The papers' code fixes
no per-sample seed; this one makes a protocol's images the same on every run of one machine, and
the same prompt's images the same in every protocol that samples it. A prompt that appears more
than once in a file (DrawBench's 200 prompts x 5, the training repositories' GenEval file of 553 x
4) is one prompt with that many samples: no two rows share a seed, and no batch is padded with
duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepgrpo.errors import StageError
from stepgrpo_core.registry import Registry


@dataclass(frozen=True)
class Protocol:
    name: str
    prompts: str  # a prompt source: `pinned:NAME`, or a built-in set (`shapes`)
    samples: int  # images a prompt (after duplicate rows are merged: `samples x` their count)
    steps: int  # ODE steps
    resolution: int | None  # pixels a side (None: the model's own)
    guidance: float  # CFG scale (1.0: none)
    negative_prompt: str
    reward: str  # the scorer (`stepgrpo.rewards` name)
    scorer: str  # its models, ids and versions, as the papers name them
    aggregation: str  # `geneval_tasks`: the mean of the per-task accuracies first; `mean`: the image mean
    report_scale: float = 1.0  # the papers' unit (PickScore: the logit / 26 reward x 26)
    paper: str = ""  # whose numbers this protocol reproduces, and where its settings come from
    device_dependent: tuple[str, ...] = field(default=())  # what may differ between machines

    def overrides(self) -> list[str]:
        """`settings` as `key=value` overrides (the model's own resolution where it names none)."""
        return [f"{k}={v}" for k, v in self.settings().items() if v is not None]

    def settings(self) -> dict[str, Any]:
        """The generation settings, as a config override would name them."""
        return {
            "sampler.eval_steps": self.steps,
            "model.resolution": self.resolution,
            "model.guidance_scale": self.guidance,
            "reward.name": self.reward,
        }


_GPU = (
    "the images (bf16 kernels and attention differ between GPU models and library versions), hence the "
    "scores; the prompts, seeds and aggregation do not"
)
_BUILT_IN: dict[str, Protocol] = {
    "geneval": Protocol(
        "geneval",
        "pinned:geneval_official",
        4,
        40,
        512,
        4.5,
        "",
        "geneval",
        "GenEval's rules (djghosh13/geneval): thresholds 0.3 (0.9 counting), at most 16 objects a class, no NMS "
        "(1.0), position threshold 0.1; its detector Mask2Former Swin-S COCO as transformers' port "
        "(facebook/mask2former-swin-small-coco-instance; GenEval ran mmdetection's checkpoint: detections differ "
        "slightly) and CLIP ViT-L/14 (openai/clip-vit-large-patch14) for colours",
        "geneval_tasks",
        paper="Flow-GRPO Table 1 (arXiv 2505.05470): 40 steps, 512 px, CFG 4.5, negative prompt ''; "
        "GenEval's 553 official prompts x 4 (arXiv 2310.11513)",
        device_dependent=(_GPU,),
    ),
    "ocr": Protocol(
        "ocr",
        "pinned:ocr",
        1,
        40,
        512,
        4.5,
        "",
        "ocr",
        "PaddleOCR's PP-OCR models through rapidocr-onnxruntime (the weights ship in its wheel); 1 - min(edit "
        "distance, L) / L on the first quoted span, lower-cased, spaces removed",
        "mean",
        paper="Flow-GRPO's OCR evaluation (its dataset/ocr/test.txt, 1,018 prompts, one image each)",
        device_dependent=(_GPU,),
    ),
    "pickscore": Protocol(
        "pickscore",
        "pinned:pickscore",
        1,
        40,
        512,
        4.5,
        "",
        "pickscore",
        "PickScore_v1 (yuvalkirstain/PickScore_v1) with the CLIP-H processor (laion/CLIP-ViT-H-14-laion2B-s32B-b79K); "
        "the reward is the logit / 26, the papers report x 26",
        "mean",
        report_scale=26.0,
        paper="Flow-GRPO's PickScore evaluation (its dataset/pickscore/test.txt, 2,048 prompts)",
        device_dependent=(_GPU,),
    ),
    "drawbench": Protocol(
        "drawbench",
        "pinned:drawbench",
        1,
        40,
        512,
        4.5,
        "",
        "pickscore",
        "PickScore_v1 as in the pickscore protocol (DiffusionNFT also reports CLIPScore and HPSv2.1 on it)",
        "mean",
        report_scale=26.0,
        paper="DiffusionNFT's DrawBench evaluation (its dataset/drawbench/test.txt: 200 prompts x 5)",
        device_dependent=(_GPU,),
    ),
    "shapes": Protocol(
        "shapes",
        "shapes",
        2,
        10,
        None,
        1.0,
        "",
        "shapes",
        "the shipped shapes detector (stepgrpo.rewards.shapes: colour, count and shape per image)",
        "mean",
        paper="this project's CPU protocol: the shipped model's 126 held-out prompts x 2 (the shapes recipes' "
        "held-out evaluation), its own 10-step grid and no CFG",
        device_dependent=(
            "float32 CPU kernels: bit-identical on one machine; another CPU type may differ in the "
            "last bits of the images, rarely in a score",
        ),
    ),  # fmt: skip
}


# The protocols as a registry (the one list: `stepgrpo config variants` prints it, the docs cite it);
# an entry returns its `Protocol`, and its paper is a fact like every variant's.
PROTOCOLS: Registry[Callable[[], Protocol]] = Registry("evaluation protocol")


def _register(p: Protocol) -> None:
    def entry() -> Protocol:
        return p

    entry.__doc__ = (
        f"{p.reward} on {p.prompts.removeprefix('pinned:')}, {p.samples} a prompt, {p.steps} steps, CFG {p.guidance:g}."
    )
    PROTOCOLS.register(p.name, paper=p.paper or None, pattern=f"--protocol {p.name}")(entry)


for _p in _BUILT_IN.values():
    _register(_p)


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise StageError(f"no evaluation protocol {name!r}; protocols: {', '.join(PROTOCOLS.names())}")
    return PROTOCOLS.get(name)()


def sample_seed(text: str, sample: int) -> int:
    """The seed of sample `sample` of the prompt `text` (module doc)."""
    digest = hashlib.sha256(f"{text}\n{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class Pairs:
    """A protocol's (prompt, sample) pairs, in order: every prompt's samples together."""

    texts: list[str]  # the distinct prompts
    metadata: list[dict[str, Any]]  # each prompt's first row's metadata (GenEval's `tag`, ...)
    samples: list[int]  # samples per prompt
    prompt_of: list[int]  # per pair: its prompt
    sample_of: list[int]  # per pair: its sample index
    seeds: list[int]  # per pair: `sample_seed`


def pairs(p: Protocol, texts: list[str], metadata: list[dict[str, Any]]) -> Pairs:
    """The (prompt, sample) pairs of `p` over a prompt file's rows: duplicate rows merged (module doc)."""
    count: dict[str, int] = {}
    first: dict[str, dict[str, Any]] = {}
    for text, meta in zip(texts, metadata):
        count[text] = count.get(text, 0) + 1
        first.setdefault(text, meta)
    distinct = list(count)
    samples = [count[t] * p.samples for t in distinct]
    prompt_of = [i for i, n in enumerate(samples) for _ in range(n)]
    sample_of = [j for n in samples for j in range(n)]
    seeds = [sample_seed(distinct[i], j) for i, j in zip(prompt_of, sample_of)]
    return Pairs(distinct, [first[t] for t in distinct], samples, prompt_of, sample_of, seeds)


def aggregate(p: Protocol, scores: list[float], strict: list[float] | None, tags: list[str]) -> dict[str, Any]:
    """The protocol's numbers from per-image values (`tags`: each image's task, GenEval's `tag`).

    `geneval_tasks`: GenEval's official score first, the mean of the per-task accuracies (an image
    is correct when `strict` is 1), then the image mean of correctness (what the training
    repositories log) and the mean partial score; `mean`: the image mean of the score (x
    `report_scale`) and of `strict` where the scorer gives one."""
    n = len(scores)
    out: dict[str, Any] = {"images": n}
    if p.aggregation == "geneval_tasks":
        if strict is None:
            raise StageError(f"protocol {p.name}: the reward {p.reward!r} gives no per-image correctness")
        tasks: dict[str, list[float]] = {}
        for tag, c in zip(tags, strict):
            tasks.setdefault(tag or "untagged", []).append(c)
        per_task = {t: sum(v) / len(v) for t, v in sorted(tasks.items())}
        out["headline"] = {
            "name": "task mean (GenEval's official overall)",
            "value": sum(per_task.values()) / len(per_task),
        }
        out["tasks"] = {t: {"accuracy": a, "images": len(tasks[t])} for t, a in per_task.items()}
        out["image_mean"] = sum(strict) / n
        out["score_mean"] = sum(scores) / n
        return out
    scale = p.report_scale
    out["headline"] = {
        "name": f"mean {p.reward}" + (f" x {scale:g}" if scale != 1 else ""),
        "value": scale * sum(scores) / n,
    }
    if strict is not None:
        out["strict_mean"] = sum(strict) / n
    return out
