"""Judging credit: Monte-Carlo true values and advantages, and the gradient check.

METHODS.md, "Judging credit". Every scheme estimates the step's true advantage under the current
policy: `V(x_k) = E[R_T | x_k]` (the expected final reward when the rest of the trajectory is
sampled with the policy's SDE) and `A*_k = V(x_{k+1}) - V(x_k)`. `V` is estimated by `M` SDE
continuations of each stored state; the continuations split into two independent halves, whose
agreement measures the Monte-Carlo noise that attenuates every correlation and cosine with the
estimate (Spearman's correction for attenuation, with the Spearman-Brown reliability of the whole
from its halves' correlation `r`: `2 r / (1 + r)`).

The gradient check: with per-row scores `s_{b,k} = grad log pi(x_{k+1} | x_k)` on the stored rows,
a credit table `A [B, T]` gives the batch gradient `G(A) = sum_{b, k trained} A_{b,k} s_{b,k}`;
its quality is `cos(G(A_scheme), G(A*))`, divided by `sqrt(rel)` with `rel` the reliability of
`G(A*)` from the cosine of its halves' gradients. Intervals are percentile bootstraps over prompt
groups (the rows of a group are not independent).

Shapes: `B` trajectories, `T` steps, `M` continuations, `P` score dims, `n` groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .credit import Groups
from .kernels import KERNELS
from .rollout import Velocity, check_window, rollout


class TrueValues(NamedTuple):
    value: torch.Tensor  # [B, T+1] fp64 V(x_k): the mean final reward of the M continuations
    halves: torch.Tensor  # [2, B, T+1] fp64 the same from the first and the second half of them


def true_values(finals: torch.Tensor) -> TrueValues:
    """`finals [B, T+1, M]`: the final reward of continuation `m` of state `x_k` (state `x_T` and the
    states after the SDE window evolve deterministically: their `M` entries repeat one value).
    `M >= 2`; the halves are the first `M // 2` and the rest."""
    if finals.dim() != 3 or finals.shape[2] < 2:
        raise ValueError(f"finals must be [B, T+1, M] with M >= 2 continuations; got {tuple(finals.shape)}")
    if not bool(torch.isfinite(finals).all()):
        raise ValueError("finals contain NaN/inf: every continuation needs a reward")
    f = finals.double()
    half = f.shape[2] // 2
    return TrueValues(f.mean(2), torch.stack([f[..., :half].mean(2), f[..., half:].mean(2)]))


def true_advantages(values: torch.Tensor) -> torch.Tensor:
    """`A*_k = V(x_{k+1}) - V(x_k)`: `[..., B, T+1]` -> `[..., B, T]`."""
    return values[..., 1:] - values[..., :-1]


def oracle_advantages(values: torch.Tensor, trained: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle credit: every trained step gets its true advantage `A*_k = V(x_{k+1}) - V(x_k)`,
    scaled by `1 / (std(R_T) + STD_EPS)` over the batch (`R_T = V(x_T)`), outcome's global scale,
    so that with `sum_k A*_k = R_T - V(x_0)` it is outcome's advantage split over the steps that
    made it; 0 on the other steps. The bound of any step-level scheme, for the benchmarks only:
    `V` from `M` continuations of every state costs `M` times a trajectory's remaining NFEs.

    `values [B, T+1]` (`TrueValues.value`, or exact values), `trained [T]` bool (None: every
    step). Returns `[B, T]` in the dtype of `values`."""
    from .credit import STD_EPS

    if values.dim() != 2 or values.shape[1] < 2:
        raise ValueError(f"values must be [B, T+1]; got {tuple(values.shape)}")
    final = values[:, -1]
    scale = (final - final[0]).std(correction=0) + STD_EPS  # shifted: a constant batch gives exactly 0
    adv = true_advantages(values) / scale
    if trained is not None:
        adv = torch.where(trained.to(torch.bool)[None, :], adv, torch.zeros_like(adv))
    return adv


def shifted_window(window: tuple[int, int], k: int, num_steps: int) -> tuple[int, int] | None:
    """The SDE window `(start, size)` of a grid that starts at step `k` (None: no stochastic step left)."""
    start, size = check_window(window, num_steps)
    lo, hi = max(start, k), start + size
    return (lo - k, hi - lo) if hi > lo else None


@torch.no_grad()
def continue_states(
    velocity: Velocity,
    states: torch.Tensor,
    sigmas: torch.Tensor,
    k: int,
    cond: Any,
    kernel: str,
    noise: float | torch.Tensor,
    window: tuple[int, int],
    generator: torch.Generator | None = None,
    sde_steps: Sequence[int] | None = None,
) -> torch.Tensor:
    """Sample the rest of the trajectory from state `x_k` with the policy's kernel inside its SDE
    window (ODE outside), as the rollout did: `states [n, C, H, W]` (the rows to continue, repeated
    once per continuation by the caller) -> final states `x_T [n, C, H, W]`. `sigmas [T+1]`.
    `sde_steps`: the kernel at these steps alone instead of a window (a tree's split steps), the
    ODE between them."""
    num_steps = sigmas.shape[0] - 1
    if not 0 <= k <= num_steps:
        raise ValueError(f"k must lie in [0, T = {num_steps}]; got {k}")
    if k == num_steps:
        return states.clone()
    if sde_steps is not None:  # segment by segment: the ODE up to each step, the kernel at it
        per_step = KERNELS.facts(kernel)["per_step"]
        x, at = states, k
        for s in sorted(j for j in sde_steps if j >= k):
            table = noise[at : s + 1] if per_step else noise
            x = rollout(velocity, x, sigmas[at : s + 2], cond, kernel=kernel, noise=table,
                        window=(s - at, 1), generator=generator).states[:, -1]  # fmt: skip
            at = s + 1
        return rollout(velocity, x, sigmas[at:], cond, kernel="ode").states[:, -1] if at < num_steps else x
    rest = shifted_window(window, k, num_steps)
    table = noise[k:] if KERNELS.facts(kernel)["per_step"] else noise
    out = rollout(
        velocity,
        states,
        sigmas[k:],
        cond,
        kernel=kernel if rest is not None else "ode",
        noise=table,
        window=rest,
        generator=generator,
    )
    return out.states[:, -1]


def _centered(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """`x [B, ...]` minus its group's mean (GRPO compares within a group)."""
    size = groups.sizes.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
    return x - (groups.sum(x) / size)[groups.index]


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")


def reliability(half_corr: float) -> float:
    """Spearman-Brown: the reliability of the mean of two halves whose correlation is `half_corr`
    (NaN when the halves do not agree at all: no correction is possible)."""
    if not half_corr > 0:
        return float("nan")
    return 2.0 * half_corr / (1.0 + half_corr)


def step_table(
    rewards: torch.Tensor,
    values: TrueValues,
    advantages: Mapping[str, torch.Tensor],
    group_ids: torch.Tensor,
    steps: Sequence[int],
) -> list[dict[str, Any]]:
    """Per trained step `k`, within groups (every quantity minus its group's mean first):

    - `share`: step k's share of the true step-credit variance, `Var(A*_k) / sum_j Var(A*_j)`
      over the trained steps, each variance the covariance of the two halves (unbiased by the
      Monte-Carlo noise);
    - `reliability`: of `A*_k` (Spearman-Brown from its halves' correlation);
    - `corr/<scheme>`: `corr(A_scheme_k, A*_k) / sqrt(reliability)`;
    - `r_corr`: `corr(R_k, V(x_k))`, corrected by the reliability of `V(x_k)`; `r_var_ratio`:
      `Var(R_k) / Var(V(x_k))` (how much noisier one ODE completion is than the value).

    `rewards [B, T+1]` (`R_k`), `advantages`: scheme name -> `[B, T]`.
    """
    groups = Groups(group_ids)
    a_star = _centered(true_advantages(values.value), groups)
    a_half = [_centered(true_advantages(h), groups) for h in values.halves]
    v_half = [_centered(h, groups) for h in values.halves]
    v_full = _centered(values.value, groups)
    r_c = _centered(rewards.double(), groups)
    true_var = {k: float((a_half[0][:, k] * a_half[1][:, k]).mean()) for k in steps}
    total = sum(max(v, 0.0) for v in true_var.values())
    rows = []
    for k in steps:
        rel = reliability(_corr(a_half[0][:, k], a_half[1][:, k]))
        row: dict[str, Any] = {
            "step": k,
            "share": max(true_var[k], 0.0) / total if total > 0 else float("nan"),
            "reliability": rel,
        }
        for name, adv in advantages.items():
            row[f"corr/{name}"] = _corr(_centered(adv.double(), groups)[:, k], a_star[:, k]) / rel**0.5
        v_rel = reliability(_corr(v_half[0][:, k], v_half[1][:, k]))
        v_var = float((v_half[0][:, k] * v_half[1][:, k]).mean())
        row["r_corr"] = _corr(r_c[:, k], v_full[:, k]) / v_rel**0.5
        row["r_var_ratio"] = float(r_c[:, k].square().mean()) / v_var if v_var > 0 else float("nan")
        rows.append(row)
    return rows


class GradientSums:
    """Per-group gradient sums `G_g(A) = sum_{b in g, k in steps} A_{b,k} s_{b,k}` for several
    credit tables at once, from one score per row (`add`): `[n, P]` per table name.

    `tables`: name -> `[B, T]` coefficients (an advantage table, possibly times step weights);
    `group_ids [B]`; `dim`: `P`, the length of a flattened score."""

    def __init__(self, tables: Mapping[str, torch.Tensor], group_ids: torch.Tensor, dim: int) -> None:
        self.tables = {name: t.double() for name, t in tables.items()}
        self.groups = Groups(group_ids)
        self.sums = {name: torch.zeros(self.groups.count, dim, dtype=torch.float64) for name in tables}
        self.rows = 0

    def add(self, b: int, k: int, score: torch.Tensor) -> None:
        """Add row `(b, k)`'s score `[P]` to its group's sum of every table."""
        g = int(self.groups.index[b])
        s = score.detach().double().reshape(-1).cpu()
        for name, table in self.tables.items():
            c = float(table[b, k])
            if c != 0.0:
                self.sums[name][g].add_(s, alpha=c)
        self.rows += 1


class GradientCheck(NamedTuple):
    reliability: float  # of G(A*), Spearman-Brown from its halves' cosine
    half_cosine: float  # cos(G(A*_half1), G(A*_half2))
    rows: list[dict[str, Any]]  # per scheme: cosine, raw, interval, paired difference to the baseline


def gradient_check(
    sums: Mapping[str, torch.Tensor],
    schemes: Sequence[str],
    truth: tuple[str, str, str] = ("true", "true_a", "true_b"),
    baseline: str | None = "outcome",
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> GradientCheck:
    """Each scheme's corrected cosine with the true-advantage gradient, with bootstrap intervals.

    `sums`: name -> per-group sums `[n, P]` (`GradientSums.sums`); `truth`: the names of `A*`'s
    table and of its two halves'. Per scheme: `cosine = cos(G_s, G*) / sqrt(rel)` (`rel` from the
    halves, recomputed in every bootstrap draw), `raw` (uncorrected), `low` / `high` (percentile
    interval over `draws` resamplings of the `n` groups), and against `baseline`: `diff` with its
    interval (paired: the same resamplings). A correction that is undefined (the halves do not
    agree: Monte-Carlo noise dominates) gives NaN; corrected cosines are clipped to [-1, 1].
    """
    names = [*truth, *[s for s in schemes if s not in truth]]
    missing = [n for n in names if n not in sums]
    if missing:
        raise ValueError(f"gradient sums missing for {missing}")
    X = torch.stack([sums[n] for n in names])  # [N, n, P]
    N, n, P = X.shape
    flat = X.reshape(N * n, P)
    gram = (flat @ flat.T).reshape(N, n, N, n)  # dot products of every pair of group sums
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n, (draws, n), generator=gen)
    weights = torch.zeros(draws + 1, n, dtype=torch.float64)
    weights[0] = 1.0  # the sample itself
    weights[1:].scatter_add_(1, picks, torch.ones(draws, n, dtype=torch.float64))
    dots = torch.einsum("di,aibj,dj->dab", weights, gram, weights)  # [D, N, N]
    norms = dots.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()  # [D, N]

    def cos(i: int, j: int) -> torch.Tensor:
        d = norms[:, i] * norms[:, j]
        return torch.where(d > 0, dots[:, i, j] / d, torch.full_like(d, float("nan")))

    half = cos(1, 2)
    rel = torch.where(half > 0, 2 * half / (1 + half), torch.full_like(half, float("nan")))
    # a corrected cosine beyond +-1 is the correction's own noise (a resampling whose halves agree
    # little): clipped, as corrected correlations are
    corrected = {s: (cos(0, names.index(s)) / rel.sqrt()).clamp(-1.0, 1.0) for s in schemes}
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)

    def interval(x: torch.Tensor) -> tuple[float, float]:
        boot = x[1:][torch.isfinite(x[1:])]
        if len(boot) < draws // 2:
            return float("nan"), float("nan")
        lo, hi = torch.quantile(boot, q).tolist()
        return lo, hi

    rows = []
    for s in schemes:
        c = corrected[s]
        lo, hi = interval(c)
        raw = float(cos(0, names.index(s))[0])
        row: dict[str, Any] = {"scheme": s, "cosine": float(c[0]), "low": lo, "high": hi, "raw": raw}
        if baseline is not None and baseline in corrected and s != baseline:
            d = c - corrected[baseline]
            row["diff"], (row["diff_low"], row["diff_high"]) = float(d[0]), interval(d)
        rows.append(row)
    return GradientCheck(float(rel[0]), float(half[0]), rows)
