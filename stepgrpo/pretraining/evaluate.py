"""Held-out evaluation of a shapes pipeline: 10-step ODE sampling scored by the `shapes` reward.

`evaluate(pipe)` samples every held-out prompt once per seed with the pipeline's own Euler
scheduler (deterministic: the ODE, no noise after the initial latents), scores the images and
returns the per-category means per seed and over seeds. The model card's numbers come from
`python -m stepgrpo.pretraining.evaluate models/shapes --cfg 4 --seeds 0 1 2`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stepgrpo.rewards.shapes import CATEGORIES, ShapesReward
from stepgrpo.shapes import data

METRICS = ("score", "strict", *CATEGORIES)


@torch.no_grad()
def sample(
    pipe, prompts: Sequence[str], seed: int, guidance_scale: float, steps: int = 10, batch: int = 64
) -> torch.Tensor:
    """Images `[N, 3, H, W]` in [0, 1] for `N` prompts; initial latents from one generator seeded `seed`."""
    size = pipe.transformer.config.sample_size
    channels = pipe.transformer.config.in_channels
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(prompts), channels, size, size, generator=gen)  # [N, C, h, w]
    pipe.set_progress_bar_config(disable=True)
    dtype = pipe.transformer.dtype
    out = []
    for i in range(0, len(prompts), batch):
        images = pipe(
            list(prompts[i : i + batch]),
            latents=latents[i : i + batch].to(dtype),
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            height=size * pipe.vae_scale_factor,
            width=size * pipe.vae_scale_factor,
            max_sequence_length=0,  # no T5: the context is the two CLIPs' tokens only
            output_type="pt",
        ).images
        out.append(images.float())
    return torch.cat(out)


def _summary(sub: dict[str, torch.Tensor], scores: torch.Tensor, strict: torch.Tensor) -> dict[str, float]:
    m = {"score": float(scores.mean()), "strict": float(strict.mean())}
    for c in CATEGORIES:
        v = sub[c].numpy()
        m[c] = float(np.nanmean(v)) if np.isfinite(v).any() else math.nan
    return m


def evaluate(
    pipe,
    seeds: Sequence[int] = (0, 1, 2),
    guidance_scale: float = 4.0,
    steps: int = 10,
    specs: Sequence[dict[str, Any]] | None = None,
    batch: int = 64,
) -> dict[str, Any]:
    """Score `pipe` on `specs` (default: every held-out prompt) once per seed.

    Returns `{"mean": {metric: mean over seeds}, "std": {...}, "per_seed": [{metric: value}],
    "families": {"count"|"relation": {metric: mean over seeds}}, "n_prompts", "seeds",
    "guidance_scale", "steps"}`, metrics `score, strict, count, colour, shape, spatial`
    (category means skip prompts where the category does not apply).
    """
    specs = list(specs) if specs is not None else data.split(held_out=True)
    prompts = [data.prompt_of(s) for s in specs]
    reward = ShapesReward()
    family = np.array([s["relation"] is None for s in specs])
    per_seed, fam = [], {"count": [], "relation": []}
    for seed in seeds:
        out = reward(sample(pipe, prompts, seed, guidance_scale, steps, batch), prompts, specs)
        per_seed.append(_summary(out.sub, out.scores, out.strict))
        for name, sel in (("count", family), ("relation", ~family)):
            idx = torch.from_numpy(np.nonzero(sel)[0])
            if len(idx):
                fam[name].append(_summary({k: v[idx] for k, v in out.sub.items()}, out.scores[idx], out.strict[idx]))

    def mean(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: float(np.mean([r[k] for r in rows])) for k in METRICS}

    return {
        "mean": mean(per_seed),
        "std": {k: float(np.std([r[k] for r in per_seed])) for k in METRICS},
        "per_seed": per_seed,
        "families": {k: mean(v) for k, v in fam.items() if v},
        "n_prompts": len(prompts),
        "seeds": list(seeds),
        "guidance_scale": guidance_scale,
        "steps": steps,
    }


def sample_grid(pipe, path: str, seed: int = 0, guidance_scale: float = 4.0, n: int = 48, ncols: int = 8) -> list[str]:
    """Save a titled grid of `n` held-out samples to `path` (PNG); returns their prompts.

    Prompts: the first `n` held-out prompts after a fixed shuffle, count prompts first so every
    count and shape appears.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the sample grid is drawn with matplotlib: pip install 'stepgrpo[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = data.split(held_out=True)
    rng = np.random.default_rng(0)
    counts = [s for s in specs if s["relation"] is None]
    relations = [specs[i] for i in rng.permutation(len(specs)) if specs[i]["relation"] is not None]
    chosen = (counts + relations)[:n]
    prompts = [data.prompt_of(s) for s in chosen]
    images = sample(pipe, prompts, seed, guidance_scale)
    out = ShapesReward()(images, prompts, chosen)
    nrows = math.ceil(len(prompts) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * 1.9, nrows * 2.1))
    for ax in axes.flat:
        ax.axis("off")
    arr = images.permute(0, 2, 3, 1).numpy()
    for i, (ax, prompt) in enumerate(zip(axes.flat, prompts)):
        ax.imshow(arr[i], interpolation="nearest")
        words = prompt.split()
        title = " ".join(words[:4]) + ("\n" + " ".join(words[4:]) if len(words) > 4 else "")
        ax.set_title(f"{title}\n[{out.scores[i]:.2f}]", fontsize=7)
    fig.suptitle(f"held-out prompts, seed {seed}, cfg {guidance_scale}, 10 steps; [shapes score]", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return prompts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Evaluate a shapes pipeline directory on the held-out prompts.")
    p.add_argument("model", help="pipeline directory, e.g. models/shapes")
    p.add_argument("--cfg", type=float, nargs="+", default=[4.0], help="guidance scales to evaluate")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the results (a list, one per guidance scale) here")
    p.add_argument("--grid", help="save a sample grid PNG here (first guidance scale, first seed)")
    a = p.parse_args(argv)
    from stepgrpo.shapes.model import load_pipeline

    torch.set_num_threads(2)
    pipe = load_pipeline(a.model)
    results = []
    for g in a.cfg:
        r = evaluate(pipe, a.seeds, g, a.steps)
        results.append(r)
        line = " ".join(f"{k} {r['mean'][k]:.3f}±{r['std'][k]:.3f}" for k in METRICS)
        print(f"cfg {g}: {line}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.grid:
        sample_grid(pipe, a.grid, seed=a.seeds[0], guidance_scale=a.cfg[0])


if __name__ == "__main__":
    main()
