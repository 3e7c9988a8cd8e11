"""The GRPO policy loss: PPO clip on per-step density ratios plus a KL to the reference policy.

METHODS.md, "The policy loss". For each trained step (rows of one call):

    ratio = exp(logp_new - logp_old)
    A     = clip(advantages, -adv_clip, adv_clip)
    loss  = mean(max(-A ratio, -A clip(ratio, 1 - clip_range, 1 + clip_range))) + kl_beta KL
    KL    = mean_B( mean_CHW((mean - ref_mean)^2) / (2 kl_std^2) )

The reference is the same model with the LoRA adapter disabled (Flow-GRPO). `kl_std` decides the
form: the kernel's diffusion coefficient `eps_t` (`kernels.diffusion_coefficient`, Flow-GRPO's
code, no `sqrt(-dt)`: the form its published betas assume) or the step's actual std (the exact
KL between the two step Gaussians; `beta_exact = beta |dt|` gives the same penalty for `flow`).
Diagnostics: `clip_frac` (fraction with |ratio - 1| > clip_range), `zero_grad_frac` (fraction the
clip gives zero gradient: ratio above `1 + clip_range` with A > 0, or below `1 - clip_range` with
A < 0), `approx_kl` (`0.5 mean((logp_new - logp_old)^2)`, Flow-GRPO's estimate), and the ratio's
mean / std / min / max, which must be exactly 1 / 0 at the first inner step on-policy (a classic
bug detector).

Shapes: `log_prob, old_log_prob, advantages: [B]` (any common shape works); `mean, ref_mean:
[B, C, H, W]`; `kl_std: [B, 1, 1, 1]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, with gradient: policy_loss + kl_beta * kl
    policy_loss: torch.Tensor  # scalar, detached: the PPO-clip term
    kl: torch.Tensor  # scalar, detached: KL to the reference (0 when kl_beta == 0 and no means)
    clip_frac: float
    zero_grad_frac: float
    approx_kl: float
    ratio_mean: float
    ratio_std: float
    ratio_min: float
    ratio_max: float


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    adv_clip: float = 5.0,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    kl_std: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clip GRPO loss with advantage clipping and the reference KL (module doc): PPO's clipped
    surrogate (arXiv 1707.06347 eq. 7) per step with GRPO's group advantages and KL penalty
    (arXiv 2402.03300 eq. 3), on the SDE step's Gaussian log-density as Flow-GRPO does (arXiv
    2505.05470)."""
    if log_prob.shape != old_log_prob.shape or log_prob.shape != advantages.shape:
        raise ValueError(
            f"log_prob, old_log_prob and advantages must share a shape; got {tuple(log_prob.shape)}, "
            f"{tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )
    if clip_range <= 0 or adv_clip <= 0 or kl_beta < 0:
        raise ValueError(f"need clip_range > 0, adv_clip > 0, kl_beta >= 0; got {clip_range}, {adv_clip}, {kl_beta}")
    # fp32: the log-ratio is a difference of nearly equal numbers.
    log_ratio = log_prob.float() - old_log_prob.float().detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.float().detach().clamp(-adv_clip, adv_clip)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()

    has_means = mean is not None or ref_mean is not None
    if kl_beta > 0 or has_means:
        if mean is None or ref_mean is None or kl_std is None:
            raise ValueError(
                "the KL term needs mean, ref_mean and kl_std (from step_log_prob with the policy and the reference)"
            )
        if mean.shape != ref_mean.shape:
            raise ValueError(
                f"mean and ref_mean must share a shape; got {tuple(mean.shape)} and {tuple(ref_mean.shape)}"
            )
        sq = ((mean.float() - ref_mean.float().detach()) ** 2).mean(dim=tuple(range(1, mean.dim())))  # [B]
        kl = (sq / (2.0 * kl_std.float().detach().reshape(-1) ** 2)).mean()
    else:
        kl = torch.zeros((), device=log_prob.device)
    loss = policy_loss + kl_beta * kl

    with torch.no_grad():
        r = ratio.detach()
        # The max picks the clipped (constant) term: ratio beyond the clip on the side A pushes it.
        zero_grad = ((adv > 0) & (r > 1.0 + clip_range)) | ((adv < 0) & (r < 1.0 - clip_range))
        stats = dict(
            clip_frac=float(((r - 1.0).abs() > clip_range).float().mean()),
            zero_grad_frac=float(zero_grad.float().mean()),
            approx_kl=float(0.5 * (log_ratio.detach() ** 2).mean()),
            ratio_mean=float(r.mean()),
            ratio_std=float(r.std(unbiased=False)),
            ratio_min=float(r.min()),
            ratio_max=float(r.max()),
        )
    return LossOutput(loss, policy_loss.detach(), kl.detach(), **stats)


STEP_WEIGHTINGS = ("uniform", "noise")


def step_weights(
    mode: str, kernel: str, sigmas: torch.Tensor, noise: float | torch.Tensor, steps: list[int]
) -> torch.Tensor:
    """Per-step loss weights `w [len(steps)]` fp32, orthogonal to credit (METHODS.md, "Per-step loss weighting").

    `uniform`: 1 for every trained step. `noise` (TempFlow-GRPO, arXiv 2508.04324): `w_k`
    proportional to the step's transition std (the std of `x_{k+1} | x_k`, `eps_t sqrt(-dt)` for
    `flow`), normalized to mean 1 over the trained `steps` (TempFlow-GRPO's code scales by a fixed
    2.25 instead; the mean keeps the loss's scale, so a learning rate tuned with `uniform` stays
    comparable). `sigmas [T+1]`, `noise` as `rollout.rollout` takes it (the psi table for `psi`).
    """
    from .kernels import KERNELS, step_moments
    from .rollout import check_sigmas

    if mode not in STEP_WEIGHTINGS:
        raise ValueError(f"step weighting {mode!r} is not one of {', '.join(STEP_WEIGHTINGS)}")
    if not steps:
        return torch.zeros(0)
    if mode == "uniform":
        return torch.ones(len(steps))
    s = check_sigmas(sigmas).cpu()
    x = torch.zeros(1, 1, 1, 1)
    stds = []
    for k in steps:
        n = noise[k] if KERNELS.facts(kernel)["per_step"] else noise
        stds.append(float(step_moments(kernel, x, x, s[k], s[k + 1], n)[1]))
    std = torch.tensor(stds, dtype=torch.float32)
    if not bool((std > 0).all()):
        raise ValueError(f"step weighting noise needs a stochastic kernel on every trained step; stds {stds}")
    return std / std.mean()
