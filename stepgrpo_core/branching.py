"""Branched rollouts: the members of a group share everything up to one step and branch there.

TempFlow-GRPO (arXiv 2508.04324, its trajectory branching): every trajectory of a group
starts from the group's initial noise and follows the deterministic ODE to the group's branch step
`b`; there each member takes its own SDE step (the kernel's, with its own noise), and every later
step is the ODE again. The members' rewards then differ only through that one step's noise, so the
group-normalized reward is that step's advantage (the sibling advantage), with no value estimate in
between; and only step `b` of each trajectory has a density to train.

The shared prefix is computed once a group: one row through steps `0 .. b-1` and the velocity at
`x_b` (the members' steps differ in their noise alone), then `G` rows a step after it. Its
transformer rows are counted once (`Rollout.nfe`), so a branched group costs `b + 1 + G (T - b - 1)`
rows where `G` independent trajectories cost `G T`.

`anchor_rollout` (G2RPO, Step-GRPO) branches a group's members off one ODE anchor at several
steps, `children` members a step: the members that branch at one step are siblings.

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
    states, velocities, log_probs, stds = _blank(x0, P * G, T)
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
        v_b = velocity(x_b, s[b].repeat(len(x_b)), take(cond, groups * G))  # the branch step's, once a group
        tail = noise[b:] if per_step else noise
        branched = rollout(
            _reusing(velocity, v_b.repeat_interleave(G, dim=0)),
            x_b.repeat_interleave(G, dim=0),
            s[b:],
            take(cond, rows),
            kernel=kernel,
            noise=tail,
            window=(0, 1),
            generator=generator,
        )
        _place((states, velocities, log_probs, stds), rows, b, branched)
        nfe += len(x_b) + branched.nfe - len(rows)  # the members' first row was the group's
    return Rollout(states, log_probs, stds, nfe, velocities)


def _reusing(velocity: Velocity, shared: torch.Tensor) -> Velocity:
    """`velocity`, its first call answered with `shared`: the velocity at the state the rows branch
    from, computed once for all of them (a branch step's rows differ in their noise alone)."""
    pending = [shared]

    def call(x: torch.Tensor, sigma: torch.Tensor, c: Any) -> torch.Tensor:
        return pending.pop() if pending else velocity(x, sigma, c)

    return call


@torch.no_grad()
def anchor_rollout(
    velocity: Velocity,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    steps: list[int],
    children: int,
    kernel: str = "flow",
    noise: float | torch.Tensor = 0.7,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample `P` groups as branches off one ODE anchor (G2RPO's singular stochastic sampling, arXiv
    2510.01982; Step-GRPO's k candidates a step, arXiv 2605.25661): each group's anchor follows the
    ODE from its initial noise, computed once; at each step `b_l` of `steps` (increasing) `children`
    members take step `b_l` from the anchor's state `x_{b_l}` with the kernel, each with its own
    noise, and the ODE after it. Member `l children + j` of a group is child `j` of step `b_l`, so a
    group holds `G = len(steps) children` trajectories, the members that share a branch step
    adjacent.

    The anchor is computed once a group, through the velocity at its last branch state: a child's
    stochastic step is the anchor's velocity plus its noise (no row of its own), so a group costs
    `b_L + 1 + children sum_l (T - b_l - 1)` rows (`Rollout.nfe`). Only each member's branch step has
    a density. `cond`: leading dim `B = P G` (a group's members share a prompt: the anchor reads its
    first member's).
    """
    KERNELS.validate(kernel)
    if KERNELS.facts(kernel)["deterministic"]:
        raise ValueError(f"kernel {kernel!r} is deterministic: an anchor's branch steps need a stochastic kernel")
    s = check_sigmas(sigmas).to(x0.device)
    T, P, k = s.shape[0] - 1, x0.shape[0], int(children)
    steps = [int(b) for b in steps]
    if x0.dim() != 4:
        raise ValueError(f"x0 must be [P, C, H, W] (one initial noise a group); got {tuple(x0.shape)}")
    if not steps or steps != sorted(set(steps)) or steps[0] < 0 or steps[-1] >= T or k < 1:
        raise ValueError(f"anchor steps {steps}: increasing within [0, {T}), and children >= 1 (got {k})")
    G = len(steps) * k
    per_step = bool(KERNELS.facts(kernel)["per_step"])
    states, velocities, log_probs, stds = _blank(x0, P * G, T)
    raw: list[torch.Tensor] = []  # the anchor's velocities as the model gave them (a child's step reads them)

    def recorded(x: torch.Tensor, sigma: torch.Tensor, c: Any) -> torch.Tensor:
        raw.append(velocity(x, sigma, c))
        return raw[-1]

    last = steps[-1]
    anchor = rollout(recorded, x0, s[: last + 2], take(cond, torch.arange(P) * G), kernel="ode")
    nfe = anchor.nfe  # rows 0 .. b_L: the anchor to its last branch state, and the velocity there
    for i, b in enumerate(steps):
        rows = (torch.arange(P)[:, None] * G + i * k + torch.arange(k)).reshape(-1)
        states[rows, : b + 1] = anchor.states[:, : b + 1].repeat_interleave(k, dim=0)
        velocities[rows, :b] = anchor.velocities[:, :b].repeat_interleave(k, dim=0)
        branched = rollout(
            _reusing(velocity, raw[b].repeat_interleave(k, dim=0)),  # the branch step's velocity: the anchor's
            anchor.states[:, b].repeat_interleave(k, dim=0),
            s[b:],
            take(cond, rows),
            kernel=kernel,
            noise=noise[b:] if per_step else noise,
            window=(0, 1),
            generator=generator,
        )
        _place((states, velocities, log_probs, stds), rows, b, branched)
        nfe += branched.nfe - len(rows)  # its first row was the anchor's
    return Rollout(states, log_probs, stds, nfe, velocities)


def _place(out: tuple[torch.Tensor, ...], rows: torch.Tensor, b: int, branched: Rollout) -> None:
    """Write `branched`, the members' rollout from their branch step `b` on, into the outputs
    `(states, velocities, log_probs, stds)` of `_blank` at `rows`."""
    states, velocities, log_probs, stds = out
    states[rows, b:] = branched.states
    velocities[rows, b:] = branched.velocities
    log_probs[rows, b:] = branched.log_probs
    stds[rows, b:] = branched.stds


def _blank(x0: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, ...]:
    """A branched rollout's outputs before they are filled: states `[B, T+1, ...]` and velocities
    `[B, T, ...]` (dtype of `x0`), log-probs NaN and stds 0 `[B, T]` (no density until a branch step)."""
    shape = x0.shape[1:]
    return (
        torch.empty((B, T + 1, *shape), dtype=x0.dtype, device=x0.device),
        torch.empty((B, T, *shape), dtype=x0.dtype, device=x0.device),
        torch.full((B, T), float("nan"), device=x0.device),
        torch.zeros(B, T, device=x0.device),
    )


def branch_steps_of(log_probs: torch.Tensor) -> torch.Tensor:
    """`[B]` long: each trajectory's branch step, the one step of a branched rollout with a density
    (`log_probs [B, T]`, NaN where a step has none). A trajectory with no such step, or several, is
    refused."""
    finite = torch.isfinite(log_probs)
    if not bool((finite.sum(dim=1) == 1).all()):
        raise ValueError("a branched rollout's trajectories must each have one step with a density (its branch step)")
    return finite.float().argmax(dim=1)


def draw_branch_steps(window: tuple[int, int], groups: int, generator: torch.Generator) -> torch.Tensor:
    """`[groups]` long: each group's branch step, uniform on `[lo, hi)` (`window`), from `generator`
    (Flow-Factory's examples draw one of steps 1-3; TempFlow-GRPO branches at every step in turn)."""
    lo, hi = window
    if not 0 <= lo < hi:
        raise ValueError(f"branch window [{lo}, {hi}) is empty")
    return torch.randint(lo, hi, (groups,), generator=generator)


@torch.no_grad()
def tree_rollout(
    velocity: Velocity,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Any,
    tree: list[tuple[int, int]],
    kernel: str = "flow",
    noise: float | torch.Tensor = 0.7,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample `P` groups as trees (BranchGRPO, arXiv 2509.06040): each group's root follows the ODE
    from its initial noise; at each `(b_d, f_d)` of `tree` (steps increasing) every node splits into
    `f_d` children that take step `b_d` with the kernel, each with its own noise, and the ODE on to
    the next listed step (the last to `x_T`). A factor of 1 is a stochastic step without a split
    (`SamplerConfig.tree`: `sampler.tree_sde`). The leaves are the group's `G = prod f_d`
    trajectories, in tree order (leaf `l`'s ancestor after step `b_d` is `l // (G / (f_1 ... f_d))`
    within its group).

    Every node's velocity is computed once (`Rollout.nfe`; a split's children share their parent's,
    as BranchGRPO's sampler splits one prediction's step), and every transition has its density stored
    once, at the first leaf under the child it made (its other leaves carry NaN there), so an update
    trains each transition once. `cond`: leading dim `B = P G` (a group's members share a prompt).
    """
    KERNELS.validate(kernel)
    if KERNELS.facts(kernel)["deterministic"]:
        raise ValueError(f"kernel {kernel!r} is deterministic: a tree's branch steps need a stochastic kernel")
    s = check_sigmas(sigmas).to(x0.device)
    T, P = s.shape[0] - 1, x0.shape[0]
    steps = [int(b) for b, _ in tree]
    factors = [int(f) for _, f in tree]
    if not tree or any(f < 1 for f in factors) or steps != sorted(set(steps)) or not 0 <= steps[0] <= steps[-1] < T:
        raise ValueError(f"tree {tree}: (step, factor) pairs with steps increasing in [0, {T}) and factors >= 1")
    G = 1
    for f in factors:
        G *= f
    per_step = bool(KERNELS.facts(kernel)["per_step"])
    states, velocities, log_probs, stds = _blank(x0, P * G, T)
    leaves = G  # leaves under each current node
    nodes = torch.arange(P) * G  # the first leaf of each current node
    x, k, nfe = x0, 0, 0
    states[:, 0] = x0.repeat_interleave(G, dim=0)

    def fill(seg: Rollout, start: int, under: int) -> None:
        """The states after `start` of a segment run on the current nodes, onto their leaves."""
        n = seg.states.shape[1] - 1
        states[:, start + 1 : start + n + 1] = seg.states[:, 1:].repeat_interleave(under, dim=0)
        velocities[:, start : start + n] = seg.velocities.repeat_interleave(under, dim=0)

    for b, f in zip(steps, factors):
        if b > k:  # the ODE from step k to the branch step, each node once
            seg = rollout(velocity, x, s[k : b + 1], take(cond, nodes), kernel="ode")
            fill(seg, k, leaves)
            x, nfe = seg.states[:, -1], nfe + seg.nfe
        v_b = velocity(x, s[b].repeat(len(x)), take(cond, nodes))  # each node's once, shared by its children
        leaves //= f
        nodes = (nodes[:, None] + torch.arange(f) * leaves).reshape(-1)
        tail = noise[b : b + 1] if per_step else noise
        seg = rollout(
            _reusing(velocity, v_b.repeat_interleave(f, dim=0)), x.repeat_interleave(f, dim=0), s[b : b + 2],
            take(cond, nodes), kernel=kernel, noise=tail, generator=generator,
        )  # fmt: skip
        fill(seg, b, leaves)
        log_probs[nodes, b], stds[nodes, b] = seg.log_probs[:, 0], seg.stds[:, 0]
        x, k, nfe = seg.states[:, -1], b + 1, nfe + len(v_b)
    if k < T:
        seg = rollout(velocity, x, s[k:], take(cond, nodes), kernel="ode")
        fill(seg, k, leaves)
        nfe += seg.nfe
    return Rollout(states, log_probs, stds, nfe, velocities)


def width_pruned(
    has: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    tree: list[tuple[int, int]],
    mode: str,
    keep: float,
) -> torch.Tensor:
    """A tree's width pruning (BranchGRPO, arXiv 2509.06040; its code's `width_pruning_mode` and
    `width_pruning_ratio`): which of the transitions `has [B, T]` (bool: a density the update would
    train) stay, those at or before the tree's last split all, and of those after it, per group:

    - `per_branch` (mode 1): each leaf's `n` transitions after the last split (the branch the last
      split made, one leaf) keep their best `max(1, int(n keep))` by advantage;
    - `extremes` (mode 2): the group's `N` keep the best `c // 2` and the worst `c - c // 2`,
      `c = min(N, max(2, int(N keep)))`.

    The ranking keeps tree order within a tie (leaf, then step: the authors' stable sort of a
    depth-first walk). `advantages [B, T]`; `group_ids [B]`, a group's rows its leaves in tree order; `tree`:
    the stochastic steps `[(step, factor), ...]` (`SamplerConfig.tree`). The authors pool mode 2
    over one device's batch; here each tree is pooled alone, so the choice does not depend on how
    a batch is cut. The rollout, the rewards and the advantages are unchanged: only fewer
    transitions go through the backward pass."""
    if mode not in ("per_branch", "extremes") or not 0 < keep <= 1:
        raise ValueError(f"width pruning {mode!r} keeping {keep}: per_branch or extremes, keeping a share in (0, 1]")
    last = max((int(b) for b, f in tree if int(f) > 1), default=-1)
    out = has.clone()
    tail = out[:, last + 1 :]  # a view: pruning writes through
    adv = advantages[:, last + 1 :].tolist()

    def ranked(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return sorted(pairs, key=lambda p: -adv[p[0]][p[1]])  # stable: tree order within a tie

    for g in torch.unique(group_ids).tolist():
        rows = torch.nonzero(group_ids == g).reshape(-1).tolist()
        leaf = {r: [(r, k) for k in torch.nonzero(tail[r]).reshape(-1).tolist()] for r in rows}
        pairs = [p for r in rows for p in leaf[r]]
        if mode == "per_branch":
            kept = {p for r in rows for p in ranked(leaf[r])[: max(1, int(len(leaf[r]) * keep))]}
        else:
            order, c = ranked(pairs), min(len(pairs), max(2, int(len(pairs) * keep)))
            kept = set(order[: c // 2]) | set(order[len(order) - (c - c // 2) :])
        for r, k in pairs:
            if (r, k) not in kept:
                tail[r, k] = False
    return out
