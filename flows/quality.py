"""Judge every credit scheme on a stored iteration against Monte-Carlo true advantages."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.flows.progress import name_flow_run, run_name_from_parameters
from stepgrpo.loops.judging import schemes_to_judge
from stepgrpo.loops.workspace import reward_identity
from stepgrpo.runs import owned_stored, stored_iterations
from stepgrpo.runtime import environment
from stepgrpo.tasks import score
from stepgrpo.tasks.quality import credit_quality as check_stage
from stepgrpo.tasks.quality import record_path
from stepgrpo_core.registry import allow


@flow(name="credit-quality", log_prints=True, flow_run_name=run_name_from_parameters)
def credit_quality(
    run: str,
    iteration: int | None = None,
    continuations: int = 8,
    schemes: list[str] | None = None,
    seed: int = 0,
    overrides: list[str] | None = None,
    methods: list[str] | None = None,
) -> dict[str, Any]:
    """The credit-quality check of `iteration` (default: the latest scored one): `continuations` SDE
    continuations per state give the true values `V(x_k)` and advantages `A*_k`; each of `schemes`
    (default: every registered scheme) is judged per step and in gradient space (METHODS.md,
    "Judging credit"), on the run's own step rewards and on each completion method of `methods`
    (each scheme's tables then also as `scheme:method`, with the method's NFEs per trajectory).
    Stored in the run and reused; logged to MLflow as a child of the run."""
    allow(*(schemes or []))  # the caller's own names; a stored run's plug-ins are never imported
    names = schemes_to_judge(schemes)
    with owned_stored(run, overrides or []) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} credit-quality")
        if iteration is None:
            iteration = max(stored_iterations(stored))
        score.stored(stored, iteration, reward_identity(cfg.reward)["name"])  # scored (a clear error if not)
        result = check_stage(stored, cfg, iteration, continuations, names, seed, methods)
        path = record_path(stored, iteration, result.key)
        _log(stored, cfg, result, path)
        for row in result.gradient["uniform"]["rows"]:
            print(f"iteration {iteration}: {row['scheme']} gradient cosine {_fmt(row['cosine'])}")
        for method, cost in (result.methods or {}).items():
            print(
                f"iteration {iteration}: step rewards by {method}: {cost['nfe_per_trajectory']:.1f} NFEs a trajectory"
            )
        return {"run_dir": str(stored.path), "record": str(path), **result.record()}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def _log(stored: Any, cfg: Any, result: Any, path: Any) -> None:
    """The check as an MLflow run of its own, tagged with its parent (the training run)."""
    from stepgrpo.reporting.tracking import Tracker, comparison_tags, experiment_name, find_mlflow_run

    _, parent = find_mlflow_run(stored.path, stored.run_id)
    tags = {**comparison_tags(cfg), "stepgrpo.parent_run_id": stored.run_id, "stepgrpo.kind": "credit-quality"}
    if parent is not None:
        tags["mlflow.parentRunId"] = parent.info.run_id
    name = f"{stored.run_id} credit-quality iter_{result.iteration}-{result.key[:8]}"
    with Tracker.start(stored.path, experiment_name(), name, tags=tags) as tracker:
        tracker.log_params(
            {
                "iteration": result.iteration,
                "continuations": result.continuations,
                "seed": result.seed,
                "reward": result.reward_name,
                "trained_steps": ",".join(map(str, result.trained_steps)),
            }
        )
        metrics: dict[str, float] = {"nfe": result.nfe, "seconds": result.seconds}
        for label, check in result.gradient.items():
            for row in check["rows"]:
                for field in ("cosine", "low", "high", "raw", "diff"):
                    if row.get(field) is not None:
                        metrics[f"gradient_{label}/{row['scheme']}/{field}"] = row[field]
        for step in result.steps:
            for field, value in step.items():
                if field != "step" and value is not None:
                    metrics[f"step_{step['step']}/{field.replace('corr/', 'corr_')}"] = value
        tracker.log_metrics(metrics, step=result.iteration)
        tracker.log_artifact(path, "credit_quality")
