"""The complete stage: the clean image each stored state leads to, by ODE completion.

Every state before the end of the SDE window is completed with `completion.method`
(`stepgrpo_core.completions`), and the window's last state too when the method is not the
rollout's own ODE (`completed_through`); the states after that evolve deterministically, so their
completion is the sample `x_T` itself and costs nothing. The clean latents and NFEs are stored.
Completion `rollout` reads the velocities the rollout stored and loads no model (0 NFEs); a rollout
stored without them (made before they were kept) is completed with the policy, at `tweedie`'s cost.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import complete_chunks, stored_predictions
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CompleteResult, RolloutResult, UpdateResult
from stepgrpo.runtime.faults import maybe_fail
from stepgrpo.runtime.sharding import shard_ranges
from stepgrpo.storage.ledger import record
from stepgrpo.storage.run import Run
from stepgrpo.storage.schema import completion_stage
from stepgrpo.tasks.base import fan_out, manifest, reuse, shard_task, stage_task
from stepgrpo.tasks.keys import Key, stage_key
from stepgrpo_core.completions import completed_through

# Completion attr: states k >= this evolve deterministically (after the SDE window); their
# completion is x_T, so they are neither completed nor scored (their rewards are R_T's).
DETERMINISTIC_FROM = "deterministic_from"


def window_end(kernel_params: dict[str, Any], num_steps: int) -> int:
    """The first step after the rollout's SDE window (`kernel_params["window"] = [start, size]`)."""
    start, size = kernel_params.get("window", [0, num_steps])
    return int(start) + int(size)


@stage_task("complete")
def complete(
    run: Run, cfg: Config, iteration: int, rollout: RolloutResult, checkpoint: UpdateResult | None
) -> CompleteResult:
    """Complete the states of `rollout` with the policy it was sampled with (`checkpoint`)."""
    return execute(
        run, cfg, iteration, stage_key("complete", run, cfg, iteration, {"rollout": rollout, "checkpoint": checkpoint})
    )


def execute(run: Run, cfg: Config, iteration: int, key: Key) -> CompleteResult:
    method = cfg.completion.method
    if not reuse(run, iteration, completion_stage(method), key, f"iteration {iteration} completion {method}"):
        compute(run, cfg, iteration, key.value)
    return stored(run, method, iteration)


def compute(run: Run, cfg: Config, iteration: int, key: str) -> None:
    """Complete the rollout's shards on the flow's workers, then publish."""
    method = cfg.completion.method
    t0 = time.perf_counter()
    rollout = run.stage_manifest(iteration, "rollout")
    T = int(rollout["attrs"]["T"])
    through = completed_through(method, window_end(rollout["attrs"]["kernel_params"], T), T)
    writer = run.stages.begin_completion(
        iteration,
        method,
        latent_dtype=cfg.model.dtype,
        attrs={"method_spec": method, DETERMINISTIC_FROM: through},
        resume=key,
    )
    with writer:
        done = fan_out(
            complete_shard,
            writer.ledger,
            key,
            shard_ranges(cfg, int(rollout["attrs"]["B"])),
            {"run": run, "cfg": cfg, "iteration": iteration, "through": through, "token": writer.token},
            f"iteration {iteration} completion {method}",
            intact=writer.store().rows_intact,
        )
        nfe = sum(r["nfe"] for r in done.results)
        writer.publish(
            attrs={"nfe": nfe}, inputs={"key": key, "seconds": time.perf_counter() - t0, "shards": done.summary}
        )


@shard_task("complete")
def complete_shard(run: Run, cfg: Config, iteration: int, through: int, token: str, key: str, shard: range) -> None:
    """Complete the states of the trajectories `shard` into the begun completion, then record it.
    A method that reuses the rollout's velocities (`rollout`) loads no model when they are stored."""
    t0 = time.perf_counter()
    method = cfg.completion.method
    data = run.stages.read_rollout(iteration, slice(shard.start, shard.stop))
    writer = run.attach(iteration, completion_stage(method), token)
    if (out := stored_predictions(method, data, through)) is not None:
        writer.write(shard.start, latents=out.latents)
        maybe_fail("complete", shard.start)
        record(writer.ledger, shard, key, {"nfe": 0, "seconds": time.perf_counter() - t0, "worker": workspace.worker()})
        return
    pol = workspace.policy_at(run, cfg, iteration)
    nfe = 0
    for c0, out in complete_chunks(
        pol,
        method,
        data.states,
        torch.from_numpy(data.sigmas),
        stored_prompts(run).texts,
        data.prompt_ids,
        max(1, cfg.model.max_batch),
        through,
        f"complete {iteration}",
    ):
        writer.write(shard.start + c0, latents=out.latents.cpu())
        nfe += out.nfe
        maybe_fail("complete", shard.start)
    record(writer.ledger, shard, key, {"nfe": nfe, "seconds": time.perf_counter() - t0, "worker": workspace.worker()})


def stored(run: Run, method: str, iteration: int, verify: bool = False) -> CompleteResult:
    """The result of the published completion of `iteration` by `method` (`verify`: check it first)."""
    m = manifest(run, iteration, completion_stage(method), f"iteration {iteration} completion {method}", verify)
    return CompleteResult(
        digest=m["digest"],
        iteration=iteration,
        method=method,
        nfe=int(m["attrs"]["nfe"]),
        seconds=m["inputs"].get("seconds", 0.0),
    )


def scored_states(run: Run, method: str | None, iteration: int) -> tuple[np.ndarray, np.ndarray]:
    """Which states `score` evaluates, `k [K]`, and which copy R_T, `copies [n]`.

    With a completion: every `k < deterministic_from` and `T` are scored; the states after the SDE
    window copy R_T. Without one (outcome credit): `k = 0` (the ODE sample of `x_0`, where the
    rollout sampled it) and `T`; the states in between have no reward (NaN in `reward_grid`).
    """
    T = int(run.stage_manifest(iteration, "rollout")["attrs"]["T"])
    if method is None:
        reference = run.stages.has_array(iteration, "rollout", "ode_final")
        return np.array([0, T] if reference else [T]), np.zeros(0, np.int64)
    through = int(run.stage_manifest(iteration, completion_stage(method))["attrs"].get(DETERMINISTIC_FROM, T))
    return np.array([*range(through), T]), np.arange(through, T)


def clean_latents(run: Run, method: str | None, iteration: int, k: np.ndarray, rows: range | None = None) -> np.ndarray:
    """Latents of the scored states `k` `[n, K, C, H, W]` of trajectories `rows` (all when None):
    completions, or `ode_final` (k = 0) and `x_T`."""
    some = slice(rows.start, rows.stop) if rows is not None else None
    if method is None:
        final = run.stages.read_array(iteration, "rollout", "states", some)[:, -1]  # one chunk a trajectory
        if int(k[0]) != 0:  # k = 0 is the ODE reference's sample: without it, x_T alone
            return final[:, None]
        return np.stack([run.stages.read_array(iteration, "rollout", "ode_final", some), final], axis=1)
    return run.stages.read_completion(iteration, method, some).latents[:, k]
