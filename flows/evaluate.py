"""Evaluate a run: ODE sampling of held-out prompts, reward, and an image grid."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.flows.progress import evaluation_record, log_offline, name_flow_run, run_name_from_parameters
from stepgrpo.runs import latest_checkpoint, owned_stored
from stepgrpo.runtime import environment
from stepgrpo.runtime.workers import workers
from stepgrpo.tasks import bind, update


@flow(name="evaluate", log_prints=True, flow_run_name=run_name_from_parameters)
def evaluate(run: str, iteration: int | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Held-out reward of the policy after `iteration` (default: the latest checkpoint; -1: the base model).

    `overrides` (`key=value`) may change evaluation settings such as `run.eval_prompts` or `reward.name`.
    """
    with owned_stored(run, overrides or []) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} evaluate")
        stage = bind(stored, cfg)
        prompts = stage.prompts(stored, cfg)
        if iteration is None:
            iteration = latest_checkpoint(stored)
        checkpoint = None if iteration < 0 else update.stored(stored, iteration, verify=True)
        with workers(cfg, stored.path):  # `--set scale.workers=ray` evaluates in shards on Ray
            result = evaluation_record(stored, stage.evaluate(stored, cfg, iteration, prompts, checkpoint))
        print(
            f"held-out {result['reward_name']} after {result['label']}: {result['reward_mean']:.4f}; grid "
            f"{result['grid']}"
        )
        row = {k: v for k, v in result.items() if k not in ("scores", "strict_scores")} | {"iteration": iteration + 1}
        params = {"overrides": " ".join(overrides or []) or "(none)"}
        label = " ".join([result["label"], *(overrides or [])])  # one MLflow run per checkpoint and settings
        log_offline(stored, cfg, "evaluate", label, params, [row], ["reward_mean", "reward_strict"])
        return result
