"""One thin Prefect task per pipeline stage: references in, references out.

Every task takes `(run_dir, config, iteration, inputs)`: the run directory, the config as JSON,
the iteration, and the digests of its upstream stages. It returns a small JSON reference
(digests, counts, summary numbers), persisted with the JSON serializer inside the run directory
(`bind`). The cache key is `tasks.keys.stage_key` (the caching contract); the stage bodies in
`stepgrpo.stages` are idempotent, so a resumed run redoes only what was never published.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prefect import task

from stepgrpo import stages
from tasks.keys import cache_key, stage_key

RESULTS_DIR = "prefect-results"  # inside the run directory: a run carries its own task cache


def _stage_task(stage: str):
    return task(name=stage, cache_key_fn=cache_key(stage), persist_result=True, result_serializer="json")


def _open(run_dir: str, config: dict[str, Any]):
    from storage.run import Run

    return Run.open(run_dir), stages.validate(config)


@_stage_task("prompts")
def prompts(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """Write the run's prompt table (train and held-out splits) once."""
    run, cfg = _open(run_dir, config)
    return stages.prompts(run, cfg)


@_stage_task("calibrate")
def calibrate(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """DenseGRPO `psi` calibration with the base policy (for the `psi` kernel)."""
    run, cfg = _open(run_dir, config)
    return stages.calibrate(run, cfg, stage_key("calibrate", run_dir, config, iteration, inputs))


@_stage_task("rollout")
def rollout(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """Sample the iteration's trajectories with the policy after the previous update."""
    run, cfg = _open(run_dir, config)
    return stages.rollout(run, cfg, iteration, stage_key("rollout", run_dir, config, iteration, inputs))


@_stage_task("complete")
def complete(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """ODE-complete every stored state (the NFE-heavy stage)."""
    run, cfg = _open(run_dir, config)
    return stages.complete(run, cfg, iteration, stage_key("complete", run_dir, config, iteration, inputs))


@_stage_task("score")
def score(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """Decode the clean latents and append the reward's rows (no transformer call)."""
    run, cfg = _open(run_dir, config)
    return stages.score(run, cfg, iteration, stage_key("score", run_dir, config, iteration, inputs))


@_stage_task("credit")
def credit(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """Advantages from the stored rewards of `inputs["reward"]` under the configured scheme."""
    run, cfg = _open(run_dir, config)
    name, version = inputs["reward"]
    return stages.credit(run, cfg, iteration, name, version, stage_key("credit", run_dir, config, iteration, inputs))


@_stage_task("update")
def update(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """PPO-clip + KL update on the stored trajectories; publishes checkpoint `iteration`."""
    run, cfg = _open(run_dir, config)
    key = stage_key("update", run_dir, config, iteration, inputs)
    return stages.update(run, cfg, iteration, inputs["scheme"], inputs["options_digest"], key)


@_stage_task("evaluate")
def evaluate(run_dir: str, config: dict[str, Any], iteration: int, inputs: dict[str, Any]) -> dict[str, Any]:
    """Held-out reward of the policy after `iteration` (-1: the base model) and an image grid."""
    run, cfg = _open(run_dir, config)
    key = stage_key("evaluate", run_dir, config, iteration, inputs)
    return stages.evaluate(run, cfg, None if iteration < 0 else iteration, key)


def bind(run_dir: str | Path) -> SimpleNamespace:
    """The stage tasks with their results persisted inside `run_dir` (so a run carries its own cache)."""
    storage = Path(run_dir).resolve() / RESULTS_DIR
    return SimpleNamespace(**{
        t.name: t.with_options(result_storage=storage)
        for t in (prompts, calibrate, rollout, complete, score, credit, update, evaluate)
    })
