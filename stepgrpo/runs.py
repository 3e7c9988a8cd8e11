"""A run directory as the pipeline opens it: bound to one config and one model, found by id or path.

`storage.run.Run` holds the data; this module adds what the pipeline knows: the config a run was
created with (and the diff when another one is asked for), and the model's fingerprint, computed
once when the run is created and recorded in its manifest, so that a cache key never needs the
model files (`tasks.keys`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stepgrpo.config import Config, apply_overrides, validate_config
from stepgrpo.errors import StageError
from storage.run import Run, find_run

MODEL_FACT = "model_identity"  # manifest fact: `workspace.model_identity` of the run's model


def resolve_run_dir(cfg: Config, run_dir: str | None = None, run_id: str | None = None) -> Path:
    """`--run-dir` as given; else `<runs_root>/<run_id>`; else a new id `<name>-<UTC time>`."""
    if run_dir:
        return Path(run_dir).resolve()
    if not run_id:
        run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return (Path(cfg.run.runs_root) / run_id).resolve()


def open_run(cfg: Config, run_dir: str | Path) -> Run:
    """Create the run directory bound to `cfg` and its model, or open it to resume (same config
    and the same model files required)."""
    from stepgrpo import workspace

    run_dir = Path(run_dir)
    identity = workspace.model_identity(cfg.model.path)
    try:
        run = Run.create(
            run_dir.parent, run_dir.name, cfg.model_dump(mode="json"), exist_ok=True, facts={MODEL_FACT: identity}
        )
    except ValueError as err:
        if "different config" not in str(err):
            raise
        changed = config_diff(Run.open(run_dir).config, cfg.model_dump(mode="json"))
        raise StageError(
            f"run {run_dir.name} was created with another config (changed: {', '.join(changed)}); "
            "resume it with the same config, pick a new --run-id, or use `stepgrpo rescore` / "
            "`stepgrpo credit` to try another reward / scheme on its stored trajectories"
        ) from None
    recorded = run.fact(MODEL_FACT)
    if recorded is None:
        run.record_fact(MODEL_FACT, identity)  # a run created before models were fingerprinted
    elif recorded != identity:
        raise StageError(
            f"run {run.run_id}: the files of model.path {cfg.model.path!r} changed since the run was created "
            "(their fingerprint differs); restore that model or start a new --run-id"
        )
    return run


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two config dicts (options compared whole)."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict) and k != "options":
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def open_stored(run: str | Path, overrides: Sequence[str] = ()) -> tuple[Run, Config]:
    """The run named by `run` (a directory or a run id under runs/) and its stored config with
    `key=value` overrides applied."""
    path = find_run(run)
    stored = Run.open(path)
    return stored, validate_config(apply_overrides(stored.config, overrides))


def stored_iterations(run: Run) -> list[int]:
    """Iterations of the run whose rollout is published."""
    found = run.iterations("rollout")
    if not found:
        raise StageError(f"run {run.run_id} has no published rollout yet")
    return found


def latest_checkpoint(run: Run) -> int:
    latest = run.latest_checkpoint()
    if latest is None:
        raise StageError(f"run {run.run_id} has no checkpoint yet; evaluate the base model with --iteration -1")
    return latest
