"""Pretrain the shipped `shapes` model from scratch, resumably, on a CPU.

Two stages, both on freshly rendered data (`stepgrpo.shapes.data`, training prompts only):

1. the autoencoder: `AutoencoderKL`, images `[N, 3, 32, 32]` in [-1, 1] -> latents `[N, 4, 8, 8]`;
   loss = MSE(reconstruction, image) + `kl_weight` * KL(posterior || N(0, I)), Adam with cosine
   decay over the stage's time budget. At the end the latent mean and std over a few thousand
   images become the VAE's `shift_factor` and `scaling_factor` (the pipeline decodes
   `z / scaling_factor + shift_factor`), so the transformer sees unit-variance latents.
2. the transformer and both text encoders jointly, with the rectified-flow loss (SD3, Esser et
   al. 2024, eq. 1 and the logit-normal timestep density of section 3.1):
   `x_s = (1 - s) x0 + s x1`, `x1 ~ N(0, I)`, `s = sigmoid(u)`, `u ~ N(0, 1)`, target `x1 - x0`
   (the velocity the Euler scheduler integrates from s = 1 to 0). 10% of captions are replaced by
   the empty prompt, which is the pipeline's negative prompt, so classifier-free guidance works.
   AdamW with linear warm-up, a constant rate, and a linear cool-down over the last minutes of
   the budget; an EMA of the weights is what gets exported.

Everything (weights, optimizer, EMA, RNG states, step, elapsed time) is checkpointed every few
minutes into `workdir`, so a killed process restarted with the same command continues exactly
where the last checkpoint left off. Budgets are wall-clock training time summed over restarts.
At the end the EMA weights are exported as an fp16 `StableDiffusion3Pipeline` directory.

Run: `stepgrpo pretrain --out models/shapes --overwrite` (`--help`: the options).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from stepgrpo.shapes import data
from stepgrpo.shapes.model import ModelSpec, build_pipeline, parameter_count

STATE_FILE = "state.json"


@dataclass(frozen=True)
class PretrainConfig:
    """Everything the pretraining reads; saved into the work dir and the model card."""

    workdir: str = ".pretrain"  # checkpoints, log and evaluations (not committed)
    out: str = ""  # exported pipeline directory ("": a new `models/shapes-<UTC time>`)
    overwrite: bool = False  # replace `out` when it already holds a model (the shipped one included)
    seed: int = 0  # seeds the weight init, the data stream and the noise
    spec: ModelSpec = ModelSpec()  # component sizes
    # stage 1: autoencoder
    vae_minutes: float = 22.0  # wall-clock budget of stage 1 (training time, summed over restarts)
    vae_batch: int = 32
    vae_lr: float = 4e-4  # 1e-3 was unstable for this VAE; cosine-decayed to 0 over the budget
    kl_weight: float = 1e-6  # tiny: the latents only need to be roughly Gaussian-scaled
    stats_images: int = 4096  # images used to measure the latent shift and scale
    # stage 2: transformer + text encoders
    minutes: float = 63.0  # wall-clock budget of stage 2 (training time; evaluations excluded)
    batch: int = 64
    lr: float = 5e-4
    warmup_steps: int = 200
    cooldown_minutes: float = 12.0  # linear decay of the rate to 0 over the last this many minutes
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ema: float = 0.999  # EMA decay; early steps use min(ema, (1 + step) / (10 + step))
    caption_dropout: float = 0.1  # fraction of empty captions, for classifier-free guidance
    # bookkeeping
    checkpoint_minutes: float = 4.0
    eval_minutes: float = 12.0  # held-out evaluation of the EMA weights every this often (0: never)
    eval_cfg: float = 4.0  # guidance scale of those evaluations
    threads: int = 1  # torch CPU threads: on a busy 2-core machine 2 threads ran 6x slower than 1

    def __post_init__(self) -> None:
        if not self.out:
            object.__setattr__(self, "out", f"models/shapes-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        if (Path(self.out) / "model_index.json").exists() and not self.overwrite:
            raise ValueError(
                f"{self.out} already holds a model; pretraining would replace it. Pick another --out, or pass "
                "--overwrite (to rebuild the shipped model: --out models/shapes --overwrite)"
            )
        for name in ("vae_minutes", "minutes", "checkpoint_minutes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"caption_dropout must be in [0, 1), got {self.caption_dropout}")
        if not 0 < self.ema < 1:
            raise ValueError(f"ema must be in (0, 1), got {self.ema}")


def _log(workdir: Path, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)


# ----------------------------------------------------------------------------------------------
# Checkpoints: one directory, replaced atomically (write `ckpt.new`, then swap names)


def _save_checkpoint(
    workdir: Path, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]], opt: dict
) -> None:
    new, cur, old = workdir / "ckpt.new", workdir / "ckpt", workdir / "ckpt.old"
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    for name, sd in tensors.items():
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, new / f"{name}.safetensors")
    # optimizer state is nested dicts of tensors and numbers: torch.save, read back with weights_only
    torch.save(opt, new / "optimizer.pt")
    (new / STATE_FILE).write_text(json.dumps(state, indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if cur.exists():
        cur.rename(old)
    new.rename(cur)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(workdir: Path) -> tuple[dict[str, Any], Path] | None:
    for name in ("ckpt", "ckpt.old"):  # `ckpt.old` only survives a crash in the middle of a swap
        path = workdir / name
        if (path / STATE_FILE).exists():
            return json.loads((path / STATE_FILE).read_text()), path
    return None


def _rng_state(np_rng: np.random.Generator, gen: torch.Generator) -> dict[str, Any]:
    return {"numpy": np_rng.bit_generator.state, "torch": gen.get_state().tolist()}


def _set_rng_state(np_rng: np.random.Generator, gen: torch.Generator, state: dict[str, Any]) -> None:
    np_rng.bit_generator.state = state["numpy"]
    gen.set_state(torch.tensor(state["torch"], dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------
# Stage 1: the autoencoder


def _vae_lr(cfg: PretrainConfig, step: int, total: int) -> float:
    return cfg.vae_lr * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(total, 1))))


def _train_vae(cfg: PretrainConfig, pipe, state: dict[str, Any], ckpt: Path | None, specs) -> None:
    """Stage 1; updates `pipe.vae` in place and `state` (stage, step, elapsed)."""
    workdir = Path(cfg.workdir)
    vae = pipe.vae
    vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=cfg.vae_lr)
    np_rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if ckpt is not None and state["stage"] == "vae":
        vae.load_state_dict(load_file(ckpt / "vae.safetensors"))
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        _set_rng_state(np_rng, gen, state["rng"])
        _log(workdir, f"vae: resumed at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")
    budget = cfg.vae_minutes * 60
    last_ckpt = time.monotonic()
    t0 = time.monotonic() - state["elapsed_s"]
    losses: list[float] = []
    while True:
        elapsed = time.monotonic() - t0
        if elapsed >= budget:
            break
        step = state["step"]
        # the cosine schedule runs on time, not steps: the number of steps a budget buys is unknown
        for g in opt.param_groups:
            g["lr"] = _vae_lr(cfg, int(elapsed), int(budget))
        images, _, _ = data.sample_batch(specs, cfg.vae_batch, np_rng)
        x = images * 2 - 1
        posterior = vae.encode(x).latent_dist
        rec = vae.decode(posterior.sample(generator=gen)).sample
        loss = F.mse_loss(rec, x) + cfg.kl_weight * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        state["step"] = step + 1
        if state["step"] % 25 == 0:
            _log(
                workdir,
                f"vae step {state['step']} loss {np.mean(losses):.5f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({elapsed / 60:.1f}/{cfg.vae_minutes} min)",
            )
            losses = []
        if time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            state["elapsed_s"] = time.monotonic() - t0
            state["rng"] = _rng_state(np_rng, gen)
            _save_checkpoint(workdir, state, {"vae": vae.state_dict()}, opt.state_dict())
            last_ckpt = time.monotonic()
    vae.eval()
    shift, scale = _latent_stats(vae, specs, cfg)
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    _log(
        workdir,
        f"vae: done after {state['step']} steps; latent shift {shift:.4f} scale {scale:.4f}; "
        f"reconstructions score {_reconstruction_score(vae, cfg):.3f} (shapes reward)",
    )
    state.update(stage="flow", vae_steps=state["step"], vae_elapsed_s=time.monotonic() - t0, step=0, elapsed_s=0.0)
    state["vae_factors"] = {"shift_factor": shift, "scaling_factor": scale}
    state.pop("rng", None)
    _save_checkpoint(workdir, state, {"vae": vae.state_dict()}, {})


@torch.no_grad()
def reconstruction_score(vae, n: int = 256, seed: int = 0) -> float:
    """Mean `shapes` reward of `n` held-out ground-truth images after encode -> decode (posterior mean)."""
    from stepgrpo.rewards.shapes import ShapesReward

    images, prompts, specs = data.sample_batch(data.split(held_out=True), n, np.random.default_rng(seed))
    rec = vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample
    return float(ShapesReward()(((rec + 1) / 2).clamp(0, 1), prompts, specs).scores.mean())


def _reconstruction_score(vae, cfg: PretrainConfig) -> float:
    return reconstruction_score(vae, seed=cfg.seed + 3)


@torch.no_grad()
def _latent_stats(vae, specs, cfg: PretrainConfig) -> tuple[float, float]:
    """(mean, 1 / std) of posterior samples over `cfg.stats_images` fresh images (own fixed seed)."""
    rng = np.random.default_rng(cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    zs = []
    for _ in range(max(1, cfg.stats_images // 256)):
        images, _, _ = data.sample_batch(specs, 256, rng)
        zs.append(vae.encode(images * 2 - 1).latent_dist.sample(generator=gen))
    z = torch.cat(zs)
    return float(z.mean()), float(1.0 / z.std())


# ----------------------------------------------------------------------------------------------
# Stage 2: the transformer and text encoders


def _flow_modules(pipe) -> dict[str, torch.nn.Module]:
    return {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}


def flow_loss(pipe, images: torch.Tensor, prompts: list[str], gen: torch.Generator) -> torch.Tensor:
    """Rectified-flow loss of a batch.

    images: `[N, 3, H, W]` in [0, 1]; prompts: `N` strings (empty = unconditional).
    The prompt goes through the pipeline's own `encode_prompt` (no T5: `max_sequence_length=0`),
    so training sees exactly the conditioning the pipeline builds when sampling.
    """
    vae = pipe.vae
    with torch.no_grad():
        z = vae.encode(images * 2 - 1).latent_dist.sample(generator=gen)
        x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor  # [N, 4, 8, 8]
    x1 = torch.randn(x0.shape, generator=gen)
    s = torch.sigmoid(torch.randn(x0.shape[0], generator=gen))  # logit-normal(0, 1) noise level
    xs = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * x1
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False, max_sequence_length=0
    )
    # the scheduler's timesteps are sigma * num_train_timesteps; the transformer is conditioned on those
    t = s * pipe.scheduler.config.num_train_timesteps
    v = pipe.transformer(hidden_states=xs, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled).sample
    return F.mse_loss(v, x1 - x0)


def _flow_lr(cfg: PretrainConfig, step: int, elapsed: float, budget: float) -> float:
    """Linear warm-up over `warmup_steps`, constant, then a linear cool-down to 0 over the last
    `cooldown_minutes` of the time budget (warmup-stable-decay: the decay is set by time because
    the number of steps a budget buys is unknown in advance)."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cool = min(1.0, max(0.0, budget - elapsed) / (cfg.cooldown_minutes * 60)) if cfg.cooldown_minutes > 0 else 1.0
    return cfg.lr * warm * cool


def _ema_decay(cfg: PretrainConfig, step: int) -> float:
    return min(cfg.ema, (1 + step) / (10 + step))


def _train_flow(cfg: PretrainConfig, pipe, state: dict[str, Any], ckpt: Path | None, specs) -> dict[str, torch.Tensor]:
    """Stage 2; returns the EMA weights `{module.param: tensor}` of the flow modules."""
    workdir = Path(cfg.workdir)
    modules = _flow_modules(pipe)
    params = {f"{m}.{k}": p for m, mod in modules.items() for k, p in mod.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema = {k: p.detach().clone() for k, p in params.items()}
    np_rng = np.random.default_rng(cfg.seed + 2)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    if ckpt is not None and "flow" in state.get("saved", []):
        weights = load_file(ckpt / "flow.safetensors")
        for name, mod in modules.items():
            mod.load_state_dict({k[len(name) + 1 :]: v for k, v in weights.items() if k.startswith(name + ".")})
        ema = load_file(ckpt / "ema.safetensors")
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        _set_rng_state(np_rng, gen, state["rng"])
        _log(workdir, f"flow: resumed at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")
    for mod in modules.values():
        mod.train()
    pipe.vae.eval()
    budget = cfg.minutes * 60
    t0 = time.monotonic() - state["elapsed_s"]
    last_ckpt = time.monotonic()
    next_eval = (state.get("last_eval_s", 0.0) + cfg.eval_minutes * 60) if cfg.eval_minutes else math.inf
    losses: list[float] = []
    while True:
        elapsed = time.monotonic() - t0
        if elapsed >= budget:
            break
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = _flow_lr(cfg, step, elapsed, budget)
        images, prompts, _ = data.sample_batch(specs, cfg.batch, np_rng)
        drop = np_rng.random(len(prompts)) < cfg.caption_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop)]
        loss = flow_loss(pipe, images, prompts, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.grad_clip)
        opt.step()
        decay = _ema_decay(cfg, step)
        with torch.no_grad():
            for k, p in params.items():
                ema[k].lerp_(p.detach(), 1 - decay)
        losses.append(loss.item())
        state["step"] = step + 1
        if state["step"] % 50 == 0:
            _log(
                workdir,
                f"flow step {state['step']} loss {np.mean(losses):.4f} "
                f"({elapsed / 60:.1f}/{cfg.minutes} min, {elapsed / max(state['step'], 1):.2f} s/step)",
            )
            losses = []
        save_now = time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60
        eval_now = elapsed >= next_eval
        if save_now or eval_now:
            state["elapsed_s"] = time.monotonic() - t0
            state["rng"] = _rng_state(np_rng, gen)
            state["saved"] = ["vae", "flow"]
            if eval_now:
                state["last_eval_s"] = elapsed
                next_eval = elapsed + cfg.eval_minutes * 60
            flow_weights = {f"{m}.{k}": v for m, mod in modules.items() for k, v in mod.state_dict().items()}
            _save_checkpoint(
                workdir, state, {"vae": pipe.vae.state_dict(), "flow": flow_weights, "ema": ema}, opt.state_dict()
            )
            last_ckpt = time.monotonic()
            if eval_now:
                # evaluation time is not training time: shift the clock by what it took
                t_eval = time.monotonic()
                _evaluate_ema(cfg, pipe, ema, state)
                t0 += time.monotonic() - t_eval
    state["elapsed_s"] = time.monotonic() - t0
    state["rng"] = _rng_state(np_rng, gen)
    state["saved"] = ["vae", "flow"]
    flow_weights = {f"{m}.{k}": v for m, mod in modules.items() for k, v in mod.state_dict().items()}
    _save_checkpoint(workdir, state, {"vae": pipe.vae.state_dict(), "flow": flow_weights, "ema": ema}, opt.state_dict())
    return ema


def ema_pipeline(pipe, ema: dict[str, torch.Tensor]):
    """A copy of `pipe` whose transformer and text encoders hold the EMA weights."""
    out = copy.deepcopy(pipe)
    for name, mod in _flow_modules(out).items():
        sd = mod.state_dict()
        for k in sd:
            if f"{name}.{k}" in ema:
                sd[k] = ema[f"{name}.{k}"]
        mod.load_state_dict(sd)
        mod.eval()
    return out


def _evaluate_ema(cfg: PretrainConfig, pipe, ema, state: dict[str, Any]) -> None:
    from stepgrpo.pretraining.evaluate import evaluate

    t = time.monotonic()
    result = evaluate(ema_pipeline(pipe, ema), seeds=(0,), guidance_scale=cfg.eval_cfg)
    m = result["mean"]
    line = " ".join(f"{k} {m[k]:.3f}" for k in ("score", "strict", "count", "colour", "shape", "spatial"))
    _log(
        Path(cfg.workdir),
        f"eval step {state['step']} ({state['elapsed_s'] / 60:.1f} min, cfg {cfg.eval_cfg}): "
        f"{line} [{time.monotonic() - t:.0f} s]",
    )
    with open(Path(cfg.workdir) / "evals.jsonl", "a") as f:
        f.write(
            json.dumps({"step": state["step"], "minutes": state["elapsed_s"] / 60, "cfg": cfg.eval_cfg, **m}) + "\n"
        )


# ----------------------------------------------------------------------------------------------
# Export and the entry point


def export(pipe, ema: dict[str, torch.Tensor], out: str | os.PathLike) -> int:
    """Save the EMA pipeline in fp16 to `out` (replaced); returns its size on disk in bytes."""
    out = Path(out)
    final = ema_pipeline(pipe, ema).to(torch.float16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    final.save_pretrained(tmp, safe_serialization=True)
    # keep files that are not the pipeline's (model card, sample grid) across re-exports
    if out.exists():
        for extra in ("README.md", "samples.png", "samples.txt", "eval.json"):
            if (out / extra).exists():
                shutil.copy2(out / extra, tmp / extra)
        shutil.rmtree(out)
    tmp.rename(out)
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run (or resume) both stages and export; returns a summary (steps, minutes, size, params)."""
    torch.set_num_threads(cfg.threads)
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    pipe = build_pipeline(cfg.spec, seed=cfg.seed)
    specs = data.split(held_out=False)
    loaded = _load_checkpoint(workdir)
    if loaded is None:
        state: dict[str, Any] = {"stage": "vae", "step": 0, "elapsed_s": 0.0}
        ckpt = None
        sizes = {k: parameter_count(v) for k, v in _flow_modules(pipe).items()} | {"vae": parameter_count(pipe.vae)}
        _log(workdir, f"start: parameters {sizes}, {len(specs)} training prompts")
    else:
        state, ckpt = loaded
    if state["stage"] == "vae":
        _train_vae(cfg, pipe, state, ckpt, specs)
        ckpt = workdir / "ckpt"
    else:
        pipe.vae.load_state_dict(load_file(ckpt / "vae.safetensors"))
        pipe.vae.register_to_config(**state["vae_factors"])
        pipe.vae.eval()
    pipe.vae.requires_grad_(False)
    ema = _train_flow(cfg, pipe, state, ckpt, specs)
    size = export(pipe, ema, cfg.out)
    summary = {
        "vae_steps": state.get("vae_steps"),
        "vae_minutes": state.get("vae_elapsed_s", 0) / 60,
        "flow_steps": state["step"],
        "flow_minutes": state["elapsed_s"] / 60,
        "size_bytes": size,
        "vae_factors": state["vae_factors"],
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    _log(workdir, f"exported to {cfg.out}: {size / 2**20:.1f} MiB; {summary}")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="stepgrpo pretrain",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = PretrainConfig.__dataclass_fields__
    p.add_argument("--workdir", default=d["workdir"].default, help="checkpoints and log; rerun with it to resume")
    p.add_argument("--out", default="", help="exported pipeline directory (default: a new models/shapes-<UTC time>)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it already holds a model")
    p.add_argument("--seed", type=int, default=d["seed"].default, help="weight init, data stream and noise")
    p.add_argument("--vae-minutes", type=float, default=d["vae_minutes"].default, help="stage 1 (autoencoder) budget")
    p.add_argument("--minutes", type=float, default=d["minutes"].default, help="stage 2 (transformer) budget")
    p.add_argument("--batch", type=int, default=d["batch"].default, help="stage 2 batch size")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="stage 2 peak learning rate")
    p.add_argument(
        "--cooldown-minutes", type=float, default=d["cooldown_minutes"].default, help="linear decay at the end"
    )
    p.add_argument(
        "--eval-minutes", type=float, default=d["eval_minutes"].default, help="held-out evaluation period (0: never)"
    )
    p.add_argument("--eval-cfg", type=float, default=d["eval_cfg"].default, help="guidance scale of those evaluations")
    p.add_argument(
        "--checkpoint-minutes", type=float, default=d["checkpoint_minutes"].default, help="checkpoint period"
    )
    p.add_argument("--threads", type=int, default=d["threads"].default, help="torch CPU threads")
    # every option's destination is the PretrainConfig field of the same name
    cfg = PretrainConfig(**vars(p.parse_args(argv)))
    pretrain(cfg)


if __name__ == "__main__":
    main()
