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
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CreditResult, RolloutResult, UpdateResult
from stepgrpo.sampling import encode, generator
from storage.run import Run
from tasks.base import manifest, reuse, stage_task
from tasks.keys import Key, stage_key
from tasks.rollout import stored_noise


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
        from stepgrpo.parallel import launch_update

        launch_update(run, cfg, iteration, scheme, options_digest, key)
    else:
        train(run, cfg, iteration, scheme, options_digest, key)


def train(
    run: Run,
    cfg: Config,
    iteration: int,
    scheme: str,
    options_digest: str,
    key: str,
    parallel: training.DataParallel | None = None,
) -> None:
    """Update from the previous checkpoint and publish checkpoint `iteration` (rank 0 of a
    data-parallel update publishes; every rank computes the same weights)."""
    t0 = time.perf_counter()
    pol = workspace.policy_at(run, cfg, iteration)
    nfe0 = pol.nfe
    opt = training.make_optimizer(pol.trainable_parameters(), cfg, iteration)
    ema, signal = None, {}
    if iteration > 0:
        prev = run.load_checkpoint(iteration - 1)
        training.load_optimizer_tensors(opt, prev.tensors.get("optimizer", {}))
        ema = prev.tensors.get("ema")
        signal = dict(prev.tensors.get("signal", {}))
    if cfg.optim.ema_decay is not None and ema is None:
        ema = workspace.lora_state(pol)
    if cfg.optim.kl_reference == "ema":
        pol.set_reference(ema)  # the EMA after the previous iteration (the base weights at iteration 0)
    data = run.read_rollout(iteration)
    batch = training.Batch(
        states=torch.from_numpy(data.states).to(pol.device, pol.dtype),
        old_log_probs=torch.from_numpy(data.log_probs).to(pol.device),
        advantages=run.advantage_grid(iteration, scheme, options_digest).to(pol.device),
        group_ids=torch.from_numpy(data.group_ids),
        cond=encode(pol, stored_prompts(run).texts, data.prompt_ids),
        sigmas=torch.from_numpy(data.sigmas).to(pol.device),
        kernel=data.kernel,
        noise=stored_noise(data.kernel_params, pol.device),
    )
    shuffle = generator(cfg.run.seed, "update", iteration)
    summary = training.update(
        pol,
        opt,
        cfg,
        batch,
        shuffle,
        ema=ema,
        initial=workspace.initial_lora(cfg),
        signal=signal if cfg.optim.diagnostics else None,
        parallel=parallel,
    )
    if parallel is not None and parallel.rank != 0:
        return
    tensors = {
        workspace.trained_group(cfg): workspace.lora_state(pol),
        "optimizer": training.optimizer_tensors(opt),
        "rng": {"update": shuffle.get_state()},  # the update's only random source, after it
    }
    if ema is not None:
        tensors["ema"] = ema
    if signal:
        tensors["signal"] = signal
    inputs = {"key": key, "seconds": time.perf_counter() - t0, "nfe": pol.nfe - nfe0}
    if parallel is not None:
        inputs["processes"] = parallel.world
    # timings and counters go in the manifest, not the digested files: equal inputs, equal checkpoint bytes
    run.save_checkpoint(iteration, tensors, training.checkpoint_state(iteration, summary), inputs=inputs)


def stored(run: Run, iteration: int, verify: bool = False) -> UpdateResult:
    """The result of the published checkpoint of `iteration` (`verify`: check its files first)."""
    m = manifest(run, iteration, "checkpoint", f"checkpoint {iteration}", verify)
    state = json.loads((run.stage_path(iteration, "checkpoint") / "state.json").read_text())
    seconds = m["inputs"].get("seconds", state.get("seconds", 0.0))  # older checkpoints kept it in state.json
    nfe = int(m["inputs"].get("nfe", 0))
    return UpdateResult(digest=m["digest"], iteration=iteration, seconds=seconds, stats=state["update"], nfe=nfe)


def export_lora(run: Run, cfg: Config, iteration: int) -> Path:
    """Write the weights after `iteration` (their EMA when enabled): the LoRA as `<run>/lora/`, in the
    format `StableDiffusion3Pipeline.load_lora_weights` reads; with full fine-tuning the transformer
    as `<run>/transformer/` (`SD3Transformer2DModel.from_pretrained`, safetensors)."""
    out = run.inside(Path(run.path) / ("transformer" if cfg.model.finetune == "full" else "lora"))  # no link out
    pol = workspace.policy_after(run, cfg, iteration)
    if cfg.model.finetune == "full":
        pol.transformer.save_pretrained(str(out), safe_serialization=True)
    else:
        pol.save_lora(out)
    run.seal_export(out.name)  # `inspect --verify` finds a damaged export
    return out
