"""Branched rollouts: the members of a group share everything up to one step and branch there.

TempFlow-GRPO (arXiv 2508.04324, its trajectory branching): every trajectory of a group
starts from the group's initial noise and follows the deterministic ODE to the group's branch step
`b`; there each member takes its own SDE step (the kernel's, with its own noise), and every later
step is the ODE again. The members' rewards then differ only through that one step's noise, so the
group-normalized reward is that step's advantage (the sibling advantage), with no value estimate in
between; and only step `b` of each trajectory has a density to train.

The shared prefix is computed once a group: one row through steps `0 .. b-1`, then `G` copies of
`x_b`. Its transformer rows are counted once (`Rollout.nfe`), so a branched group costs `b + G (T
- b)` rows where `G` independent trajectories cost `G T`.

Shapes: `P` groups of `G` members, `B = P G` trajectories (group after group), `T` steps, latent
`C, H, W`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .conditioning import take
from .kernels import KERNELS
from .rollout import Rollout, Velocity, check_sigmas, rollout


@torch.no_grad()
def branched_rollout(
    velocity: Velocity,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    group_size: int,
    branch: torch.Tensor,
    kernel: str = "flow",
    noise: float | torch.Tensor = 0.7,
    generator: torch.Generator | None = None,
    ode_step: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Rollout:
    """Sample `P` groups of `group_size` trajectories that share their prefix and branch at one step.

    Args:
        velocity: `velocity(x [n,C,H,W], sigma [n], cond) -> v`, as `rollout`'s.
        x0: `[P, C, H, W]` each group's initial noise.
        sigmas: `[T+1]` grid.
        cond: conditioning pytree with leading dim `B = P G` (a group's members share a prompt: the
            prefix reads its first member's).
        group_size: `G`.
        branch: `[P]` long, each group's branch step `b` in `[0, T)`.
        kernel, noise: the stochastic step's kernel and its noise (a per-step table is indexed on the
            whole grid).
        generator: the branch steps' noise; groups that branch at the same step draw together, in
            order of the step.
        ode_step: not taken: a multistep ODE solver's history would cross the branch (refused).

    Returns `Rollout` over the `B` trajectories: states `[B, T+1, ...]` (the prefix repeated per
    member), log-probs NaN but at each trajectory's branch step, and `nfe` the rows evaluated, the
    prefix once a group.
    """
    if ode_step is not None:
        raise ValueError(
            "a branched rollout takes Euler ODE steps: a multistep solver's history would cross the branch "
            "(set sampler.ode_solver: euler)"
        )
    KERNELS.validate(kernel)
    if KERNELS.facts(kernel)["deterministic"]:
        raise ValueError(f"kernel {kernel!r} is deterministic: the branch step needs a stochastic kernel (e.g. flow)")
    s = check_sigmas(sigmas).to(x0.device)
    T, P, G = s.shape[0] - 1, x0.shape[0], int(group_size)
    if x0.dim() != 4:
        raise ValueError(f"x0 must be [P, C, H, W] (one initial noise a group); got {tuple(x0.shape)}")
    branch = torch.as_tensor(branch, dtype=torch.long).reshape(-1).cpu()
    if branch.shape != (P,) or G < 1:
        raise ValueError(f"branch must hold one step per group ([{P}]) and group_size >= 1; got {tuple(branch.shape)}")
    if bool((branch < 0).any()) or bool((branch >= T).any()):
        raise ValueError(f"branch steps {branch.tolist()} must lie in [0, T) = [0, {T})")
    per_step = bool(KERNELS.facts(kernel)["per_step"])
    B = P * G
    states = torch.empty((B, T + 1, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
    velocities = torch.empty((B, T, *x0.shape[1:]), dtype=x0.dtype, device=x0.device)
    log_probs = torch.full((B, T), float("nan"), device=x0.device)
    stds = torch.zeros(B, T, device=x0.device)
    nfe = 0
    for b in sorted(set(branch.tolist())):
        groups = torch.nonzero(branch == b).reshape(-1)
        rows = (groups[:, None] * G + torch.arange(G)).reshape(-1)
        x_b = x0[groups]
        if b > 0:  # the shared prefix, one row a group
            prefix = rollout(velocity, x_b, s[: b + 1], take(cond, groups * G), kernel="ode")
            states[rows, : b + 1] = prefix.states.repeat_interleave(G, dim=0)
            velocities[rows, :b] = prefix.velocities.repeat_interleave(G, dim=0)
            x_b, nfe = prefix.states[:, -1], nfe + prefix.nfe
        tail = noise[b:] if per_step else noise
        branched = rollout(
            velocity,
            x_b.repeat_interleave(G, dim=0),
            s[b:],
            take(cond, rows),
            kernel=kernel,
            noise=tail,
            window=(0, 1),
            generator=generator,
        )
        states[rows, b:] = branched.states
        velocities[rows, b:] = branched.velocities
        log_probs[rows, b:] = branched.log_probs
        stds[rows, b:] = branched.stds
        nfe += branched.nfe
    return Rollout(states, log_probs, stds, nfe, velocities)


def draw_branch_steps(window: tuple[int, int], groups: int, generator: torch.Generator) -> torch.Tensor:
    """`[groups]` long: each group's branch step, uniform on `[lo, hi)` (`window`), from `generator`
    (Flow-Factory's examples draw one of steps 1-3; TempFlow-GRPO branches at every step in turn)."""
    lo, hi = window
    if not 0 <= lo < hi:
        raise ValueError(f"branch window [{lo}, {hi}) is empty")
    return torch.randint(lo, hi, (groups,), generator=generator)
