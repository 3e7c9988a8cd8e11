"""Transition kernels: the Gaussian `x_{k+1} | x_k` of one sampling step, and its log-density.

METHODS.md, "Transition kernels". With `s = sigmas[k]`, `s' = sigmas[k+1]`, `dt = s' - s < 0`,
`x0_hat = x - s v` and `x1_hat = x + (1 - s) v` (Tweedie estimates):

| kernel | std of the step                          | mean                                             |
|--------|------------------------------------------|--------------------------------------------------|
| ode    | 0                                        | x + v dt  (Euler)                                |
| flow   | eps_t sqrt(-dt), eps_t = a sqrt(s/(1-s)) | x + v dt + eps_t^2 / (2 s) (x + (1 - s) v) dt    |
| cps    | s' sin(a pi / 2)                         | (1 - s') x0_hat + sqrt(s'^2 - std^2) x1_hat      |
| ddim   | eta s' sqrt(1 - r^2), r = SNR ratio      | as cps                                           |
| psi    | psi[k] sqrt(-dt) (psi[k] replaces eps_t) | as flow                                          |

Sources: `flow` is Flow-GRPO's SDE (Euler-Maruyama of the reverse SDE that keeps the flow's
marginals), `cps` its "coefficients-preserving" sampler, `ddim` Stepwise-Flow-GRPO's DDIM-like
SDE (arXiv 2603.28718; DDIM's eq. 16, Song et al. 2021, on the flow's coefficients: see `ddim`),
`psi` DenseGRPO's per-step calibrated noise.

`s = 1` for `flow`: `a sqrt(s / (1 - s))` is infinite at pure noise. Flow-GRPO's
`sde_step_with_logprob` substitutes `sigmas[1]` for `s` in the denominator only:
`eps_t = a sqrt(s / (1 - s_d))`, `s_d = sigmas[1]` when `s = 1`. A kernel only sees `s` and `s'`,
and `s = 1` only happens at step 0, where `s' = sigmas[1]`; so `s_d = s'` whenever `s >= 1`. The
mean keeps the true `s` everywhere. `psi` needs no substitution: the table value is finite.

The diffusion coefficient (`diffusion_coefficient`) is the step's std without the `sqrt(-dt)`
factor of the Euler-Maruyama kernels (`flow`, `psi`); for the others it is the std itself. It is
what Flow-GRPO's KL divides by (`loss.grpo_loss`, `kl_form`).

Shapes: `x, v: [B, C, H, W]`; `sigma, sigma_next, noise`: python floats, 0-d or `[B]` tensors.
`mean: [B, C, H, W]` fp32, `std: [B, 1, 1, 1]` fp32. All math in fp32: bf16 steps lose the small
`dt` terms and the log-density ratio is taken between nearly equal numbers.

The log-density is the exact Gaussian one averaged over C, H, W (Flow-GRPO's averaging
convention). Flow-GRPO's `cps` code drops the `1 / (2 std^2)` factor; ours does not, so clip
ranges tuned on their `cps` runs do not transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .registry import Registry

Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]
# Facts: `calibrated` (the noise is a per-step table calibrated on the run's base policy, not a
# number of the config) and `calibrate_with` (the credit scheme whose step gains calibration reads).
# Fact `version`: bumped when a kernel samples other steps from the same noise (rollouts name it).
# Facts: `noise` (what the kernel's `noise` argument means and its valid range, `(name, low, high)`,
# checked once in `step_moments` so every kernel rejects bad values in the same words; None: the
# kernel ignores it), `per_step` (its noise is a table `[T]` indexed by the step, not one value),
# `euler_maruyama` (its std is `eps_t sqrt(-dt)`: the diffusion coefficient is std / sqrt(-dt)),
# `calibrated` / `calibrate_with` (its table is calibrated before training, by that scheme's
# credit), `version` (bumped when a change can change its numbers; enters cache keys),
# `deterministic` (std 0 at every step: a group's members differ only by their initial noise).
KERNELS: Registry[Kernel] = Registry(
    "kernel",
    options=lambda name: _noise_option(name),
    noise=None,
    per_step=False,
    euler_maruyama=False,
    calibrated=False,
    calibrate_with=None,
    version="1",
    deterministic=False,
)

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def flow_scale(sigma: torch.Tensor, sigma_next: torch.Tensor, a) -> torch.Tensor:
    """Flow-GRPO's diffusion coefficient `eps_t = a sqrt(s / (1 - s_d))`, `s_d = s'` at `s = 1`, else `s`.

    Shapes broadcast. Also the initial DenseGRPO `psi` table (`calibration.initial_psi`).
    """
    s_d = torch.where(sigma >= 1.0, sigma_next, sigma)
    return a * torch.sqrt(sigma / (1.0 - s_d))


def _sde_moments(x, v, sigma, sigma_next, eps_t):
    # Flow-GRPO eq. for the reverse SDE: drift v + eps_t^2 / (2 s) * (x + (1 - s) v), where
    # -(x + (1 - s) v) / s is the score of the flow's marginal; Euler-Maruyama over dt < 0.
    dt = sigma_next - sigma
    mean = x + v * dt + eps_t**2 / (2.0 * sigma) * (x + (1.0 - sigma) * v) * dt
    std = eps_t * torch.sqrt(-dt)
    return mean, std


def _preserving_mean(x, v, sigma, sigma_next, std):
    # Rebuild x_{k+1} from the two Tweedie estimates with total noise level s' split between the
    # predicted noise (deterministic part) and fresh noise (std): keeps the marginal N((1-s')x0, s'^2).
    x0_hat = x - sigma * v
    x1_hat = x + (1.0 - sigma) * v
    # clamp: at std == s' (cps with a = 1) rounding can make the argument -1e-8.
    return (1.0 - sigma_next) * x0_hat + torch.sqrt((sigma_next**2 - std**2).clamp_min(0.0)) * x1_hat


def _noise_option(name: str) -> dict[str, str]:
    """A kernel's one option, `sampler.noise`: its name in the kernel's formula and its range."""
    noise = KERNELS.facts(name)["noise"]
    return {} if noise is None else {"sampler.noise": f"{noise[0]} in [{noise[1]}, {noise[2]}]"}


@KERNELS.register(
    "ode", deterministic=True, paper="standard: the Euler step of the flow's ODE (SD3's sampler, arXiv 2403.03206)"
)
def ode(x, v, sigma, sigma_next, noise):
    """Euler step of the probability-flow ODE; std 0 (`noise` ignored). The rectified-flow sampler
    (SD3, arXiv 2403.03206)."""
    return x + v * (sigma_next - sigma), torch.zeros_like(sigma)


@KERNELS.register(  # a < sqrt(2): the first step's mean keeps a positive share of x (docstring)
    "flow", noise=("a", 0.0, math.sqrt(2.0)), euler_maruyama=True, paper='arXiv 2505.05470, "ODE-to-SDE conversion"'
)
def flow(x, v, sigma, sigma_next, noise):
    """Flow-GRPO SDE step; `noise` is `a` (default 0.7). arXiv 2505.05470, "ODE-to-SDE conversion":
    the reverse SDE with the flow's score and its Euler-Maruyama step, `sigma_t = a sqrt(t / (1 - t))`.

    `a` is bounded by sqrt(2): the mean's coefficient on `x` is `1 + a^2 dt / (2 (1 - s_d))`, which on
    the first step (`s = 1`, `s_d = s'`, `dt = s' - 1`) is `1 - a^2 / 2` on every grid: 0 at `a = sqrt(2)`
    (the state's signal dropped) and negative above it (flipped; `a = 70`, a typed percent, overflows
    within a few steps). Flow-GRPO uses 0.7."""
    return _sde_moments(x, v, sigma, sigma_next, flow_scale(sigma, sigma_next, noise))


@KERNELS.register(
    "psi",
    noise=("psi[k]", 0.0, math.inf),
    per_step=True,
    euler_maruyama=True,
    calibrated=True,
    calibrate_with="dense",
    paper='arXiv 2601.20218, "reward-aware exploration calibration"',
)
def psi(x, v, sigma, sigma_next, noise):
    """DenseGRPO step: the `flow` SDE with `eps_t = psi[k]` (`noise` is the table entry). arXiv
    2601.20218, "reward-aware exploration calibration": a timestep-specific stochasticity in the SDE."""
    return _sde_moments(x, v, sigma, sigma_next, noise)


@KERNELS.register(  # std = s' sin(a pi/2) must stay <= s'
    "cps", noise=("a", 0.0, 1.0), paper="arXiv 2010.02502, eq. 12 (the mean; the `cps` sampler of Flow-GRPO's code)"
)
def cps(x, v, sigma, sigma_next, noise):
    """Coefficients-preserving step; `noise` is `a` in [0, 1], std `s' sin(a pi / 2)`: the mean keeps
    the marginal's signal and noise coefficients (the `cps` sampler of Flow-GRPO's code, arXiv
    2505.05470; the same mean as DDIM's eq. 12, arXiv 2010.02502)."""
    std = sigma_next * torch.sin(noise * (math.pi / 2.0))
    return _preserving_mean(x, v, sigma, sigma_next, std), std


# version 2: DDIM's posterior std (version 1 used `eta s' sqrt(1 - s)`, which is no DDIM formula:
# 0 at s = 1 and about a fifth of DDIM's noise on the early steps of a shifted grid).
@KERNELS.register(  # std <= eta s' <= s'
    "ddim",
    noise=("eta", 0.0, 1.0),
    version="2",
    paper='arXiv 2603.28718, "DDIM-inspired SDE"; std: arXiv 2010.02502, eq. 16',
)
def ddim(x, v, sigma, sigma_next, noise):
    """Stepwise-Flow-GRPO's DDIM-inspired step (arXiv 2603.28718, "DDIM-inspired SDE"); `noise` is
    `eta` in [0, 1]. The std is DDIM's eq. 16 (arXiv 2010.02502), the mean its eq. 12.

    DDIM (Song et al. 2021, eq. 16) draws `x_{t-1}` with std
    `sigma_t(eta) = eta sqrt((1 - abar_{t-1}) / (1 - abar_t)) sqrt(1 - abar_t / abar_{t-1})`, the std of
    the forward process's posterior `q(x_{t-1} | x_t, x_0)` scaled by `eta`. Written for any signal /
    noise coefficients `(a, b)` (rectified flow: `a = 1 - s`, `b = s`) it is
    `eta (b' / b) sqrt(b^2 - (a b' / a')^2) = eta s' sqrt(1 - r^2)`, `r = ((1 - s) s') / (s (1 - s'))`
    (the ratio of the two levels' signal-to-noise ratios, < 1). `eta = 0` is the ODE (DDIM),
    `eta = 1` the posterior (DDPM-like); at `s = 1` the std is `eta s'`, at `s' = 0` it is 0. The
    mean is the coefficients-preserving one (as `cps`), so every `eta` keeps the flow's marginals.
    """
    r = (1.0 - sigma) * sigma_next / (sigma * (1.0 - sigma_next)).clamp_min(1e-12)
    std = noise * sigma_next * torch.sqrt((1.0 - r**2).clamp_min(0.0))
    return _preserving_mean(x, v, sigma, sigma_next, std), std


def diffusion_coefficient(kind: str, std: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """The step's diffusion coefficient: `std / sqrt(-dt)` for `flow` / `psi`, `std` otherwise.

    `std: [B, 1, 1, 1]` from `step_moments`; `sigma, sigma_next` as there. Returns `[B, 1, 1, 1]` fp32.
    """
    KERNELS.validate(kind)
    if not KERNELS.facts(kind)["euler_maruyama"]:
        return std.float()
    batch, device = std.shape[0], std.device
    dt = _as_column(sigma_next, batch, device, "sigma_next") - _as_column(sigma, batch, device, "sigma")
    return std.float() / torch.sqrt(-dt)


def _as_column(value, batch: int, device: torch.device, name: str) -> torch.Tensor:
    """float / 0-d / [B] -> fp32 [B, 1, 1, 1] on `device`."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be a float, a 0-d tensor or a [B={batch}] tensor; got shape {tuple(t.shape)}")
    return t.reshape(batch, 1, 1, 1)


def step_moments(kind: str, x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, noise=None):
    """Mean and std of `x_{k+1} | x_k` under kernel `kind` (METHODS.md table, see module doc).

    Args:
        kind: a name in `KERNELS`.
        x: `[B, C, H, W]` state `x_k`; v: `[B, C, H, W]` velocity at `(x_k, sigma)`.
        sigma, sigma_next: `s = sigmas[k]`, `s' = sigmas[k+1]`; float, 0-d or `[B]`.
        noise: `a` (flow, cps), `eta` (ddim), `psi[k]` (psi), ignored for ode; float, 0-d or `[B]`.

    Returns:
        `(mean [B, C, H, W] fp32, std [B, 1, 1, 1] fp32)`; `std` is the std of the step itself
        (`sqrt(-dt)` included for flow / psi).
    """
    fn = KERNELS.get(kind)
    if x.dim() != 4 or v.shape != x.shape:
        raise ValueError(f"x and v must both be [B, C, H, W]; got {tuple(x.shape)} and {tuple(v.shape)}")
    batch, device = x.shape[0], x.device
    s = _as_column(sigma, batch, device, "sigma")
    s_next = _as_column(sigma_next, batch, device, "sigma_next")
    if bool((s_next > s).any()) or bool((s <= 0).any()) or bool((s_next < 0).any()):
        raise ValueError("a step needs 0 <= sigma_next <= sigma and sigma > 0 (the grid runs from 1 to 0)")
    spec = KERNELS.facts(kind)["noise"]
    if spec is None:  # the kernel ignores noise: do not force callers to pass a valid one
        n = torch.zeros_like(s)
    else:
        name, lo, hi = spec
        if noise is None:
            raise ValueError(f"kernel {kind!r} needs `noise` (its {name})")
        n = _as_column(noise, batch, device, "noise")
        if bool((n < lo).any()) or bool((n > hi).any()) or bool(n.isnan().any()):
            raise ValueError(f"kernel {kind!r}: noise (its {name}) must lie in [{lo}, {hi}]")
    # fp32: see the module docstring.
    return fn(x.float(), v.float(), s, s_next, n)


def log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Exact Gaussian log-density of `x_next` under `N(mean, std^2)`, averaged over C, H, W.

    `x_next, mean: [B, C, H, W]`, `std` broadcastable (`[B, 1, 1, 1]`), all > 0. Returns `[B]`
    fp32. A zero std (an `ode` step, `ddim` at `s = 1`) has no density: rejected.
    """
    if x_next.shape != mean.shape or x_next.dim() < 2:
        raise ValueError(
            f"x_next and mean must share a [B, ...] shape; got {tuple(x_next.shape)} and {tuple(mean.shape)}"
        )
    x_next, mean, std = x_next.float(), mean.float(), std.float()
    if bool((std <= 0).any()):
        raise ValueError(
            "log_prob needs std > 0: a deterministic step (ode, ddim at sigma = 1, zero noise) has no density"
        )
    logp = -((x_next - mean) ** 2) / (2.0 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return logp.mean(dim=tuple(range(1, logp.dim())))
