"""Retention: what a run keeps of its finished iterations, and pruning what it does not.

At paper scale the latents dominate a run's disk (a rollout of SD3.5-M at 512 px with its
completions is gigabytes an iteration), while what most later work reads is small: the reward
and advantage tables, the stage manifests, the update records and the latest checkpoint. Pruning
removes the bulk and keeps the rest, so a pruned run still resumes (its stages stay published,
their results are read from the manifests), `inspect` still shows it and `stepgrpo credit` still
recomputes its advantages; what needs the removed bytes (re-scoring, re-completing, evaluating
a thinned checkpoint) says so, naming the setting that removed them (`PrunedError`).

What goes, per stage (`BULK`): a rollout's `states`, `ode_final` and `velocities` (its plan, log-probs and stds
stay), a completion's `latents`, a stage's stored `images`; of a checkpoint, its tensor files (its
`state.json`, the update's record, stays). Only an iteration whose update is published is pruned:
the update is the last stage that reads its latents.

A pruned stage gets `_pruned.json` (what was removed, when, how many bytes) before anything is
deleted, so a reader never meets a missing array without the record that explains it, and an
interrupted prune is finished by the next one. Reading those records (and the error a read of
pruned data raises) is `stepgrpo.storage.pruned`, below the run that this policy works on.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from stepgrpo.storage.pruned import PRUNED_FILE, pruned
from stepgrpo.storage.publish import utc_now, write_file_atomic

if TYPE_CHECKING:
    from stepgrpo.storage.run import Run

BULK = {"rollout": ("states", "ode_final", "velocities"), "completion": ("latents",), "images": ("images",)}
Keep = Literal["all", "last", "tables"]


@dataclass
class PruneReport:
    """What `prune` removed: `(iteration, stage)` items and the bytes freed."""

    stages: list[tuple[int, str]] = field(default_factory=list)
    freed: int = 0

    def describe(self) -> str:
        if not self.stages:
            return "nothing to prune"
        iters = sorted({i for i, _ in self.stages})
        span = f"{iters[0]}" if len(iters) == 1 else f"{iters[0]}-{iters[-1]}"
        return f"pruned {len(self.stages)} stage(s) of iterations {span}: freed {self.freed / 2**20:.1f} MiB"


def plan(
    run: Run, keep: Keep, keep_last: int, checkpoint_every: int, protected: set[int] | None = None
) -> list[tuple[int, str]]:
    """The `(iteration, stage)` items retention removes now: stage directories ('rollout',
    'completions/<m>', 'images/<s>') of finished iterations outside what `keep` keeps, and
    checkpoints off the `checkpoint_every` grid (never the latest, nor those in `protected`)."""
    done = run.iterations("checkpoint")
    if not done:
        return []
    latest = done[-1]
    out: list[tuple[int, str]] = []
    if keep != "all":
        cut = latest - keep_last if keep == "last" else latest
        for i in (i for i in done if i <= cut):
            for stage in stages_of(run, i):
                if pruned(run.stage_path(i, stage)) is None or _left_over(run, i, stage):
                    out.append((i, stage))
    if checkpoint_every:
        for i in done[:-1]:
            path = run.stage_path(i, "checkpoint")
            if (i + 1) % checkpoint_every and i not in (protected or set()) and pruned(path) is None:
                out.append((i, "checkpoint"))
    return out


def stages_of(run: Run, iteration: int) -> list[str]:
    """The published Zarr stages of `iteration`."""
    root = run.path / f"iter_{iteration}"
    found = ["rollout"] if run.stage_manifest(iteration, "rollout") is not None else []
    for kind in ("completions", "images"):
        found += [f"{kind}/{p.stem}" for p in sorted((root / kind).glob("*.zarr")) if (p / "_published.json").is_file()]
    return found


def prune(run: Run, items: list[tuple[int, str]], why: str) -> PruneReport:
    """Remove the bulk of each item (`plan`), recording `why` (the setting) in its `_pruned.json`."""
    report = PruneReport()
    for i, stage in items:
        path = run.stage_path(i, stage)
        if stage == "checkpoint":
            victims = [p for p in sorted(path.glob("*.safetensors"))]
            removed = [p.stem for p in victims]
        else:
            removed = list(BULK[_kind(stage)])
            victims = [path / name for name in removed if (path / name).exists()]
        previous = pruned(path)
        freed = sum(_size(p) for p in victims)
        if previous is None:
            record = {"pruned_at": utc_now(), "why": why, "removed": removed, "bytes": freed}
            write_file_atomic(path / PRUNED_FILE, (json.dumps(record, sort_keys=True) + "\n").encode())
        for p in victims:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        report.stages.append((i, stage))
        report.freed += freed
    return report


def _left_over(run: Run, i: int, stage: str) -> bool:
    """Whether an interrupted prune left some of the stage's bulk behind."""
    path = run.stage_path(i, stage)
    return any((path / name).exists() for name in BULK[_kind(stage)])


def _kind(stage: str) -> str:
    return "rollout" if stage == "rollout" else "completion" if stage.startswith("completions/") else "images"


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
