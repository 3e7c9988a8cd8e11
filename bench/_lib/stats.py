"""The statistics every question reads its records with: a run's held-out evaluations, the paired
difference of two, per-prompt means, intervals over seeds, clustered by prompt and bootstrapped over
both levels, the interval and verdict formats, and the claims table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench._lib.common import mean_ci


def read_evals(run_dir: Path) -> dict[int, dict[str, Any]]:
    from stepgrpo.results import EvaluateResult

    evals = {}
    for f in (run_dir / "eval").glob("*.json"):
        e = EvaluateResult.model_validate(json.loads(f.read_text())).record()
        if f.stem != e["label"]:
            continue  # an evaluation with other settings than the run's
        evals[0 if e["label"] == "base" else int(e["label"].removeprefix("iter_")) + 1] = e
    return evals


def paired(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, float, float]:
    """Mean of after - before over the paired held-out samples, with its 95 % interval."""
    from stepgrpo.reporting.report import paired_gain

    g = paired_gain(before, after)
    if g is None:
        raise SystemExit(f"evaluations {before['label']} and {after['label']} are not paired (other prompts or noise)")
    return g


def two_level(per_seed: dict[int, list[float]], draws: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """A paired difference over training seeds, each with one value per held-out prompt: the mean of
    the seeds' means and a two-level bootstrap 95 % interval (seeds resampled, then prompts within
    each; percentile), which carries both the training seeds' and the prompts' spread."""
    import random

    rng = random.Random(seed)
    seeds = sorted(per_seed)
    means = [sum(per_seed[k]) / len(per_seed[k]) for k in seeds]
    if len(seeds) < 2:
        return means[0], float("nan"), float("nan")
    out = []
    for _ in range(draws):
        total = 0.0
        for k in rng.choices(seeds, k=len(seeds)):
            rows = per_seed[k]
            total += sum(rng.choices(rows, k=len(rows))) / len(rows)
        out.append(total / len(seeds))
    out.sort()
    return sum(means) / len(means), out[int(0.025 * draws)], out[int(0.975 * draws) - 1]


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """First x where the piecewise-linear curve through `points` (x, reward) reaches `target`."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= target > y0:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
        if y0 >= target:
            return x0
    return points[-1][0] if points and points[-1][1] >= target else None


def fmt(x: float | None, d: int = 3, sign: bool = True) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def ci(v: dict[str, float], d: int = 3) -> str:
    return f"{fmt(v['mean'], d)} [{fmt(v['lo'], d)}, {fmt(v['hi'], d)}]"


def verdict(v: dict[str, float] | None, threshold: float = 0.0) -> str:
    """consistent: the interval lies above `threshold`; contradicted: below it; else not resolved."""
    if v is None or v.get("lo") != v.get("lo"):
        return "not resolved at this scale"
    if v["lo"] > threshold:
        return "consistent"
    if v["hi"] < threshold:
        return "contradicted"
    return "not resolved at this scale"


def claims_md(rows: list[dict[str, str]]) -> str:
    L = [
        "| paper | claim | measured here (95 % interval) | verdict |",
        "|---|---|---|---|",
    ]
    L += [f"| {r['paper']} | {r['claim']} | {r['measured']} | {r['verdict']} |" for r in rows]
    return "\n".join(L) + "\n"


def by_prompt(values: list[float], prompts: int) -> list[float]:
    """Per-sample values (seed-major) averaged over each prompt's noise seeds."""
    seeds = len(values) // prompts
    return [sum(values[j * prompts + p] for j in range(seeds)) / seeds for p in range(prompts)]


def pooled(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per seed, over seeds (t-interval), and clustered by prompt (each prompt averaged over seeds)."""
    from stepgrpo.reporting.report import mean_interval

    seeds = sorted(rows)
    out: dict[str, Any] = {"per_seed": {str(k): rows[k]["mean"] for k in seeds}, "n": len(seeds)}
    m, lo, hi = mean_ci([rows[k]["mean"] for k in seeds])
    out["seeds"] = {"mean": m, "lo": lo, "hi": hi}
    if seeds:
        P = len(rows[seeds[0]]["prompts"])
        per_prompt = [sum(rows[k]["prompts"][p] for k in seeds) / len(seeds) for p in range(P)]
        m, lo, hi = mean_interval(per_prompt)
        out["prompts"] = {"mean": m, "lo": lo, "hi": hi}
        m, lo, hi = two_level({k: rows[k]["prompts"] for k in seeds})
        out["bootstrap"] = {"mean": m, "lo": lo, "hi": hi}
    return out
