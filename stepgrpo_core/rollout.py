"""Sampling trajectories with a transition kernel, and re-scoring stored transitions.

METHODS.md, "Notation" and "Transition kernels". A grid `sigmas: [T+1]` runs from `sigmas[0]`
(1, pure noise) down to `sigmas[T]` (0, clean); state `x_k` sits at `sigmas[k]` and step `k` is
`x_k -> x_{k+1}`. An SDE window `(start, size)` (MixGRPO, Flow-GRPO-Fast) makes only steps
`start .. start + size - 1` stochastic (and trained); every other step is an `ode` step.

`rollout` samples and records everything the later stages need; `step_log_prob` recomputes, with
gradient, the new policy's density of stored transitions: the policy update calls it once per
trained step (or with one step index per row), so memory stays at one step's activations.

Shapes: `B` trajectories, `T` steps, `C, H, W` latent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .kernels import KERNELS, log_prob, step_moments

Velocity = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # (x [B,C,H,W], sigma [B], cond) -> v


class Rollout(NamedTuple):
    states: torch.Tensor  # [B, T+1, C, H, W] x_0 .. x_T, in the dtype of x0
    log_probs: torch.Tensor  # [B, T] fp32 log-density of each step; NaN where the step is deterministic
    stds: torch.Tensor  # [B, T] fp32 std of each step (0 for ode steps)
    nfe: int  # velocity rows evaluated (B * T)
    velocities: torch.Tensor  # [B, T, C, H, W] the velocity step k was taken with, at x_k (dtype of x0);
    # `x_k - sigmas[k] v_k` is the rollout's own Tweedie estimate of the clean latent (completion `rollout`)


class StepLogProb(NamedTuple):
    log_prob: torch.Tensor  # [B] fp32, with gradient through `velocity`
    mean: torch.Tensor  # [B, C, H, W] fp32 kernel mean (for the KL to the reference policy)
    std: torch.Tensor  # [B, 1, 1, 1] fp32 kernel std


def check_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """Validate a grid `[T+1]` (strictly decreasing, within [0, 1]); return it as fp32."""
    if not isinstance(sigmas, torch.Tensor) or sigmas.dim() != 1 or sigmas.shape[0] < 2:
        raise ValueError("sigmas must be a 1-d tensor [T+1] with T >= 1 (read it from the scheduler)")
    s = sigmas.float()
    if bool((s[1:] >= s[:-1]).any()) or bool((s < 0).any()) or bool((s > 1).any()):
        raise ValueError(f"sigmas must decrease strictly within [0, 1] (1 = noise, 0 = clean); got {s.tolist()}")
    return s


def check_window(window: tuple[int, int] | None, num_steps: int) -> tuple[int, int]:
    """`None` -> every step; else `(start, size)` with `0 <= start`, `size >= 1`, `start + size <= T`."""
    if window is None:
        return 0, num_steps
    start, size = window
    if not (0 <= start and size >= 1 and start + size <= num_steps):
        raise ValueError(
            f"window (start, size) = {window} must satisfy 0 <= start, 1 <= size, start + size <= T = {num_steps}"
        )
    return int(start), int(size)


def _check_noise(kernel: str, noise, num_steps: int) -> None:
    if KERNELS.facts(kernel)["per_step"]:
        if not isinstance(noise, torch.Tensor) or noise.shape != (num_steps,):
            raise ValueError(
                f"kernel {kernel!r} takes a per-step table noise: [T={num_steps}] tensor (e.g. "
                "calibration.initial_psi(sigmas))"
            )


def _noise_at(kernel: str, noise, steps):
    """The kernel's noise for step(s) `steps` (int or `[B]`): a table lookup for per-step kernels."""
    if not KERNELS.facts(kernel)["per_step"]:
        return noise
    return noise[steps if isinstance(steps, int) else steps.to(noise.device)]


@torch.no_grad()  # sampling only: the update recomputes densities with `step_log_prob`
def rollout(
    velocity: Velocity,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    kernel: str = "flow",
    noise: float | torch.Tensor = 0.7,
    window: tuple[int, int] | None = None,
    generator: torch.Generator | None = None,
    ode_step: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Rollout:
    """Sample `B` trajectories from initial noise `x0` over the grid `sigmas`.

    Args:
        velocity: `velocity(x [B,C,H,W], sigma [B], cond) -> v [B,C,H,W]`.
        x0: `[B, C, H, W]` initial noise (state `x_0`); the states keep its dtype.
        sigmas: `[T+1]` grid, strictly decreasing from ~1 to 0.
        cond: conditioning pytree with leading dim `B` (passed through to `velocity`).
        kernel: a `KERNELS` name used inside the window.
        noise: `a` (flow, cps), `eta` (ddim), or the `[T]` table (psi).
        window: `(start, size)`: only steps `start .. start+size-1` use `kernel`, the rest `ode`.
        generator: the RNG for the step noise (on the device of `x0`); fix it for reproducibility.
        ode_step: `ode_step(k, x_k, v_k) -> x_{k+1}` for the deterministic steps (outside the
            window, and inside it for a deterministic kernel) instead of the Euler step: a
            multistep solver that keeps its own history (one object per call), e.g. DPM-Solver++.

    Returns `Rollout`. The velocities are kept because they are free: the clean latent each state
    predicts (`x_k - sigmas[k] v_k`) gives step rewards with no further transformer call. A step
    inside the window whose std is 0 (e.g. `ddim` with `eta = 0`) has no density and gets a NaN
    log-prob, like the steps outside the window: it cannot be trained.
    The log-prob is taken of the state as stored (after the cast to the dtype of `x0`), so
    `step_log_prob` on the stored states reproduces it exactly.
    """
    KERNELS.validate(kernel)
    if x0.dim() != 4:
        raise ValueError(f"x0 must be [B, C, H, W]; got {tuple(x0.shape)}")
    s = check_sigmas(sigmas).to(x0.device)
    num_steps = s.shape[0] - 1
    start, size = check_window(window, num_steps)
    _check_noise(kernel, noise, num_steps)

    batch = x0.shape[0]
    states = [x0]
    log_probs = torch.full((batch, num_steps), float("nan"), device=x0.device)
    stds = torch.zeros(batch, num_steps, device=x0.device)
    velocities = []
    x = x0
    for k in range(num_steps):
        v = velocity(x, s[k].repeat(batch), cond)  # repeat, not expand: models may write into it
        velocities.append(v.to(x0.dtype))
        kind = kernel if start <= k < start + size else "ode"
        mean, std = step_moments(kind, x, v, s[k], s[k + 1], _noise_at(kernel, noise, k))
        eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        if ode_step is not None and KERNELS.facts(kind)["deterministic"]:
            mean = ode_step(k, x, v).float()
        x = (mean + std * eps).to(x0.dtype)
        stochastic = std.reshape(batch) > 0
        if bool(stochastic.any()):
            # log_prob rejects std == 0; score those rows with a dummy std and NaN them after.
            safe_std = torch.where(std > 0, std, torch.ones_like(std))
            lp = log_prob(x, mean, safe_std)
            log_probs[:, k] = torch.where(stochastic, lp, torch.full_like(lp, float("nan")))
        stds[:, k] = std.reshape(batch)
        states.append(x)
    return Rollout(torch.stack(states, dim=1), log_probs, stds, batch * num_steps, torch.stack(velocities, dim=1))


def step_log_prob(
    velocity: Velocity,
    states: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: int | torch.Tensor,
    kernel: str = "flow",
    noise: float | torch.Tensor = 0.7,
) -> StepLogProb:
    """The current policy's log-density of the stored transitions `x_k -> x_{k+1}`, with gradient.

    Args:
        velocity, sigmas, cond, kernel, noise: as in `rollout` (`cond` rows match `states` rows).
        states: `[B, T+1, C, H, W]` stored states.
        steps: the step `k` for every row (int), or one step per row (`LongTensor [B]`).

    Returns `StepLogProb(log_prob [B], mean [B,C,H,W], std [B,1,1,1])`. Call it once per trained
    step with `velocity` = the policy (gradient) and, under `torch.no_grad()`, with the reference
    policy for the KL's `ref_mean`. Steps whose std is 0 (ode, `ddim` with `eta = 0`) are rejected
    by `log_prob`: train only the stochastic steps (finite `Rollout.log_probs`).
    """
    if states.dim() != 5:
        raise ValueError(f"states must be [B, T+1, C, H, W]; got {tuple(states.shape)}")
    batch = states.shape[0]
    s = check_sigmas(sigmas).to(states.device)
    num_steps = s.shape[0] - 1
    if states.shape[1] != num_steps + 1:
        raise ValueError(f"states have {states.shape[1]} states but sigmas define T + 1 = {num_steps + 1}")
    _check_noise(kernel, noise, num_steps)
    if isinstance(steps, int):
        k = torch.full((batch,), steps, dtype=torch.long, device=states.device)
    else:
        k = steps.to(device=states.device)
        if k.dtype != torch.long or k.shape != (batch,):
            raise ValueError(f"steps must be an int or a LongTensor [B={batch}]")
    if bool((k < 0).any()) or bool((k >= num_steps).any()):
        raise ValueError(f"steps must lie in [0, T-1] = [0, {num_steps - 1}]")
    rows = torch.arange(batch, device=states.device)
    x, x_next = states[rows, k], states[rows, k + 1]
    v = velocity(x, s[k], cond)
    mean, std = step_moments(kernel, x, v, s[k], s[k + 1], _noise_at(kernel, noise, k))
    return StepLogProb(log_prob(x_next, mean, std), mean, std)
