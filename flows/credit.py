"""Recompute advantages of a run with another credit scheme, from stored rewards only (no model)."""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from stepgrpo.flows.progress import log_offline, name_flow_run, run_name_from_parameters
from stepgrpo.runs import owned_stored, stored_iterations
from stepgrpo.runtime import environment
from stepgrpo.tasks import bind, rollout, score
from stepgrpo_core.registry import allow


@flow(name="credit", log_prints=True, flow_run_name=run_name_from_parameters)
def credit(
    run: str,
    scheme: str,
    options: dict[str, Any] | None = None,
    reward: str | None = None,
    iterations: list[int] | None = None,
) -> dict[str, Any]:
    """Advantages under `scheme` for every stored iteration, from the rewards of `reward`
    (default: the run's training reward)."""
    allow(scheme)  # the caller's own scheme; the stored run's plug-ins are never imported
    with owned_stored(run, replace={"credit": {"scheme": scheme, "options": options or {}}}) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} credit {scheme}")
        name = reward or _training_reward(cfg)
        stage, done = bind(stored, cfg), []
        for i in iterations if iterations is not None else stored_iterations(stored):
            rollout.stored(stored, i, verify=True)  # the trajectories the advantages belong to
            done.append(stage.credit(stored, cfg, i, score.stored(stored, i, name)))
            print(
                f"iteration {i}: {scheme} advantages std {done[-1].adv_std:.4f}, "
                f"zero-std groups {done[-1].zero_std_ratio:.2f}"
            )
        records = [a.record() for a in done]
        params = {"scheme": scheme, "options": json.dumps(options or {}, sort_keys=True), "reward": name}
        log_offline(stored, cfg, "credit", scheme, params, records, ["adv_std", "zero_std_ratio", "turning_points"])
        return {"run_dir": str(stored.path), "advantages": records}


def _training_reward(cfg: Any) -> str:
    from stepgrpo.loops.workspace import reward_identity

    return reward_identity(cfg.reward)["name"]
