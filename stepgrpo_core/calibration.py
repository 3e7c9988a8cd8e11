"""DenseGRPO exploration calibration: the per-step noise table `psi [T]` of the `psi` kernel
(arXiv 2601.20218, "reward-aware exploration space calibration").

METHODS.md, "DenseGRPO exploration calibration". Before training, sample `N` trajectories with
the `psi` kernel, compute their dense gains `g [N, T]`, and per step `k`: widen the exploration
(`psi[k] += eps2`) when the gains are balanced (`|#(g_k > 0) - #(g_k < 0)| < eps1`), narrow it
(`psi[k] -= eps2`) otherwise; clamp at 0. Repeat for a number of rounds, then keep `psi` fixed.
"""

from __future__ import annotations

import torch

from .kernels import flow_scale
from .rollout import check_sigmas


def initial_psi(sigmas: torch.Tensor, a: float = 0.7) -> torch.Tensor:
    """The starting table `[T]` (*choice*, METHODS.md): the `flow` kernel's `a sqrt(s / (1 - s))`.

    `sigmas: [T+1]`. At `s = 1` (step 0), `sigmas[1]` stands in for `s`, as in the `flow` kernel,
    so the `psi` kernel with this table equals the `flow` kernel with `a`.
    """
    if a < 0:
        raise ValueError(f"a must be >= 0; got {a}")
    s = check_sigmas(sigmas)
    return flow_scale(s[:-1], s[1:], a)


def update_psi(psi: torch.Tensor, gains: torch.Tensor, eps1: float = 2, eps2: float = 0.01) -> torch.Tensor:
    """One calibration round: `psi [T]`, dense gains `gains [N, T]` -> new `psi [T]` (>= 0).

    `eps1`: the largest imbalance `|#pos - #neg|` (exclusive) still counted as balanced;
    `eps2`: the step size. Zero gains count as neither sign.
    """
    if psi.dim() != 1 or gains.dim() != 2 or gains.shape[1] != psi.shape[0]:
        raise ValueError(f"psi must be [T] and gains [N, T]; got {tuple(psi.shape)} and {tuple(gains.shape)}")
    if eps2 < 0:
        raise ValueError(f"eps2 (the step size) must be >= 0; got {eps2}")
    imbalance = ((gains > 0).sum(dim=0) - (gains < 0).sum(dim=0)).abs().to(psi.device)  # [T]
    step = torch.where(imbalance < eps1, eps2, -eps2).to(psi.dtype)
    return (psi + step).clamp_min(0.0)
