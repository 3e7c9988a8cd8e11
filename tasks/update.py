"""The update stage: PPO-clip + KL on an iteration's stored trajectories and advantages.

Starts from the previous checkpoint (weights, AdamW state, EMA, the signal check's sums) and
publishes checkpoint `iteration`; the loop itself is `stepgrpo.training.update`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from stepgrpo import training, workspace
from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CreditResult, RolloutResult, UpdateResult
from stepgrpo.sampling import encode, generator
from storage.run import Run
from tasks.base import published, stage_task
from tasks.keys import stage_key


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


def execute(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> UpdateResult:
    if not published(run.stage_manifest(iteration, "checkpoint"), key, f"iteration {iteration} checkpoint"):
        t0 = time.perf_counter()
        pol = workspace.policy_at(run, cfg, iteration)
        opt = training.make_optimizer(pol.trainable_parameters(), cfg)
        ema, signal = None, {}
        if iteration > 0:
            prev = run.load_checkpoint(iteration - 1)
            training.load_optimizer_tensors(opt, prev.tensors.get("optimizer", {}))
            ema = prev.tensors.get("ema")
            signal = dict(prev.tensors.get("signal", {}))
        if cfg.optim.ema_decay is not None and ema is None:
            ema = workspace.lora_state(pol)
        data = run.read_rollout(iteration)
        noise = data.kernel_params["noise"]
        batch = training.Batch(
            states=torch.from_numpy(data.states).to(pol.device, pol.dtype),
            old_log_probs=torch.from_numpy(data.log_probs).to(pol.device),
            advantages=run.advantage_grid(iteration, scheme, options_digest).to(pol.device),
            group_ids=torch.from_numpy(data.group_ids),
            cond=encode(pol, stored_prompts(run).texts, data.prompt_ids),
            sigmas=torch.from_numpy(data.sigmas).to(pol.device),
            kernel=data.kernel,
            noise=torch.tensor(noise, dtype=torch.float32, device=pol.device)
            if isinstance(noise, list)
            else float(noise),
        )
        summary = training.update(
            pol,
            opt,
            cfg,
            batch,
            generator(cfg.run.seed, "update", iteration),
            ema=ema,
            initial=workspace.initial_lora(cfg),
            signal=signal if cfg.optim.diagnostics else None,
        )
        tensors = {
            "lora": workspace.lora_state(pol),
            "optimizer": training.optimizer_tensors(opt),
            "rng": {"torch": training.rng_tensor()},
        }
        if ema is not None:
            tensors["ema"] = ema
        if signal:
            tensors["signal"] = signal
        state = training.checkpoint_state(iteration, summary)
        state.update(key=key, seconds=time.perf_counter() - t0, nfe=pol.nfe)
        run.save_checkpoint(iteration, tensors, state)
    return stored(run, iteration)


def stored(run: Run, iteration: int) -> UpdateResult:
    """The result of the published checkpoint of `iteration`."""
    m = run.stage_manifest(iteration, "checkpoint")
    if m is None:
        raise StageError(f"run {run.run_id} has no checkpoint for iteration {iteration}")
    state = json.loads((run.stage_path(iteration, "checkpoint") / "state.json").read_text())
    return UpdateResult(
        digest=m["digest"], iteration=iteration, seconds=state.get("seconds", 0.0), stats=state["update"]
    )


def export_lora(run: Run, cfg: Config, iteration: int) -> Path:
    """Write the LoRA after `iteration` (its EMA when enabled) as `<run>/lora/`, in the format
    `StableDiffusion3Pipeline.load_lora_weights` reads."""
    return workspace.policy_after(run, cfg, iteration).save_lora(Path(run.path) / "lora")
