"""Credit schemes: step rewards `R [B, T+1]` in, per-step advantages `A [B, T]` out.

METHODS.md, "Credit schemes". `R[:, k] = R_k` is the reward of the completion of state `x_k`
(`R_T` the reward of the sample itself); gains `g_k = R_{k+1} - R_k` telescope to `R_T - R_0`.
Groups are explicit: `group_ids [B]` int64 (any values; rows of a group need not be adjacent).

Schemes (registry `SCHEMES`, one function each, same signature `(rewards, gains, groups, **options)`):

- `outcome` (Flow-GRPO): `A_k = (R_T - mean_group(R_T)) / (std + STD_EPS)` for every `k`; `std`
  over the whole batch (`global_std=True`, default) or per group.
- `stepwise` (Stepwise-Flow-GRPO, arXiv 2603.28718, "gain-based advantages"): gains normalized
  jointly over the `B x T'` entries of the `T'` trained steps (not per step).
- `dense` (DenseGRPO): gains normalized per step `k` within each group.
- `turning_point` (TP-GRPO, arXiv 2602.06422): turning points get the aggregated reward
  `R_T - R_k` (balanced over sampling mini-batches), then as `dense`.

Context: a scheme may declare the keyword `trained=None`; `assign` then passes the `[T]` bool mask
of the steps the update trains (the SDE window without the final step, `Config.trained_steps`).
It is not an option: the config never sets it.

Every std is the population std (ddof 0, as NumPy and Flow-GRPO) plus `STD_EPS`, so a group with
no variance gets advantage exactly 0. Groups whose advantages are all 0 carry no signal and are
dropped (Flow-GRPO): `keep` marks the rows of the other groups; the dropped ones are counted.

Shapes: `B` trajectories, `T` steps.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .registry import PluginError, Registry, takes_positional

STD_EPS = 1e-4  # added to every std of a normalization (Flow-GRPO's 1e-4)
# Keywords `assign` supplies from the run, not from `credit.options`: `trained [T]` bool, the steps
# the update trains (a scheme that declares it reads it; its stored advantages name the steps);
# `tree`, the rollout's branching `[(step, factor), ...]` (`sampler.branch_tree`; None unbranched);
# `branch [B]` long, each trajectory's branch step, its one stochastic step (`sampler.branch_anchor`
# or `branch_window`; None for any other rollout).
CONTEXT = ("trained", "tree", "branch")
# TP-GRPO's sampling mini-batch: the authors' SD3 launch config samples 9 images a GPU batch, and
# their code balances the turning points within each such batch (METHODS.md, scheme 4).
TP_SAMPLE_BATCH = 9


@dataclass(frozen=True)
class Credit:
    advantages: torch.Tensor  # [B, T] fp32; 0 for the rows of dropped groups
    gains: torch.Tensor  # [B, T] fp32, g_k = R_{k+1} - R_k
    turning_mask: torch.Tensor  # [B, T] bool, the turning points kept (all False but turning_point)
    keep: torch.Tensor  # [B] bool, False for rows of groups whose advantages are all zero
    zero_std_groups: int  # number of dropped groups
    zero_std_ratio: float  # dropped groups / groups


class Groups:
    """Group bookkeeping for per-group statistics: `group_ids [B]` -> dense ids `0..n-1`."""

    def __init__(self, group_ids: torch.Tensor) -> None:
        _, self.index = torch.unique(group_ids, return_inverse=True)  # [B] in 0..n-1
        self.count = int(self.index.max()) + 1
        self.sizes = torch.bincount(self.index, minlength=self.count).float()  # [n]
        # first row of each group [n]: a per-group reference value (see `normalize`)
        rows = torch.arange(group_ids.shape[0], device=group_ids.device)
        start = torch.full((self.count,), group_ids.shape[0], dtype=torch.long, device=group_ids.device)
        self.first = start.scatter_reduce(0, self.index, rows, reduce="amin")

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group sums of rows: `[B, ...]` -> `[n, ...]`."""
        return torch.zeros(self.count, *x.shape[1:], dtype=x.dtype, device=x.device).index_add_(0, self.index, x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """`(x - mean_group) / (std_group + STD_EPS)` per column of `x [B, ...]`.

        The values are shifted by the group's first row before the mean: the result is the same
        in exact arithmetic, but a constant group then centers to exactly 0 (the mean of equal
        floats need not equal them), so it is recognized as zero-variance and dropped.
        """
        centered, std = self._moments(x)
        return centered / (std[self.index] + STD_EPS)

    def std(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group population std of the rows: `[B, ...]` -> `[n, ...]` (0 for a constant group)."""
        return self._moments(x)[1]

    def _moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shifted = x - x[self.first][self.index]
        size = self.sizes.reshape(-1, *([1] * (x.dim() - 1)))
        mean = self.sum(shifted) / size
        centered = shifted - mean[self.index]
        return centered, torch.sqrt(self.sum(centered**2) / size)


Scheme = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (rewards, gains, groups, **opts) -> (A, turning mask)
# Fact `step_rewards`: the scheme reads a reward for every state (needs a completion method);
# False: it reads only R_T, the final sample's. Fact `version`: bumped when a scheme computes other
# advantages from the same rewards and options (stored advantages name it: `stepgrpo.tasks.credit`).
# Plug-ins (`stepgrpo.plugins.scheme`): `module:attr` references and the `stepgrpo.schemes` entry points.


def check_scheme(name: str, fn: Scheme) -> None:
    """A scheme takes `(rewards, gains, groups)` positionally, then only options with defaults."""
    if not callable(fn):
        raise PluginError(f"credit scheme {name!r}: {fn!r} is not callable")
    takes_positional(name, "credit scheme", fn, 3, "fn(rewards, gains, groups, **options)")
    params = [p for p in list(inspect.signature(fn).parameters.values())[3:] if p.name not in CONTEXT]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    bare = [p.name for p in params if p.default is inspect.Parameter.empty or p.kind in variadic]
    if bare:
        raise PluginError(
            f"credit scheme {name!r}: parameter(s) {bare} are not options; after (rewards, gains, groups) a "
            "scheme takes only named keyword arguments with defaults (credit.options overrides them)"
        )


SCHEMES: Registry[Scheme] = Registry(
    "credit scheme",
    entry_points="stepgrpo.schemes",
    check=check_scheme,
    required=("version",),
    options=lambda name: scheme_options(name),
    step_rewards=True,
    version="1",
)


def _no_turning(gains: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(gains, dtype=torch.bool)


@SCHEMES.register("outcome", step_rewards=False, paper="arXiv 2402.03300, eq. 3 (GRPO's A_i, as Flow-GRPO uses it)")
def outcome(rewards, gains, groups: Groups, global_std: bool = True):
    """Flow-GRPO: the sample's group-relative reward for every step (arXiv 2505.05470, its GRPO
    advantage, the group-normalized reward of GRPO, arXiv 2402.03300 eq. 3's `A_i`)."""
    final = rewards[:, -1:]  # [B, 1]
    if global_std:
        shifted = final - final[0]  # exact zero for a constant group (see Groups.normalize)
        centered = shifted - (groups.sum(shifted) / groups.sizes[:, None])[groups.index]
        adv = centered / (shifted.std(correction=0) + STD_EPS)
    else:
        adv = groups.normalize(final)
    return adv.expand_as(gains).clone(), _no_turning(gains)


@SCHEMES.register("tree", step_rewards=False, paper='arXiv 2509.06040, "tree-based advantage estimator"')
def tree(rewards, gains, groups: Groups, tree: list[tuple[int, int]] | None = None):
    """BranchGRPO: the rollout is a tree a group (`sampler.branch_tree`, leaves in tree order); each
    node's value is the mean reward of the leaves under it, and at each stochastic step `b_d` of
    `tree` (a split, or with factor 1 a node's one child: `SamplerConfig.tree`) the value of the
    child a trajectory went through, normalized over the group's nodes at that depth, is the
    advantage of that step (0 at a step before the first split, whose depth holds one node, and at
    every step off the list, which has no density). The leaf rewards are fused with equal weights:
    the paper's path-probability weights need the transitions' densities, which the credit stage
    does not read (its code's default, `tree_prob_weighted` off, is the equal weights)."""
    if not tree:
        raise ValueError("credit.scheme tree reads the rollout's tree: set sampler.branch_tree")
    final = rewards[:, -1]
    B, G = final.shape[0], 1
    for _, f in tree:
        G *= int(f)
    if bool((groups.sizes != G).any()):
        raise ValueError(f"credit.scheme tree: every group must hold the tree's {G} leaves")
    order = torch.argsort(groups.index * B + torch.arange(B, device=final.device))  # rows group by group
    leaves = final[order].reshape(groups.count, G)  # [n, G], tree order within each group
    adv = torch.zeros_like(gains)
    under = G
    for b, f in tree:
        under //= int(f)
        value = leaves.reshape(groups.count, G // under, under).mean(dim=2)  # [n, nodes at this depth]
        shifted = value - value[:, :1]  # exact zero for a group whose nodes are equal (see Groups.normalize)
        z = (shifted - shifted.mean(dim=1, keepdim=True)) / (shifted.std(dim=1, correction=0, keepdim=True) + STD_EPS)
        adv[order, int(b)] = z.repeat_interleave(under, dim=1).reshape(-1)
    return adv, _no_turning(gains)


def _siblings(groups: Groups, branch: torch.Tensor | None, scheme: str) -> Groups:
    """The members of a group that branched at the same step: the siblings a branched scheme compares."""
    if branch is None:
        raise ValueError(
            f"credit.scheme {scheme} compares siblings that share a branch step: set sampler.branch_anchor or "
            "sampler.branch_window"
        )
    return Groups(groups.index * (int(branch.max()) + 1) + branch.to(groups.index.device))


@SCHEMES.register("granular", paper='arXiv 2510.01982, "multi-granularity advantage integration"')
def granular(rewards, gains, groups: Groups, branch: torch.Tensor | None = None):
    """G2RPO: at each trajectory's branch step `b`, the sum over denoising granularities of its
    reward normalized among its siblings (the members of its group that branched at `b`):
    `A_b = z(R_T) + z(R_{b+1})`, `R_T` the state after the branch denoised on the rollout's own
    grid, `R_{b+1}` the same state denoised by the run's completion method (`substeps:N` a coarser
    grid, `rollout` one step); 0 at every other step, which has no density. The paper sums over
    several merge factors of the grid; here the granularities are the rollout's and the completion's."""
    sib = _siblings(groups, branch, "granular")
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    b = branch.to(rewards.device)  # type: ignore[union-attr]  # checked by _siblings
    finer, coarser = rewards[:, -1:], rewards[rows, b + 1][:, None]
    adv = torch.zeros_like(gains)
    adv[rows, b] = (sib.normalize(finer) + sib.normalize(coarser)).reshape(-1)
    return adv, _no_turning(gains)


@SCHEMES.register("local", paper='arXiv 2605.25661, "step-level group advantage"')
def local(rewards, gains, groups: Groups, branch: torch.Tensor | None = None):
    """Step-GRPO: at each trajectory's branch step `b`, the reward of the state it reached, `R_{b+1}`
    (the completion method's: the policy's own x0 prediction with `rollout`, in place of the paper's
    reward model on noisy latents), z-scored among its `k` siblings (the members of its group that
    branched at `b` from the same state); 0 at every other step, which has no density."""
    sib = _siblings(groups, branch, "local")
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    b = branch.to(rewards.device)  # type: ignore[union-attr]  # checked by _siblings
    adv = torch.zeros_like(gains)
    adv[rows, b] = sib.normalize(rewards[rows, b + 1][:, None]).reshape(-1)
    return adv, _no_turning(gains)


# version 2: normalized over the trained steps only (version 1: over all B x T gains, the untrained
# steps' zero gains included).
@SCHEMES.register("stepwise", version="2", paper='arXiv 2603.28718, "gain-based advantages"')
def stepwise(rewards, gains, groups: Groups, baseline: bool = False, trained: torch.Tensor | None = None):
    """Stepwise-Flow-GRPO: gains normalized jointly over the `B x T'` trained entries (not per step);
    arXiv 2603.28718, "gain-based advantages" (the step's reward improvement `r_{t-1} - r_t`).

    `trained [T]` bool: the steps the update trains (None: every step); the other steps' gains stay
    out of the mean and std, and their advantages are 0. `baseline` (a *choice*, off as the paper
    does not subtract one): subtract each group's mean gain per step first (a per-prompt
    baseline); with a group-shared `x_0` the gains of one prompt then compare like with like.
    """
    mask = torch.ones(gains.shape[1], dtype=torch.bool) if trained is None else trained.to(torch.bool)
    g = gains[:, mask]  # [B, T']
    if baseline:
        g = g - (groups.sum(g) / groups.sizes[:, None])[groups.index]
    shifted = g - g.reshape(-1)[0]  # exact zero for constant gains (see Groups.normalize)
    centered = shifted - shifted.mean()
    adv = torch.zeros_like(gains)
    adv[:, mask] = centered / (centered.std(correction=0) + STD_EPS)
    return adv, _no_turning(gains)


@SCHEMES.register("dense", paper='arXiv 2601.20218, "dense reward"')
def dense(rewards, gains, groups: Groups):
    """DenseGRPO: gains normalized per step within each group (arXiv 2601.20218, "dense reward": the
    step-wise reward gain `R_{k+1} - R_k`, normalized in the group at each timestep)."""
    return groups.normalize(gains), _no_turning(gains)


def turning_points(
    rewards: torch.Tensor, gains: torch.Tensor, consistency: bool = True, first_step: bool = True
) -> torch.Tensor:
    """TP-GRPO turning points `[B, T]` bool, before balancing (METHODS.md, scheme 4; arXiv 2602.06422,
    "turning points": a step whose incremental reward flips the local trend's sign to agree with the
    trajectory's overall trend).

    With `delta = R_T - R_0` and `s_k = sign(g_k) sign(delta)`: step `k > 0` turns when
    `s_{k-1} < 0 < s_k`; step 0 (`first_step`) when `s_0 > 0`. With `consistency`, additionally
    `sign(g_k) sign(R_T - R_{k+1}) > 0` (the gain agrees with the rest of the trajectory).
    `sign(0) = 0`, so ties never qualify (and the last step never passes the consistency rule).
    """
    final = rewards[:, -1:]
    s = torch.sign(gains) * torch.sign(final - rewards[:, :1])  # [B, T]
    turn = torch.zeros_like(gains, dtype=torch.bool)
    turn[:, 1:] = (s[:, :-1] < 0) & (s[:, 1:] > 0)
    if first_step:
        turn[:, 0] = s[:, 0] > 0
    if consistency:
        turn &= torch.sign(gains) * torch.sign(final - rewards[:, 1:]) > 0
    return turn


def balance_turning_points(turn: torch.Tensor, delta: torch.Tensor, over: int | None = None) -> torch.Tensor:
    """Balance the turning points as TP-GRPO's code does (METHODS.md, scheme 4).

    `over`: the size of a sampling mini-batch (consecutive trajectories, the last one shorter);
    each is balanced on its own, as the authors' code balances each GPU's sampling batch. None:
    the rows given are one batch.

    `turn [B, T]` bool, `delta [B]` each trajectory's `R_T - R_0`. The turning points are split by
    the sign of their trajectory's `delta` and ranked by `|delta|`; the `min(#pos, #neg)` largest
    of each sign are kept. When they all share one sign (or there are none), all are kept: there
    is nothing to balance. Ties in `|delta|` (a trajectory's turning points share it) go to the
    earlier position (row-major).
    """
    B, T = turn.shape
    if over is not None and over < B:
        return torch.cat([balance_turning_points(turn[i : i + over], delta[i : i + over]) for i in range(0, B, over)])
    flat_turn = turn.reshape(-1)
    flat_delta = delta.reshape(B, 1).expand(B, T).reshape(-1)
    pos, neg = flat_turn & (flat_delta > 0), flat_turn & (flat_delta < 0)
    keep_n = int(min(pos.sum(), neg.sum()))
    if keep_n == 0:
        return turn.clone()
    kept = torch.zeros_like(flat_turn)
    for sign_mask in (pos, neg):
        idx = sign_mask.nonzero().reshape(-1)  # ascending position
        # stable sort on -|delta|: equal magnitudes keep their position order
        order = torch.sort(-flat_delta[idx].abs(), stable=True).indices
        kept[idx[order[:keep_n]]] = True
    return kept.reshape(turn.shape)


def turning_point_rewards(
    rewards: torch.Tensor,
    consistency: bool = True,
    first_step: bool = True,
    balance: bool = True,
    balance_over: int | str = TP_SAMPLE_BATCH,
):
    """TP-GRPO step rewards `[B, T]` and the kept turning points `[B, T]` bool.

    `rewards [B, T+1]`. A kept turning point's reward is the aggregated `R_T - R_k` (its own
    `g_k` is dropped); every other step keeps `g_k`. `balance_over`: the sampling mini-batch
    balanced at once (trajectories in rollout order), or `"iteration"` for the whole batch.
    """
    gains = rewards[:, 1:] - rewards[:, :-1]
    turn = turning_points(rewards, gains, consistency=consistency, first_step=first_step)
    aggregated = rewards[:, -1:] - rewards[:, :-1]  # [B, T] R_T - R_k
    if balance:
        turn = balance_turning_points(turn, rewards[:, -1] - rewards[:, 0], balance_size(balance_over))
    return torch.where(turn, aggregated, gains), turn


def balance_size(balance_over: int | str) -> int | None:
    """`balance_over` as a mini-batch size (None: the whole iteration); rejects other values."""
    if balance_over == "iteration":
        return None
    if isinstance(balance_over, bool) or not isinstance(balance_over, int) or balance_over < 1:
        raise ValueError(
            f"turning_point balance_over must be a positive number of trajectories (the authors': "
            f"{TP_SAMPLE_BATCH}) or 'iteration'; got {balance_over!r}"
        )
    return balance_over


# version 2: balancing by the trajectory's R_T - R_0, every turning point kept when all share one
# sign (version 1 ranked by R_T - R_k and kept none of a one-signed batch). Version 3: balanced
# over sampling mini-batches of `balance_over` trajectories (version 2: over the whole iteration).
@SCHEMES.register("turning_point", version="3", paper='arXiv 2602.06422, "step-level incremental rewards"')
def turning_point(
    rewards,
    gains,
    groups: Groups,
    consistency: bool = True,
    first_step: bool = True,
    balance: bool = True,
    balance_over: int | str = TP_SAMPLE_BATCH,
):
    """TP-GRPO: turning points take the aggregated reward `R_T - R_k`; then per-(group, step)
    normalization. arXiv 2602.06422: "step-level incremental rewards" for every step, the
    "aggregated long-term reward" for a turning point; the balancing rule is the authors' code's."""
    step_rewards, turn = turning_point_rewards(
        rewards, consistency=consistency, first_step=first_step, balance=balance, balance_over=balance_over
    )
    return groups.normalize(step_rewards), turn


def scheme_options(scheme: str) -> dict[str, object]:
    """The options of `scheme` and their defaults (for config validation and docs)."""
    params = [p for p in list(inspect.signature(SCHEMES.get(scheme)).parameters.values())[3:] if p.name not in CONTEXT]
    return {p.name: p.default for p in params}


def unknown_options(scheme: str, options: Mapping[str, object]) -> str | None:
    """What is wrong with the option names of `scheme` in `options`, or None when all are its own."""
    valid = scheme_options(scheme)
    unknown = sorted(set(options) - set(valid))
    if not unknown:
        return None
    return f"credit scheme {scheme!r} has no option(s) {unknown}; valid options: {sorted(valid) or 'none'}"


def check_options(scheme: str, options: Mapping[str, object]) -> None:
    """The one check of a scheme's options, wherever they are given (a config, `stepgrpo credit
    --options`): unknown names, then bad values, by running the scheme once on a tiny batch, so a
    bad value (a negative mini-batch, a wrong type) fails in the scheme's own words before any stage
    runs. Raises ValueError."""
    if (problem := unknown_options(scheme, options)) is not None:
        raise ValueError(problem)
    tree = [(0, 2)] if reads_tree(scheme) else None  # the tiny batch's one group as a one-split tree
    branch = torch.zeros(2, dtype=torch.long) if reads_branch(scheme) else None  # both branching at step 0
    try:
        assign(scheme, torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), tree=tree, branch=branch, **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"credit.options of scheme {scheme!r}: {err}") from None


def reads_tree(scheme: str) -> bool:
    """Whether `scheme` declares the `tree` keyword (it credits a tree rollout's nodes)."""
    return "tree" in inspect.signature(SCHEMES.get(scheme)).parameters


def reads_branch(scheme: str) -> bool:
    """Whether `scheme` declares the `branch` keyword (it compares siblings that share a branch step)."""
    return "branch" in inspect.signature(SCHEMES.get(scheme)).parameters


def reads_trained(scheme: str) -> bool:
    """Whether `scheme` declares the `trained` keyword (its advantages depend on the trained steps)."""
    return "trained" in inspect.signature(SCHEMES.get(scheme)).parameters


def assign(
    scheme: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    trained: torch.Tensor | None = None,
    tree: list[tuple[int, int]] | None = None,
    branch: torch.Tensor | None = None,
    **options,
) -> Credit:
    """Advantages of every step under credit `scheme` (module doc).

    Args:
        scheme: a `SCHEMES` name (`stepgrpo config variants` lists them).
        rewards: `[B, T+1]`, `rewards[:, k] = R_k`; no NaN (fill or drop missing rewards first).
        group_ids: `[B]` int64, equal for trajectories of the same prompt (sharing `x_0`).
        trained: `[T]` bool, the steps the update trains (None: every step); passed to a scheme
            that declares `trained` (`CONTEXT`).
        tree: the rollout's branching `[(step, factor), ...]` (`sampler.branch_tree`), passed to a
            scheme that declares `tree`.
        branch: `[B]` long, each trajectory's branch step (a branched rollout's one stochastic
            step), passed to a scheme that declares `branch`.
        options: the scheme's options (`scheme_options(scheme)`); unknown ones are rejected.

    Returns `Credit` (advantages `[B, T]` fp32, gains, turning mask, keep mask, drop counts).
    """
    fn = SCHEMES.get(scheme)
    if (problem := unknown_options(scheme, options)) is not None:
        raise TypeError(problem)
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [B, T+1] with T >= 1; got {tuple(rewards.shape)}")
    if group_ids.shape != (rewards.shape[0],) or group_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"group_ids must be an integer tensor [B={rewards.shape[0]}]; got {group_ids.dtype} "
            f"{tuple(group_ids.shape)}"
        )
    # fp32 at least: rewards may arrive as fp16/bf16 and the gains are small differences.
    rewards = rewards.float()
    if bool(rewards.isnan().any()):
        raise ValueError("rewards contain NaN: drop those trajectories or fill the missing rewards before credit")
    groups = Groups(group_ids.to(rewards.device))
    gains = rewards[:, 1:] - rewards[:, :-1]
    if trained is not None and (trained.shape != (gains.shape[1],) or not bool(trained.any())):
        raise ValueError(f"trained must be a [T={gains.shape[1]}] bool mask with at least one step")
    context = {"trained": trained.cpu().bool()} if trained is not None and reads_trained(scheme) else {}
    if reads_tree(scheme):
        context["tree"] = [tuple(map(int, node)) for node in tree] if tree else None
    if reads_branch(scheme):
        if branch is not None and (branch.shape != (rewards.shape[0],) or bool((branch < 0).any())):
            raise ValueError(f"branch must hold each trajectory's branch step ([B={rewards.shape[0]}], >= 0)")
        if branch is not None and int(branch.max()) >= gains.shape[1]:
            raise ValueError(f"branch steps must lie in [0, T) = [0, {gains.shape[1]})")
        context["branch"] = branch.long().cpu() if branch is not None else None
    out = fn(rewards, gains, groups, **options, **context)
    advantages, turn = out if isinstance(out, tuple) else (out, _no_turning(gains))  # a plug-in may return A alone
    if not isinstance(advantages, torch.Tensor) or advantages.shape != gains.shape:
        got = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"credit scheme {scheme!r} returned advantages {got}; expected a tensor {tuple(gains.shape)}")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError(f"credit scheme {scheme!r} returned NaN/inf advantages")
    advantages = advantages.float()
    nonzero = groups.sum((advantages != 0).any(dim=1, keepdim=True).float()).reshape(-1) > 0  # [n]
    keep = nonzero[groups.index]
    advantages = advantages * keep[:, None]
    dropped = int((~nonzero).sum())
    return Credit(advantages, gains, turn, keep, dropped, dropped / groups.count)
