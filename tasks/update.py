"""The update stage: PPO-clip + KL on an iteration's stored trajectories and advantages.

Its body, from the previous checkpoint to the published checkpoint `iteration`, in this process or
over data-parallel ranks, is `stepgrpo.loops.update`.
"""

from __future__ import annotations

from stepgrpo.config import Config
from stepgrpo.loops import update as body
from stepgrpo.results import CreditResult, RolloutResult, UpdateResult
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import manifest, reuse, stage_task
from stepgrpo.tasks.keys import Key, stage_key


@stage_task("update")
def update(
    run: Run,
    cfg: Config,
    iteration: int,
    advantages: CreditResult,
    rollout: RolloutResult,
    checkpoint: UpdateResult | None,
) -> UpdateResult:
    """Update the policy of `checkpoint` (None: the base model) on `rollout` with `advantages`."""
    key = stage_key(
        "update", run, cfg, iteration, {"advantages": advantages, "rollout": rollout, "checkpoint": checkpoint}
    )
    return execute(run, cfg, iteration, advantages.scheme, advantages.options_digest, key)


def execute(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: Key) -> UpdateResult:
    if not reuse(run, iteration, "checkpoint", key, f"iteration {iteration} checkpoint"):
        compute(run, cfg, iteration, scheme, options_digest, key.value)
    return stored(run, iteration)


def compute(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> None:
    """The update in this process, or over `scale.update_processes` data-parallel processes."""
    if cfg.scale.update_processes > 1:
        body.launch(run, cfg, iteration, scheme, options_digest, key)
    else:
        body.train(run, cfg, iteration, scheme, options_digest, key)


def stored(run: Run, iteration: int, verify: bool = False) -> UpdateResult:
    """The result of the published checkpoint of `iteration` (`verify`: check its files first)."""
    m = manifest(run, iteration, "checkpoint", f"checkpoint {iteration}", verify)
    state = run.checkpoint_state(iteration)
    seconds = m["inputs"].get("seconds", state.get("seconds", 0.0))  # older checkpoints kept it in state.json
    nfe = int(m["inputs"].get("nfe", 0))
    return UpdateResult(digest=m["digest"], iteration=iteration, seconds=seconds, stats=state["update"], nfe=nfe)
