"""Weights & Biases as the training run's tracker (`tracking.backend: wandb`), with the same calls
as the MLflow `Tracker` (`stepgrpo.reporting.tracking`), so `TrainingLog` logs either.

One W&B run per stepgrpo run, in project `tracking.project` (default: the MLflow experiment's
name), named after the run id; its W&B id is derived from the run directory, so a resumed run
goes on logging into the same W&B run (`resume="allow"`). W&B's local files go under the runs
root (`<runs_root>/wandb/`), never into the run directory, which holds data only. Offline use is
W&B's own: `WANDB_MODE=offline` (then `wandb sync` uploads), as the tests run it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image

COMPUTE_AXIS = "heldout/nfe_total"  # the x-axis of the by-compute series (`log_by_compute`)
AXES = {"nfe": COMPUTE_AXIS, "passes": "heldout/passes_total"}  # each compute unit's x-axis


def labels(tags: Mapping[str, str]) -> list[str]:
    """W&B tags, short labels (64 characters): the comparison tags (`scheme:stepwise`); a run's
    other tags go to its config."""
    return [f"{k.removeprefix('stepgrpo.')}:{v}"[:64] for k, v in tags.items() if k.startswith("stepgrpo.")]


class WandbTracker:
    """The W&B run of one stepgrpo run; a context manager that finishes it (exit code 1 on failure)."""

    def __init__(self, run: Any, resumed: bool) -> None:
        self.run = run
        self.resumed = resumed
        self.uri = run.url or str(Path(run.dir).parent)  # offline: the run's local folder
        # W&B's steps only go forward: a resumed run skips what it logged before (a cached stage
        # reports the same numbers again), and nothing goes below the last step logged
        self._next = int(run.step) if resumed else 0

    @classmethod
    def start(
        cls, run_dir: str | Path, project: str, run_name: str, tags: Mapping[str, str] | None = None
    ) -> WandbTracker:
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "tracking.backend wandb needs the wandb package: pip install 'stepgrpo[wandb]' (or set "
                "tracking.backend: mlflow)"
            ) from None
        run_dir = Path(run_dir).resolve()
        where = run_dir.parent / "wandb"
        where.mkdir(parents=True, exist_ok=True)
        run_id = f"{run_name[:40]}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
        run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            group=run_dir.name,  # the run id: the group its offline commands' W&B runs join
            job_type="train",
            resume="allow",
            dir=str(where.parent),  # W&B writes <dir>/wandb/
            tags=labels(tags or {}),
            config={k: str(v) for k, v in (tags or {}).items()} | {"run_dir": str(run_dir)},
            settings=wandb.Settings(silent=True, console="off"),
        )
        for axis in AXES.values():
            run.define_metric(axis)
        return cls(run, resumed=bool(run.resumed))

    def __enter__(self) -> WandbTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.run.finish(exit_code=0 if exc_type is None else 1)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.run.config.update({k: str(v) for k, v in tags.items()}, allow_val_change=True)

    def set_note(self, text: str) -> None:
        """The run's notes (Markdown), shown in its W&B overview."""
        self.run.notes = text

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Finite scalars at `step` (see `__init__` for the steps that are skipped)."""
        rows = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(float(v))}
        if rows and step >= self._next:
            self.run.log(rows, step=step)
            self._next = step

    def log_by_compute(self, key: str, value: float, compute: float, step: int, unit: str = "nfe") -> None:
        """`key` plotted against `compute` (cumulative training NFEs, or passes) as its own x-axis."""
        self.run.define_metric(key, step_metric=AXES[unit])
        self.log_metrics({key: value, AXES[unit]: compute}, step)

    def log_image(self, image: Image.Image, key: str, step: int) -> None:
        import wandb

        if step >= self._next:
            self.run.log({key: wandb.Image(image)}, step=step)
            self._next = step

    def log_dir(self, local_dir: str | Path, artifact_path: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.name}-{artifact_path}", type="model")
        artifact.add_dir(str(local_dir))
        self.run.log_artifact(artifact)


def log_offline_record(run_dir: str | Path, project: str, record: Mapping[str, Any]) -> str:
    """An offline command's record (`stepgrpo.flows.progress.log_offline`) as a W&B run of its own,
    grouped with the training run (`group`: its run id): `record["metrics"]` of each row at its
    iteration, all rows as a W&B table. The same name again continues the same W&B run (its id is
    derived from the run directory and the name). Returns the run's URL or offline folder."""
    import wandb

    run_dir = Path(run_dir).resolve()
    tags = dict(record.get("tags") or {})
    run_id = hashlib.sha256(f"{run_dir}\n{record['name']}".encode()).hexdigest()[:16]
    run = wandb.init(
        project=project,
        name=record["name"],
        id=run_id,
        group=tags.get("stepgrpo.parent_run_id"),
        job_type=record["kind"],
        resume="allow",
        dir=str(run_dir.parent),
        tags=labels(tags),
        config={**record.get("params", {}), **tags},
        settings=wandb.Settings(silent=True, console="off"),
    )
    try:
        for folder in record.get("artifacts") or []:  # an evidence bundle, as it is on disk
            artifact = wandb.Artifact(f"evidence-{Path(folder).name}", type="evidence")
            artifact.add_dir(str(folder))
            run.log_artifact(artifact)
        rows = list(record.get("rows") or [])
        start = int(run.step) if run.resumed else 0
        for row in sorted(rows, key=lambda r: int(r.get("iteration", 0))):
            step = int(row.get("iteration", 0))
            values = {m: row[m] for m in record.get("metrics", []) if isinstance(row.get(m), int | float)}
            if values and step >= start:
                run.log(values, step=step)
        if rows:
            columns = sorted({k for r in rows for k in r})
            run.log(
                {record["kind"]: wandb.Table(columns=columns, data=[[str(r.get(c)) for c in columns] for r in rows])}
            )
        return run.url or str(Path(run.dir).parent)
    finally:
        run.finish()
