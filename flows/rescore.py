"""Re-score stored trajectories of a run with another reward: no sampling, no transformer call.

Adds reward rows (`reward_name`, `reward_version`) next to the ones already stored; rollout and
completion stages are read, never recomputed. The images the first reward saw are read from the
iteration's image store when it has one (no VAE call); otherwise the VAE alone is loaded to decode
the stored latents, and the images are stored for the next re-score (`storage.images`).
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from stepgrpo.flows.progress import log_offline, name_flow_run, run_name_from_parameters
from stepgrpo.runs import check_rescorable, owned_stored, stored_iterations
from stepgrpo.runtime import environment
from stepgrpo.runtime.workers import workers
from stepgrpo.tasks import bind, complete, rollout
from stepgrpo_core.registry import allow, references_in


@flow(name="rescore", log_prints=True, flow_run_name=run_name_from_parameters)
def rescore(
    run: str, reward: str, reward_options: dict[str, Any] | None = None, iterations: list[int] | None = None
) -> dict[str, Any]:
    """Score every stored iteration (or `iterations`) of `run` with `reward`."""
    # the caller's own reward (the command line, the run form) may be imported; the stored run's never
    allow(*references_in([reward, reward_options]))
    with owned_stored(run, replace={"reward": {"name": reward, "options": reward_options or {}}}) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} rescore {reward}")
        stage, done = bind(stored, cfg), []
        method = cfg.completion.method
        todo = iterations if iterations is not None else stored_iterations(stored)
        check_rescorable(stored, method, todo)
        with workers(cfg, stored.path):  # this command's `scale` (the defaults: in this process)
            for i in todo:
                sampled = rollout.stored(stored, i, verify=True)
                clean = complete.stored(stored, method, i, verify=True) if method else sampled
                done.append(stage.score(stored, cfg, i, clean, sampled))
                print(
                    f"iteration {i}: {done[-1].reward_name} mean {done[-1].reward_mean:.4f} (images {done[-1].images})"
                )
        records = [s.record() for s in done]
        params = {"reward": reward, "reward_options": json.dumps(reward_options or {}, sort_keys=True)}
        log_offline(stored, cfg, "rescore", reward, params, records, ["reward_mean", "reward_strict", "reward_std"])
        return {"run_dir": str(stored.path), "scores": records}
