"""The policy update of one iteration, and what a checkpoint holds.

The math (PPO-clip, the KL to the reference, the step log-densities) is `stepgrpo_core`'s; this
module only loops: over inner epochs, over micro-batches of trajectories (shuffled by a generator
seeded from the run seed and the iteration), over the trained steps, accumulating gradients for
`grad_accum` micro-batches per optimizer step (Flow-GRPO accumulates over the timesteps too).

A checkpoint is data only (safetensors + JSON): the LoRA weights, the AdamW state flattened to
named tensors, the EMA of the LoRA weights when enabled, the torch RNG state, and the iteration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from stepgrpo.config import Config
from stepgrpo.report import track

# torch's AdamW keeps per-parameter tensors under these names (plus "step").
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def make_optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.AdamW:
    o = cfg.optim
    # foreach=False: the same arithmetic whatever the parameter count (bit-identical resume)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, foreach=False)


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as `{"<param index>.<name>": tensor}` (safetensors holds no nested dicts)."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{idx}.{name}"] = torch.as_tensor(value).detach().clone()
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value.clone()
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


def ema_update(ema: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor], decay: float) -> None:
    """`ema = decay * ema + (1 - decay) * weights`, in place."""
    for name, w in weights.items():
        ema[name].mul_(decay).add_(w.detach().to(ema[name].dtype), alpha=1.0 - decay)


def rng_tensor() -> torch.Tensor:
    return torch.random.get_rng_state().clone()


def update(
    pol: Any,
    opt: torch.optim.Optimizer,
    cfg: Config,
    states: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    cond: Any,
    sigmas: torch.Tensor,
    kernel: str,
    noise: float | torch.Tensor,
    generator: torch.Generator,
    ema: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """One iteration's policy update; returns mean diagnostics.

    Args:
        states: `[B, T+1, C, H, W]` stored rollout states; old_log_probs: `[B, T]` (NaN: not trainable).
        advantages: `[B, T]` (NaN: no credit); cond: conditioning pytree with leading dim `B`.
        sigmas: `[T+1]`; kernel, noise: the rollout's kernel and its noise (a float or the psi table).
    Trajectories whose advantages are all zero (dropped groups) are skipped, as in Flow-GRPO.
    """
    from stepgrpo_core.conditioning import take
    from stepgrpo_core.loss import grpo_loss
    from stepgrpo_core.rollout import step_log_prob

    o = cfg.optim
    steps = [k for k in cfg.trained_steps() if bool(torch.isfinite(old_log_probs[:, k]).all())]
    adv = torch.nan_to_num(advantages.float(), nan=0.0)
    rows = torch.nonzero((adv[:, steps] != 0).any(dim=1)).reshape(-1) if steps else torch.zeros(0, dtype=torch.long)
    stats: dict[str, list[float]] = {k: [] for k in ("loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean", "ratio_min", "ratio_max", "grad_norm")}
    trained = [p for p in pol.trainable_parameters()]
    named = {n: p for n, p in pol.transformer.named_parameters() if p.requires_grad}
    opt.zero_grad(set_to_none=True)
    micro = 0
    for _ in range(o.inner_epochs):
        order = rows[torch.randperm(len(rows), generator=generator)]
        batches = [b for b in order.split(o.micro_batch) if len(b)]  # split of an empty tensor gives one empty part
        for bi, idx in enumerate(track(batches, "update")):
            sub_cond = take(cond, idx)
            for k in steps:
                out = step_log_prob(pol.velocity, states[idx], sigmas, sub_cond, k, kernel, noise)
                ref_mean = None
                if o.kl_beta > 0:
                    with torch.no_grad(), pol.reference():
                        ref_mean = step_log_prob(pol.velocity, states[idx], sigmas, sub_cond, k, kernel, noise).mean
                loss = grpo_loss(
                    out.log_prob, old_log_probs[idx, k], adv[idx, k], clip_range=o.clip_range, adv_clip=o.adv_clip,
                    kl_beta=o.kl_beta, mean=out.mean if ref_mean is not None else None, ref_mean=ref_mean,
                    std=out.std if ref_mean is not None else None,
                )
                (loss.loss / (len(steps) * o.grad_accum)).backward()
                for name in ("clip_frac", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"):
                    stats[name].append(getattr(loss, name))
                stats["loss"].append(float(loss.loss.detach()))
                stats["policy_loss"].append(float(loss.policy_loss))
                stats["kl"].append(float(loss.kl))
            micro += 1
            if micro % o.grad_accum == 0 or bi == len(batches) - 1:
                stats["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(trained, o.max_grad_norm)))
                opt.step()
                opt.zero_grad(set_to_none=True)
                micro = 0
                if ema is not None and o.ema_decay is not None:
                    ema_update(ema, {n: p for n, p in named.items()}, o.ema_decay)
    summary = {k: (sum(v) / len(v) if v else float("nan")) for k, v in stats.items()}
    summary["ratio_min"] = min(stats["ratio_min"], default=float("nan"))
    summary["ratio_max"] = max(stats["ratio_max"], default=float("nan"))
    summary["trained_trajectories"] = float(len(rows))
    summary["trained_steps"] = float(len(steps))
    summary["optimizer_steps"] = float(len(stats["grad_norm"]))
    return summary


def checkpoint_state(iteration: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON part of a checkpoint (finite numbers only)."""
    clean = {k: v for k, v in summary.items() if isinstance(v, int | float) and v == v and abs(v) != float("inf")}
    return json.loads(json.dumps({"iteration": iteration, "update": clean}))
