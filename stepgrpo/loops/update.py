"""The update's body: from the previous checkpoint (weights, AdamW state, EMA, the signal check's
sums) to the published checkpoint `iteration`, on the iteration's stored trajectories and
advantages; the loop itself is `stepgrpo.loops.training.update`. In this process (`train`) or over
`scale.update_processes` data-parallel ranks on this node (`launch`; each rank runs `main`).

Every rank loads the policy and the iteration's stored trajectories, draws the same shuffled
parts, and computes the gradient of its share of each part (`training.DataParallel`); one
all-reduce of the flattened LoRA gradient per optimizer step makes every rank take the same AdamW
step. Rank 0 publishes the checkpoint. The group size and the trajectories per iteration are the
config's whatever the number of processes.

Why a hand-made all-reduce rather than `DistributedDataParallel`: an update step runs one
backward per trained step and micro-batch, a number that differs between ranks when a part does
not split evenly, and DDP reduces on every backward (or needs `no_sync` and equal counts); the
LoRA gradient is a few MB, so one all-reduce per optimizer step costs nothing next to the forward
passes. How the ranks are started, meet and die with their launcher: `stepgrpo.runtime.parallel`.

    python -m stepgrpo.loops.update RUN_DIR ITERATION SCHEME OPTIONS_DIGEST KEY CONFIG_JSON   # per rank
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from stepgrpo.config import Config, validate_config
from stepgrpo.errors import StageError
from stepgrpo.loops import training, workspace
from stepgrpo.loops.sampling import encode, generator, stored_noise
from stepgrpo.prompts import stored_prompts
from stepgrpo.runtime import parallel as ranks
from stepgrpo.runtime.environment import pin_threads
from storage.run import Run


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
        prev = run.checkpoints.load_checkpoint(iteration - 1)
        training.load_optimizer_tensors(opt, prev.tensors.get("optimizer", {}))
        ema = prev.tensors.get("ema")
        signal = dict(prev.tensors.get("signal", {}))
    if cfg.optim.ema_decay is not None and ema is None:
        ema = workspace.lora_state(pol)
    if cfg.optim.kl_reference == "ema":
        pol.set_reference(ema)  # the EMA after the previous iteration (the base weights at iteration 0)
    data = run.stages.read_rollout(iteration)
    batch = training.Batch(
        states=torch.from_numpy(data.states).to(pol.device, pol.dtype),
        old_log_probs=torch.from_numpy(data.log_probs).to(pol.device),
        advantages=run.tables.advantage_grid(iteration, scheme, options_digest).to(pol.device),
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
    run.checkpoints.save_checkpoint(iteration, tensors, training.checkpoint_state(iteration, summary), inputs=inputs)


def launch(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> None:
    """Run the update of `iteration` over `cfg.scale.update_processes` processes on this node and
    wait for rank 0 to publish its checkpoint; a rank that fails stops the others."""

    def args(tmp: Path) -> list[str]:
        config = tmp / "config.json"
        config.write_text(cfg.model_dump_json())
        where = str(Path(run.path).resolve())
        return [sys.executable, "-m", __name__, where, str(iteration), scheme, options_digest, key, str(config)]

    n = cfg.scale.update_processes
    hint = "set scale.update_processes=1 to update in this process"
    ranks.run_ranks(args, n, f"iteration {iteration} update", hint)
    if run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"iteration {iteration} update over {n} processes ended without publishing its checkpoint")


def main(argv: list[str]) -> None:
    """One rank (the launcher sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous file)."""
    ranks.die_with_parent()
    import torch.distributed as dist

    run_dir, iteration, scheme, options_digest, key, config = argv
    cfg = validate_config(json.loads(Path(config).read_text()))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    gpu = cfg.model.device.startswith("cuda")
    if gpu:
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": device})})
    run = Run.open(run_dir)
    if pin_threads(run) is None:
        workspace.set_threads(cfg.scale.threads)
    ranks.init_group("nccl" if gpu else "gloo")
    try:
        parallel = training.DataParallel(rank, world, cfg.model.device if gpu else "cpu")
        train(run, cfg, int(iteration), scheme, options_digest, key, parallel)
        dist.barrier()
    finally:
        dist.destroy_process_group()


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


if __name__ == "__main__":
    main(sys.argv[1:])
