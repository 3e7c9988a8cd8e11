"""What the pipeline tells people: progress bars, the signal check, paired gains, Prefect
artifacts, image grids and the end-of-run summary (`stepgrpo.flows.progress` logs a training flow)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stepgrpo.config import Config
from stepgrpo.results import UpdateStats


def track(items: Sequence[Any] | range, description: str) -> Any:
    """Iterate with a transient progress bar on an interactive terminal (long stages), plainly otherwise."""
    import os

    if len(items) < 2 or not sys.stderr.isatty() or os.environ.get("STEPGRPO_PROGRESS", "1") == "0":
        return iter(items)
    from rich.console import Console
    from rich.progress import track as rich_track

    return rich_track(items, description=description, transient=True, console=Console(stderr=True))


# The signal check (`training.Diagnostics`, `training.accumulate_signal`): the cosine between the
# gradients of two disjoint halves of a batch, each summed over the last ~20 iterations. It has
# power where a batch holds enough trajectories for its gradient to rise above its noise; on the
# shipped shapes model at 64 trajectories an iteration it reads noise for the recipe that learns
# as well as for one that does not (docs/bench/learning/README.md), so the line it prints says
# what it measured and where to look, not that the run is broken.
NOISE_WINDOW = 20
NOISE_COSINE = 0.05


class SignalWatch:
    """Says once, in one line, when the summed signal check reads noise (module constants)."""

    def __init__(self) -> None:
        self.said = False

    def see(self, iteration: int, update: UpdateStats) -> str | None:
        cos, n = update.signal_cosine_window, update.signal_iterations
        if self.said or cos is None or not math.isfinite(cos) or n < NOISE_WINDOW or cos >= NOISE_COSINE:
            return None
        self.said = True
        return (
            f"iteration {iteration}: the signal check reads noise: the gradients of two halves of the batches, summed "
            f"over the last ~{NOISE_WINDOW} iterations, have a cosine of {cos:+.3f} (below {NOISE_COSINE}), so each "
            "update "
            "is mostly noise at this batch size and any learning comes from many iterations; judge it by the held-out "
            "evaluations, and if they do not rise see `stepgrpo inspect` (where the gradient energy sits) and "
            "docs/bench/learning/README.md"
        )


def stored_evaluations(run: Any) -> list[dict[str, Any]]:
    """A stored run's held-out evaluation records in order: the base model's first, then each
    checkpoint's by iteration (`eval/base.json`, `eval/iter_<k>.json`; their seals checked)."""
    from stepgrpo.storage.publish import read_json

    later = sorted(run.record_paths(run.EVAL_DIR, "iter_*"), key=lambda p: int(p.stem.removeprefix("iter_")))
    base = run.record_path(run.EVAL_DIR, "base")
    return [read_json(p, "evaluation record") for p in [base, *later] if p.is_file()]


def paired_gain(
    before: Mapping[str, Any], after: Mapping[str, Any], key: str = "scores"
) -> tuple[float, float, float] | None:
    """Mean of `after - before` over paired held-out samples and its 95 % t-interval over prompts;
    None when the two evaluations are not paired (other prompts, seeds or an older record without
    scores).

    The noise seeds of one prompt are not independent samples (they share the prompt's difficulty),
    so the interval treats the prompt as the unit: each prompt's differences are averaged over its
    seeds first (scores are seed-major, `EvaluateResult`), then the t-interval is taken over the
    prompts. With one seed a prompt this is the plain paired interval."""
    a, b = before.get(key), after.get(key)
    if (
        not a
        or not b
        or len(a) != len(b)
        or (before.get("prompts"), before.get("seeds")) != (after.get("prompts"), after.get("seeds"))
    ):
        return None
    prompts = int(before.get("prompts") or len(a))
    seeds = len(a) // prompts if prompts and len(a) % prompts == 0 else 1
    diffs = [y - x for x, y in zip(a, b)]
    if seeds > 1:
        diffs = [sum(diffs[s * prompts + p] for s in range(seeds)) / seeds for p in range(prompts)]
    return mean_interval(diffs)


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """`(mean, low, high)`: the mean and its two-sided t-interval (a point when fewer than 2 values)."""
    from scipy import stats

    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, m, m
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return m, m - half, m + half


def iteration_line(row: Mapping[str, Any]) -> str:
    """One console line of an iteration, e.g.

    `iteration 3: reward 0.7012 (ODE 0.7101), clip_frac 0.004, signal cos +0.081 (20 it. +0.210), LoRA moved 0.0123`
    """

    def num(key: str, fmt: str) -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, int | float) and math.isfinite(v) else "n/a"

    ode = f" (ODE {num('ode_reward_mean', '.4f')})" if row.get("ode_reward_mean") is not None else ""
    head = f"iteration {row['iteration']}: reward {num('reward_mean', '.4f')}{ode}, "
    if row.get("signal_cosine") is None and row.get("loss") is not None:  # no per-step signal check: its loss
        clip = f"clip_frac {num('clip_frac', '.3f')}, " if row.get("clip_frac") is not None else ""
        return head + f"loss {num('loss', '.4f')}, {clip}LoRA moved {num('lora_distance', '.4f')}"
    return head + (
        f"clip_frac {num('clip_frac', '.3f')}, signal cos {num('signal_cosine', '+.3f')} "
        f"(20 it. {num('signal_cosine_window', '+.3f')}), "
        f"LoRA moved {num('lora_distance', '.4f')}"
    )


def _artifact_key(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:60] or "run"


def publish_reward_table(run_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """The run's reward table as a Prefect artifact (inside a flow run), published again after
    every iteration under one key: the UI shows the latest, with the earlier versions kept."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
        key=f"{_artifact_key(run_id)}-rewards",
        description=f"stepgrpo run {run_id}: reward per iteration (iter_k: the rollout of iteration k)",
    )


def publish_summary(run_id: str, cfg: Config, evals: Sequence[Mapping[str, Any]], where: Mapping[str, str]) -> None:
    """The run's markdown summary as a Prefect artifact (inside a flow run): held-out rewards, where things are."""
    from prefect.artifacts import create_markdown_artifact

    key = _artifact_key(run_id)
    lines = [
        f"# stepgrpo run `{run_id}`",
        "",
        f"config **{cfg.run.name}**: kernel `{cfg.sampler.sde_solver or cfg.sampler.kernel}`, "
        f"completion `{cfg.completion.method}`, reward `{cfg.reward.name}`, scheme `{cfg.credit.scheme}`, "
        f"{cfg.run.iterations} iterations of {cfg.run.prompts_per_iteration} x {cfg.run.group_size} trajectories",
        "",
        "| evaluation | held-out reward | strict |",
        "|---|---|---|",
    ]
    for e in evals:
        lines.append(f"| {e['label']} | {e['reward_mean']:.4f} | {e.get('reward_strict', float('nan')):.4f} |")
    if len(evals) > 1 and (line := gain_line(evals[0], evals[-1])) is not None:
        lines += ["", line]
    lines += ["", *(f"- {k}: `{v}`" for k, v in where.items())]
    create_markdown_artifact("\n".join(lines), key=f"{key}-summary", description=f"stepgrpo run {run_id}")


def gain_line(base: Mapping[str, Any], last: Mapping[str, Any]) -> str | None:
    """The paired gain of `last` over `base` with its 95 % interval and verdict, in one sentence
    (None where the two evaluations do not pair)."""
    gain = paired_gain(base, last)
    if gain is None:
        return None
    prompts, seeds = base["prompts"], base["seeds"]
    verdict = "rose" if gain[1] > 0 else "fell" if gain[2] < 0 else "did not move beyond noise"
    pairs = f"{prompts} held-out prompts" + (f" x {seeds} seeds, averaged per prompt" if seeds > 1 else "")
    return (
        f"paired gain over the base ({pairs}): {gain[0]:+.4f}, "
        f"95 % interval [{gain[1]:+.4f}, {gain[2]:+.4f}]: the held-out reward {verdict}"
    )


def print_summary(run_dir: Path, tracking_uri: str, evals: Sequence[Mapping[str, Any]]) -> None:
    """The end-of-run lines: held-out rewards, the paired gain of the last over the base, where everything is."""
    out = sys.stdout
    for e in evals:
        strict = f", strict {e['reward_strict']:.3f}" if "reward_strict" in e else ""
        name = "base model" if e["label"] == "base" else f"trained (checkpoint {e['label']})"
        reward = f" ({e['reward_name']})" if "reward_name" in e else ""
        subs = ", ".join(f"{k} {v:.3f}" for k, v in sorted((e.get("sub") or {}).items()))
        print(
            f"held-out reward{reward}, {name}: {e['reward_mean']:.4f}{strict}" + (f" ({subs})" if subs else ""),
            file=out,
        )
    if len(evals) > 1 and (line := gain_line(evals[0], evals[-1])) is not None:
        print(line, file=out)
    print(f"run directory: {run_dir}", file=out)
    if "wandb" in tracking_uri:  # tracking.backend: wandb (its URL, or an offline run's folder)
        sync = "" if tracking_uri.startswith("http") else f" (offline: `wandb sync {tracking_uri}` uploads it)"
        print(f"W&B run:       {tracking_uri}{sync}", file=out)
    else:
        print(f"MLflow store:  {tracking_uri}", file=out)
        print(f"MLflow UI:     {_ui_hint(run_dir, tracking_uri)}", file=out)
    print(f"images:        {run_dir / 'eval'}", file=out)


def _ui_hint(run_dir: Path, uri: str) -> str:
    """Where to look at the run's MLflow experiment, in the UI's training view."""
    from stepgrpo.reporting.tracking import find_mlflow_run, ui_hint

    _, found = find_mlflow_run(run_dir)
    return ui_hint(uri, found.info.experiment_id if found is not None else None)


def write_grid(path: Path, images: Any, ncols: int = 8, captions: list[str] | None = None) -> None:
    """Tile `images [N, 3, H, W]` (in [0, 1]) into one PNG at `path`, written atomically; with
    `captions`, each tile is scaled up and captioned (`stepgrpo.images.captioned_grid`)."""
    import io

    from PIL.PngImagePlugin import PngInfo

    from stepgrpo.images import captioned_grid, grid
    from stepgrpo.storage.publish import write_file_atomic

    buf = io.BytesIO()
    image = grid(images, ncols=ncols) if captions is None else captioned_grid(images, captions, ncols=ncols)
    text = PngInfo()
    for k, v in image.info.items():
        text.add_text(k, v)
    image.save(buf, format="PNG", pnginfo=text)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, buf.getvalue())
