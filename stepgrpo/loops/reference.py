"""The whole algorithm on one page: rollout, completion, scoring, credit and the update, in memory,
with no Prefect, no storage and no tracking. Read this first.

`reference_loop(cfg, iterations)` calls the same functions with the same seeds as the pipeline's
stages (prompts, initial noise, SDE noise, the update's order), so on one config it gives the
rewards and advantages the pipeline stores (`tests/test_flows.py` holds them equal, iteration by
iteration). Where the pipeline is a Prefect flow of cached stages (`flows/train.py:iterate`), this
is the loop those stages cut into pieces: anything a run spends beyond it is orchestration,
storage and tracking (`bench/costs/costs.py` measures that overhead against it).

    for each iteration:
        x_0..x_T, log p     = sample_iteration(...)     # the rollout: an SDE in the window, ODE elsewhere
        clean x_0 of x_k    = complete_chunks(...)       # each state's ODE completion (completion.method)
        R [B, T+1]          = score_images(decode(...))  # the reward of every completed state (R_T: the sample)
        A [B, T]            = assign(scheme, R, groups)  # credit: per-step advantages from R
        policy              = training.update(...)       # update.objective: GRPO, DiffusionNFT, AWM, DGPO
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stepgrpo.loops import training, workspace
from stepgrpo.loops.sampling import complete_chunks, encode, generator, iteration_plan, sample_iteration
from stepgrpo.loops.scoring import reward_images, score_images
from stepgrpo.prompts import prompt_source
from stepgrpo_core.branching import branch_steps_of
from stepgrpo_core.completions import completed_through
from stepgrpo_core.credit import assign, reads_branch
from stepgrpo_core.kernels import KERNELS


def reference_loop(
    cfg: Any, iterations: int, on_iteration: Callable[[int, dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """`iterations` of the algorithm on `cfg` (a validated `Config`), in memory; returns one record
    per iteration: seconds per phase, NFEs, the mean final reward, and the reward grid and
    advantages themselves (`rewards [B, T+1]`, `advantages [B, T]`), the update's statistics.
    `on_iteration(i, record)` is called after each. Kernels with a calibrated table (`psi`) are not
    supported (there is no calibration here)."""
    if KERNELS.facts(cfg.sampler.kernel)["calibrated"]:
        raise ValueError("the reference loop has no calibration stage; run a kernel with a fixed noise")
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    reward = workspace.reward(cfg.reward)
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    prompts = prompt_source(cfg)
    T, mb = cfg.sampler.steps, cfg.model.max_batch
    _, end = cfg.sampler.window()
    method, noise = cfg.completion.method, cfg.sampler.noise
    ema = workspace.lora_state(pol) if cfg.optim.ema_decay is not None else None
    # the objective's second adapter (nft: it samples; awm: the KL's EMA target; dgpo: the clip's anchor)
    companion = workspace.lora_state(pol) if workspace.companion_group(cfg) else None
    records = []
    for it in range(iterations):
        t0 = time.perf_counter()
        nfe0 = pol.nfe
        plan = iteration_plan(cfg, prompts.splits, it)
        sigmas = pol.sigmas(T)
        trained = workspace.lora_state(pol)
        if companion is not None and workspace.companion_samples(cfg, training.adam_steps(opt)):
            workspace.set_lora(pol, companion)
        chunks = list(sample_iteration(pol, cfg, prompts.texts, plan, it, noise))  # as the rollout stage samples
        states = torch.cat([c.sde.states for c in chunks])
        reference = [c.ode_final for c in chunks if c.ode_final is not None]  # none: sampler.ode_reference false
        log_probs = torch.cat([c.sde.log_probs for c in chunks])
        t1 = time.perf_counter()
        nfe_rollout = pol.nfe - nfe0
        if method:  # as the complete stage completes (the states after `through` are x_T: scored once)
            through = completed_through(method, end, T)
            done = [
                out.latents
                for _, out in complete_chunks(
                    pol, method, states.numpy(), sigmas, prompts.texts, plan.prompt_ids, mb, through
                )
            ]
            clean = torch.cat(done)[:, [*range(through), T]]
        elif reference:
            clean = torch.stack([torch.cat(reference), states[:, -1]], dim=1)
        else:
            clean = states[:, -1:]
        workspace.set_lora(pol, trained)
        t2 = time.perf_counter()
        nfe_complete = pol.nfe - nfe0 - nfe_rollout
        B, K = clean.shape[:2]
        flat = clean.reshape(B * K, *clean.shape[2:])
        pids = np.repeat(plan.prompt_ids, K)
        images = torch.cat([reward_images(pol.decoder, flat[c0 : c0 + mb])[0] for c0 in range(0, len(flat), mb)])
        scored = score_images(
            reward, images, prompts.texts_of(pids), prompts.metadata_of(pids), chunk=mb
        ).scores.reshape(B, K)
        t3 = time.perf_counter()
        if method:  # R_k = R_T after `through`
            grid = torch.cat([scored[:, :through], scored[:, -1:].expand(B, T + 1 - through)], dim=1)
        else:
            grid = scored[:, -1:].expand(B, T + 1).clone()  # outcome reads R_T only
        groups = torch.from_numpy(plan.group_ids).long()
        branch = branch_steps_of(log_probs) if reads_branch(cfg.credit.scheme) and cfg.sampler.branches() else None
        trained, tree = training.trained_mask(cfg), cfg.sampler.tree()
        credit = assign(cfg.credit.scheme, grid, groups, trained, tree, branch, **cfg.credit.options)
        t4 = time.perf_counter()
        batch = training.Batch(
            states,
            log_probs,
            credit.advantages,
            torch.from_numpy(plan.group_ids),
            encode(pol, prompts.texts, plan.prompt_ids),
            sigmas,
            cfg.sampler.kernel,
            noise,
        )
        shuffle = generator(cfg.run.seed, "update", it)
        summary = training.update(pol, opt, cfg, batch, shuffle, companion, ema=ema)
        t5 = time.perf_counter()
        rec = {
            "iteration": it,
            "reward_mean": float(grid[:, -1].mean()),
            "seconds": t5 - t0,
            "rollout": t1 - t0,
            "complete": t2 - t1,
            "score": t3 - t2,
            "credit": t4 - t3,
            "update": t5 - t4,
            "nfe_rollout": nfe_rollout,
            "nfe_complete": nfe_complete,
            "clip_frac": summary.get("clip_frac"),
            "rewards": grid,
            "advantages": credit.advantages,
            "update_stats": summary,
        }
        records.append(rec)
        if on_iteration:
            on_iteration(it, rec)
    return records
