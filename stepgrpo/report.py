"""What the flows tell people: run directories, MLflow metrics, Prefect artifacts, the console.

Kept out of `flows/` so that a flow reads like the algorithm.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stepgrpo.config import Config


def track(items: Sequence[Any] | range, description: str) -> Any:
    """Iterate with a transient progress bar on an interactive terminal (long stages), plainly otherwise."""
    import os

    if len(items) < 2 or not sys.stderr.isatty() or os.environ.get("STEPGRPO_PROGRESS", "1") == "0":
        return iter(items)
    from rich.console import Console
    from rich.progress import track as rich_track

    return rich_track(items, description=description, transient=True, console=Console(stderr=True))


def resolve_run_dir(cfg: Config, run_dir: str | None = None, run_id: str | None = None) -> Path:
    """`--run-dir` as given; else `<runs_root>/<run_id>`; else a new id `<name>-<UTC time>`."""
    if run_dir:
        return Path(run_dir).resolve()
    if not run_id:
        run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return (Path(cfg.run.runs_root) / run_id).resolve()


def iteration_metrics(refs: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """MLflow metrics of one iteration from its stage references."""
    r, c, u = refs["score"], refs["credit"], refs["update"]
    out: dict[str, float] = {
        "reward/mean": r.get("reward_mean"), "reward/std": r.get("reward_std"), "reward/strict": r.get("reward_strict"),
        "advantage/mean": c.get("adv_mean"), "advantage/std": c.get("adv_std"), "advantage/abs_max": c.get("adv_abs_max"),
        "zero_std_ratio": c.get("zero_std_ratio"), "turning_points": c.get("turning_points"),
        "clip_frac": u.get("clip_frac"), "approx_kl": u.get("approx_kl"), "kl": u.get("kl"), "loss": u.get("loss"),
        "ratio/mean": u.get("ratio_mean"), "ratio/min": u.get("ratio_min"), "ratio/max": u.get("ratio_max"),
        "grad_norm": u.get("grad_norm"),
        "nfe/rollout": refs["rollout"].get("nfe"), "nfe/complete": refs.get("complete", {}).get("nfe", 0),
    }
    for k, g in enumerate(c.get("gain_mean") or []):
        out[f"gain/step_{k}"] = g
    for stage, ref in refs.items():
        if "seconds" in ref:
            out[f"seconds/{stage}"] = ref["seconds"]
    return {k: float(v) for k, v in out.items() if isinstance(v, int | float) and math.isfinite(float(v))}


def eval_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    keys = ["reward_mean", "reward_std", "reward_strict"] + [k for k in result if k.startswith("sub_")]
    return {f"eval/{k.removeprefix('reward_')}": float(result[k]) for k in keys if k in result}


def _artifact_key(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:60] or "run"


def publish_artifacts(run_id: str, cfg: Config, rows: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]],
                      where: Mapping[str, str]) -> None:
    """A markdown summary and a reward table of the run, as Prefect artifacts (inside a flow run)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = _artifact_key(run_id)
    create_table_artifact(
        [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
        key=f"{key}-rewards", description=f"stepgrpo run {run_id}: reward per iteration",
    )
    lines = [f"# stepgrpo run `{run_id}`", "", f"config **{cfg.run.name}**: kernel `{cfg.sampler.kernel}`, "
             f"completion `{cfg.completion.method}`, reward `{cfg.reward.name}`, scheme `{cfg.credit.scheme}`, "
             f"{cfg.run.iterations} iterations of {cfg.run.prompts_per_iteration} x {cfg.run.group_size} trajectories", "",
             "| evaluation | held-out reward | strict |", "|---|---|---|"]
    for e in evals:
        lines.append(f"| {e['label']} | {e['reward_mean']:.4f} | {e.get('reward_strict', float('nan')):.4f} |")
    lines += ["", *(f"- {k}: `{v}`" for k, v in where.items())]
    create_markdown_artifact("\n".join(lines), key=f"{key}-summary", description=f"stepgrpo run {run_id}")


def print_summary(run_dir: Path, tracking_uri: str, evals: Sequence[Mapping[str, Any]]) -> None:
    """The end-of-run lines: held-out rewards and where everything is."""
    out = sys.stdout
    for e in evals:
        strict = f", strict {e['reward_strict']:.3f}" if "reward_strict" in e else ""
        name = "base model" if e["label"] == "base" else f"trained (iteration {int(e['label'].removeprefix('iter_')) + 1})"
        reward = f" ({e['reward_name']})" if "reward_name" in e else ""
        print(f"held-out reward{reward}, {name}: {e['reward_mean']:.4f}{strict}", file=out)
    print(f"run directory: {run_dir}", file=out)
    print(f"MLflow store:  {tracking_uri}", file=out)
    print(f"images:        {run_dir / 'eval'}", file=out)
