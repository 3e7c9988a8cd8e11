"""A checkpoint evaluated under a paper's protocol (`stepgrpo.prompts.protocols`), and the evidence
bundle that shows it: `stepgrpo evaluate RUN --protocol NAME`.

Every (prompt, sample) pair of the protocol's prompt file is sampled by the ODE from its own seed
(the protocol's seeds rule), at the protocol's steps, size and guidance, in batches of
`model.max_batch` pairs (the last one short: no padding), scored by the protocol's reward, and
aggregated as the protocol says. The bundle (`<run>/evidence/<protocol>-<label>[-<settings>]/`)
holds `report.json` (the protocol, what was overridden, the aggregates each way, the per-task
table, N per prompt, the seeds rule), `samples.jsonl` (per pair: prompt, sample, seed, score,
correctness, the sha256 of the image's bytes), `config.json` (the resolved config),
`environment.json` (stepgrpo's version and commit, the packages' versions, the device, the
threads, wall-clock), optionally `images/`, and `CHECKSUMS.sha256` over all of them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import platform
import time
from dataclasses import asdict
from typing import Any

import torch

from stepgrpo.config import Config
from stepgrpo.loops import workspace
from stepgrpo.loops.scoring import score_images
from stepgrpo.prompts import find_prompt_file, prompt_source, read_prompt_file
from stepgrpo.prompts.protocols import Pairs, Protocol, aggregate, pairs
from stepgrpo.storage.run import Run, code_version
from stepgrpo_core.rollout import rollout as sample

PACKAGES = ("torch", "diffusers", "transformers", "peft", "numpy", "safetensors", "pillow", "zarr", "pyarrow")
SEEDS_RULE = (
    "sample j of the prompt with text p starts from torch.Generator().manual_seed(seed(p, j)), seed(p, j) = "
    "int.from_bytes(sha256((p + '\\n' + str(j)).encode()).digest()[:8], 'little') & (2**63 - 1); a prompt that "
    "appears k times in the file is one prompt with k x samples samples"
)


def protocol_prompts(p: Protocol, cfg: Config) -> tuple[list[str], list[dict[str, Any]]]:
    """The rows of the protocol's prompt file (a pinned file only after its hash is checked)."""
    if p.prompts == "shapes":
        shapes = prompt_source(cfg.model_copy(update={"run": cfg.run.model_copy(update={"prompts": "shapes"})}))
        ids = shapes.ids("test")
        return shapes.texts_of(ids), shapes.metadata_of(ids)
    return read_prompt_file(find_prompt_file(p.prompts))


def evaluate(
    run: Run, cfg: Config, p: Protocol, iteration: int | None, keep_images: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, bytes]]:
    """Sample and score every pair of `p` with the policy after `iteration` (None: the base model),
    `cfg` carrying the protocol's settings; returns the report, the per-pair rows and the images
    (PNG bytes by file name, when `keep_images`)."""
    texts, metadata = protocol_prompts(p, cfg)
    pr = pairs(p, texts, metadata)
    t0 = time.perf_counter()
    pol = workspace.policy_after(run, cfg, iteration)
    reward = workspace.reward(cfg.reward)
    sigmas = pol.sigmas(cfg.sampler.eval_steps)
    rows: list[dict[str, Any]] = []
    images_out: dict[str, bytes] = {}
    scores: list[float] = []
    strict: list[float] | None = []
    nfe0 = pol.nfe
    for c0 in range(0, len(pr.seeds), cfg.model.max_batch):
        idx = range(c0, min(len(pr.seeds), c0 + cfg.model.max_batch))
        x0 = torch.cat([pol.initial_noise(1, torch.Generator(pol.device).manual_seed(pr.seeds[i])) for i in idx])
        chunk_texts = [pr.texts[pr.prompt_of[i]] for i in idx]
        cond = pol.encode(chunk_texts)
        out = sample(pol.velocity, x0, sigmas, cond, kernel="ode")
        images = pol.decoder.decode_uint8(out.states[:, -1])
        scored = score_images(
            reward, images, chunk_texts, [pr.metadata[pr.prompt_of[i]] for i in idx], chunk=len(idx),
            device=pol.decoder.device,
        )  # fmt: skip
        for j, i in enumerate(idx):
            pixels = images[j].cpu().contiguous().numpy().tobytes()
            row = {
                "pair": i,
                "prompt": pr.prompt_of[i],
                "sample": pr.sample_of[i],
                "seed": pr.seeds[i],
                "score": float(scored.scores[j]),
                "image_sha256": hashlib.sha256(pixels).hexdigest(),
            }
            if scored.strict is not None:
                row["correct"] = float(scored.strict[j])
            rows.append(row)
            scores.append(row["score"])
            if keep_images:
                images_out[f"images/{i:06d}.png"] = _png(images[j])
        if scored.strict is None:
            strict = None
        elif strict is not None:
            strict += [float(x) for x in scored.strict]
    tags = [str(pr.metadata[pr.prompt_of[i]].get("tag", "")) for i in range(len(pr.seeds))]
    report = {
        "protocol": asdict(p),
        "prompts": len(pr.texts),
        "pairs": len(pr.seeds),
        "samples_per_prompt": _counts(pr),
        "seeds_rule": SEEDS_RULE,
        "results": aggregate(p, scores, strict, tags),
        "nfe": pol.nfe - nfe0,
        "seconds": time.perf_counter() - t0,
    }
    return report, rows, images_out


def _counts(pr: Pairs) -> dict[str, int]:
    """How many prompts have each number of samples (`{"4": 553}`)."""
    out: dict[str, int] = {}
    for n in pr.samples:
        out[str(n)] = out.get(str(n), 0) + 1
    return out


def _png(image: torch.Tensor) -> bytes:
    from stepgrpo.images import dequantize, to_pil

    buf = io.BytesIO()
    to_pil(dequantize(image[None]))[0].save(buf, format="PNG")  # uint8 -> float -> the same uint8
    return buf.getvalue()


def environment(cfg: Config, seconds: float) -> dict[str, Any]:
    """What produced the numbers: stepgrpo's version and commit, the packages, the device, the threads."""
    import stepgrpo

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = cfg.model.device
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
    return {
        "stepgrpo": stepgrpo.__version__,
        "commit": code_version()["git_commit"],
        "python": platform.python_version(),
        "packages": versions,
        "device": device,
        "device_name": name or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(seconds, 3),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def bundle_files(
    report: dict[str, Any], rows: list[dict[str, Any]], images: dict[str, bytes], cfg: Config, env: dict[str, Any]
) -> dict[str, bytes]:
    """The bundle's files (`stepgrpo.storage.bundle.write_bundle` adds the checksum list); the config
    as the model card publishes it (`portable`: no path of this machine in evidence one shares)."""
    from stepgrpo.reporting.card import portable

    return {
        "report.json": (json.dumps(report, indent=1, sort_keys=True) + "\n").encode(),
        "samples.jsonl": "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode(),
        "config.json": (json.dumps(portable(cfg), indent=1) + "\n").encode(),
        "environment.json": (json.dumps(env, indent=1, sort_keys=True) + "\n").encode(),
        **images,
    }
