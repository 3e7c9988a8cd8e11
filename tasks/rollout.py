"""The rollout stage: sample an iteration's groups with the policy after the previous update.

`prompts_per_iteration` groups of `group_size` trajectories (a group shares its prompt and initial
noise, `stepgrpo.loops.sampling.iteration_plan`), every state, step log-prob and the velocity each step
was taken with stored (the velocities make completion `rollout` free), and the ODE
sample of each group's initial noise (`ode_final`: R_0 of outcome runs, and the ODE reward beside
the SDE training reward).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import iteration_plan, sample_iteration
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CalibrateResult, DrawResult, PromptsResult, RolloutResult, UpdateResult
from stepgrpo.runtime.faults import maybe_fail
from stepgrpo.runtime.sharding import shard_ranges
from stepgrpo.storage.ledger import record
from stepgrpo.storage.run import Run
from stepgrpo.storage.schema import BY_NODE_MIN_BYTES
from stepgrpo.tasks.base import fan_out, manifest, reuse, shard_task, stage_task
from stepgrpo.tasks.draw import drawn_prompts
from stepgrpo.tasks.keys import Key, stage_key
from stepgrpo_core.kernels import KERNELS


@stage_task("rollout")
def rollout(
    run: Run,
    cfg: Config,
    iteration: int,
    prompts: PromptsResult,
    checkpoint: UpdateResult | None,
    psi: CalibrateResult | None,
    draw: DrawResult | None = None,
) -> RolloutResult:
    """Sample iteration `iteration` after `checkpoint` (None: the base model); `psi`: the run's
    calibrated table when the kernel has one; `draw`: the curriculum's prompts (None: uniform)."""
    upstream: dict[str, Any] = {"prompts": prompts, "checkpoint": checkpoint, "psi": psi}
    if draw is not None:  # a uniform run's key names no draw (it is the key runs made before the curriculum had)
        upstream["draw"] = draw
    key = stage_key("rollout", run, cfg, iteration, upstream)
    return execute(run, cfg, iteration, kernel_noise(cfg, psi), key)


def kernel_noise(cfg: Config, psi: CalibrateResult | None) -> float | torch.Tensor:
    """The kernel's `noise`: the config's value, or the calibrated table of a calibrated kernel."""
    if not KERNELS.facts(cfg.sampler.kernel)["calibrated"]:
        return cfg.sampler.noise
    if psi is None:
        raise StageError(
            f"kernel {cfg.sampler.kernel!r} needs the run's calibrated table: run the calibrate stage first"
        )
    return torch.tensor(psi.psi, dtype=torch.float32)


def execute(run: Run, cfg: Config, iteration: int, noise: float | torch.Tensor, key: Key) -> RolloutResult:
    if not reuse(run, iteration, "rollout", key, f"iteration {iteration} rollout"):
        compute(run, cfg, iteration, noise, key.value)
    return stored(run, iteration)


def by_node(cfg: Config, latent_shape: tuple[int, ...]) -> bool:
    """Whether the rollout stores each node once (`storage.branch_nodes`): a branched rollout's, where
    its states are large enough (`BY_NODE_MIN_BYTES`) or the setting says `always`."""
    if cfg.storage.branch_nodes == "never" or not (cfg.sampler.branches() or cfg.sampler.branch_tree is not None):
        return False
    state_bytes = math.prod(latent_shape) * (4 if cfg.model.dtype == "float32" else 2)
    return cfg.storage.branch_nodes == "always" or state_bytes >= BY_NODE_MIN_BYTES


def compute(run: Run, cfg: Config, iteration: int, noise: float | torch.Tensor, key: str) -> None:
    """Sample the iteration's shards (`stepgrpo.runtime.sharding`) on the flow's workers, then publish."""
    t0 = time.perf_counter()
    pol = workspace.policy(cfg)  # the grid and latent shape; the shards set the weights they sample with
    plan = iteration_plan(cfg, stored_prompts(run).splits, iteration, drawn_prompts(run, cfg, iteration))
    start, end = cfg.sampler.window()
    writer = run.stages.begin_rollout(
        iteration,
        sigmas=pol.sigmas(cfg.sampler.steps).cpu().numpy(),
        seeds=np.repeat(plan.seeds, cfg.run.group_size),
        prompt_ids=plan.prompt_ids,
        group_ids=plan.group_ids,
        latent_shape=pol.latent_shape,
        latent_dtype=cfg.model.dtype,
        kernel=cfg.sampler.kernel,
        kernel_params={
            "noise": noise.tolist() if isinstance(noise, torch.Tensor) else float(noise),
            "window": [start, end - start],
            # a solver that took every step instead of the kernel (recorded where one did)
            **({"sde_solver": cfg.sampler.sde_solver} if cfg.sampler.sde_solver else {}),
        },
        resume=key,
        omit=() if cfg.sampler.ode_reference else ("ode_final",),
        by_node=by_node(cfg, pol.latent_shape),
    )
    with writer:
        done = fan_out(
            sample_shard,
            writer.ledger,
            key,
            shard_ranges(cfg, len(plan.prompt_ids)),
            {"run": run, "cfg": cfg, "iteration": iteration, "noise": noise, "token": writer.token},
            f"iteration {iteration} rollout",
            intact=writer.store().rows_intact,
        )
        writer.publish(
            inputs={
                "key": key,
                "nfe": sum(r["nfe"] for r in done.results),
                "nfe_ode": sum(r["nfe_ode"] for r in done.results),
                "seconds": time.perf_counter() - t0,
                "shards": done.summary,
            }
        )


@shard_task("rollout")
def sample_shard(
    run: Run, cfg: Config, iteration: int, noise: float | torch.Tensor, token: str, key: str, shard: range
) -> None:
    """Sample the trajectories `shard` (whole groups) into the begun rollout, then record it."""
    t0 = time.perf_counter()
    pol = workspace.policy_at(run, cfg, iteration)
    prompts = stored_prompts(run)
    plan = iteration_plan(cfg, prompts.splits, iteration, drawn_prompts(run, cfg, iteration))
    writer = run.attach(iteration, "rollout", token)
    G = cfg.run.group_size
    nfe0, nfe_ode = pol.nfe, 0
    for chunk in sample_iteration(
        pol, cfg, prompts.texts, plan, iteration, noise, range(shard.start // G, shard.stop // G)
    ):
        nfe_ode += chunk.nfe_ode
        check_finite(chunk.sde, cfg, iteration)
        reference = {} if chunk.ode_final is None else {"ode_final": chunk.ode_final.cpu()}
        writer.write(
            int(chunk.rows[0]),
            states=chunk.sde.states.cpu(),
            log_probs=chunk.sde.log_probs.cpu(),
            stds=chunk.sde.stds.cpu(),
            velocities=chunk.sde.velocities.cpu(),
            **reference,
        )
        maybe_fail("rollout", shard.start)
    result = {
        "nfe": pol.nfe - nfe0 - nfe_ode,
        "nfe_ode": nfe_ode,
        "seconds": time.perf_counter() - t0,
        "worker": workspace.worker(),
    }
    record(writer.ledger, shard, key, result)


def check_finite(sde: Any, cfg: Config, iteration: int) -> None:
    """Fail the stage, before anything is written, where sampling produced a non-finite state or a
    stochastic step a non-finite log-density (a noise too large for the grid overflows): stored, the
    update would find nothing to train and the run would end as if it had."""
    bad_state = ~torch.isfinite(sde.states.reshape(*sde.states.shape[:2], -1)).all(dim=2)  # [n, T+1]
    bad_step = (sde.stds > 0) & ~torch.isfinite(sde.log_probs)  # [n, T]
    if bool(bad_state.any()) or bool(bad_step.any()):
        k = int(torch.nonzero(bad_state.any(dim=0) if bool(bad_state.any()) else bad_step.any(dim=0))[0])
        raise StageError(
            f"iteration {iteration} rollout: non-finite values from step {k} on (sampler.kernel {cfg.sampler.kernel}, "
            f"sampler.noise {cfg.sampler.noise:g}): lower sampler.noise (Flow-GRPO samples with 0.7)"
        )


def stored(run: Run, iteration: int, verify: bool = False) -> RolloutResult:
    """The result of the published rollout of `iteration` (`verify`: check its data first)."""
    m = manifest(run, iteration, "rollout", f"iteration {iteration} rollout", verify)
    return RolloutResult(
        digest=m["digest"],
        iteration=iteration,
        trajectories=m["counts"]["trajectories"],
        nfe=m["inputs"].get("nfe", 0),
        nfe_ode=m["inputs"].get("nfe_ode", 0),
        seconds=m["inputs"].get("seconds", 0.0),
    )
