"""Update objectives: PPO-clip GRPO on the rollout's transitions, and, on forward-noised copies of
each sample's clean latent, DiffusionNFT, AWM and DGPO.

Where PPO-clip GRPO (`loss.grpo_loss`) trains on the rollout's own transitions and their
log-probabilities, the others train the velocity by flow matching: each sample's clean latent `x0`
is noised afresh at a few grid times, `x_t = (1 - t) x0 + t eps`, and the policy's velocity there
is pulled toward (or, for bad samples, pushed from) the target, weighted by the advantage. The
rows of a batch are (sample, time) pairs, N of them, each with its own advantage: outcome credit
repeats a sample's advantage at all its times (the papers' form); a step-level scheme gives row
(i, t) the advantage of the sampler step at grid time t (docs/METHODS.md, "Update objectives").

    batch = MatchingBatch(x0, eps, t, advantages, v, v_old=..., v_ref=..., v_ema=...)
    out = OBJECTIVES.get("nft")(batch)          # ObjectiveOutput(loss, stats)

Shapes: `x0`, `eps`, `v`, `v_old`, `v_ref`, `v_ema`: [N, C, H, W]; `t`, `advantages`: [N]. `v`
carries the gradient; the others are detached here. Each entry is the authors' code transcribed
(NVlabs/DiffusionNFT `scripts/train_nft_sd3.py`, scxue/advantage_weighted_matching
`scripts/train_sd3_awm.py`, Luo-Yihong/DGPO `scripts/train_sd3_dgpo.py`), with their defaults as
the defaults. The registry's facts tell the one update loop what each needs (below).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .registry import Registry


@dataclass
class MatchingBatch:
    """N (sample, time) rows of a flow-matching objective (module doc)."""

    x0: torch.Tensor  # [N, C, H, W] the sample's clean latent
    eps: torch.Tensor  # [N, C, H, W] the fresh forward noise of the row
    t: torch.Tensor  # [N] the row's time in (0, 1) (sigma: 1 is noise)
    advantages: torch.Tensor  # [N] the row's advantage (before the objective's clipping)
    v: torch.Tensor  # [N, C, H, W] the policy's velocity at x_t (with the gradient)
    v_old: torch.Tensor | None = None  # the sampling ("old") policy's velocity (nft)
    v_ref: torch.Tensor | None = None  # the base model's (the KL term)
    v_ema: torch.Tensor | None = None  # the EMA adapter's (awm)
    groups: torch.Tensor | None = None  # [N] the rows' group ids (dgpo: every member of a group is here)

    @property
    def x_t(self) -> torch.Tensor:
        return noised(self.x0, self.eps, self.t)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar
    stats: dict[str, float] = field(default_factory=dict)


Objective = Callable[..., ObjectiveOutput]
# Facts (what the one update loop, `stepgrpo.loops.training.update`, reads; never the name):
# `rows`: what a row of the loss is. `transitions`: a (trajectory, trained step) pair of the
# rollout, trained on its stored log-probability (PPO-clip GRPO, `loss.grpo_loss`; its options are
# the config's `optim` section); `noised`: a (sample, grid time) pair, the sample's clean latent
# noised afresh (`MatchingBatch`). `whole_groups`: a row's loss reads every member of its group (a
# micro-batch, and a rank, holds whole groups; the rows of a group share their grid times and
# forward noise). `keeps_zero_advantage`: samples whose advantages are all zero are still trained
# (their loss is not 0: DiffusionNFT's r = 0.5 pulls toward the old policy, the KL terms act);
# False: dropped, as Flow-GRPO drops them. `needs_old`: the update evaluates the companion
# adapter's velocity as the old policy; `needs_ema`: as an EMA target; `needs_ref`: the base
# model's (`True`: always; `"kl"`: when the objective's `kl_beta` (grpo: `optim.kl_beta`) is not 0).
# `companion`: the adapter kept beside the trained one in every checkpoint (`old`: the policy that
# samples or anchors the update; `kl_ema`: the KL term's slowly moving target), moved after every
# `companion_moves` (`step`: after every optimizer step; `iteration`: once, after the iteration's
# last, as the authors move it once an epoch) by `companion_update` with decay `min(rate * step,
# cap)`, step the run's optimizer steps so far (`companion_decay`: (rate, cap));
# `samples_with_companion`: the rollouts are drawn by it rather than by the trained adapter (True),
# once the run has taken more optimizer steps than this number (an int), or never (False).
# `version`: what a stored run's update computed changes with it (awm 2: the clip's default became
# the authors' GenEval 1; `tasks.keys.code_facts`).
# `times`: how many of the sampler's grid times each sample is trained at, and how they are drawn
# (`grid_times`): `(rule, n, span)` with n a count, or a fraction of the grid when below 1, and span
# the share of the grid the times are drawn from.
OBJECTIVES: Registry[Objective] = Registry(
    "objective",
    options=lambda name: _options(name),
    rows="noised",
    whole_groups=False,
    keeps_zero_advantage=True,
    needs_old=False,
    needs_ema=False,
    needs_ref="kl",
    companion=None,
    companion_decay=None,
    companion_moves="step",
    samples_with_companion=False,
    times=None,
    version="1",
    title=None,  # how a model card names it ("GRPO", "AWM"); None: the entry's name
)


def _options(name: str) -> dict[str, object]:
    """An objective's options and their defaults: its keyword parameters after the batch (none for
    `grpo`, whose options are the `optim` section's)."""
    if OBJECTIVES.facts(name)["rows"] == "transitions":
        return {}
    params = list(inspect.signature(OBJECTIVES.get(name)).parameters.values())[1:]
    return {p.name: p.default for p in params if p.default not in (None, inspect.Parameter.empty)}


def check_objective_options(name: str, options: dict[str, object]) -> None:
    """Refuse an option the objective does not take, naming the ones it does."""
    known = _options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = ", ".join(f"{k} (default {v!r})" for k, v in known.items()) or "none (grpo reads the optim section)"
        raise ValueError(f"update.options {unknown} are not options of objective {name!r}; it takes: {takes}")


@OBJECTIVES.register(
    "grpo",
    title="GRPO",
    rows="transitions",
    keeps_zero_advantage=False,  # Flow-GRPO masks out samples whose advantages are all zero
    paper="arXiv 1707.06347, eq. 7 (PPO's clipped surrogate) on each SDE step, as Flow-GRPO (arXiv 2505.05470)",
)
def grpo(*args, **kwargs):
    """PPO-clip GRPO on the rollout's own transitions (`stepgrpo_core.loss.grpo_loss`): the clip,
    the KL weight and the steps per batch are the `optim` section's."""
    from .loss import grpo_loss

    return grpo_loss(*args, **kwargs)


def grid_times(
    rule: str, n: float, steps: int, batch: int, generator: torch.Generator | None = None, span: float = 1.0
) -> torch.Tensor:
    """`[batch, m]` long: the sampler grid steps each sample is trained at (its times are the
    grid's `sigmas[k]`), drawn from `generator` in one call.

    `random` (DiffusionNFT: `timestep_fraction` 0.99 of its 10 steps, each sample its own random
    permutation, the first `m` kept): `m = int(steps * n)` for `n < 1`, else `n`.
    `stratified` (AWM's `discrete_wo_init`): the steps `[1, int(steps * span))` cut into `m = n`
    strata at `linspace(1, int(steps * span), m + 1)` (truncated to integers), one uniform step in
    each, the same draw for every sample of the batch as the authors' code does (their
    `timestep_fraction` is `span`).
    `subset` (DGPO: `random.sample(range(trunc_steps + 1), M)`): `m = n` distinct steps of
    `[0, int(steps * span))`, one draw for every sample of the batch."""
    m = times_count(rule, n, steps, span)
    upper = max(2, int(steps * span))
    if rule == "subset":
        pick = torch.rand(int(steps * span), generator=generator).argsort()[:m]
        return pick.expand(batch, m).clone()
    if rule == "random":
        u = torch.rand(batch, steps, generator=generator)
        return u.argsort(dim=1)[:, :m]
    if rule == "stratified":
        bounds = torch.linspace(1, upper, m + 1).long()
        lower, upper = bounds[:-1], bounds[1:]
        u = torch.rand(m, generator=generator)
        k = lower + (u * (upper - lower)).long()
        return k.clamp(max=steps - 1).expand(batch, m).clone()
    raise ValueError(f"grid time rule {rule!r}: one of {', '.join(RULES)}")


def times_count(rule: str, n: float, steps: int, span: float = 1.0) -> int:
    """How many grid times `grid_times(rule, n, steps, ..., span)` draws a sample; refuses what the
    grid cannot hold (`random`: at most `steps`; `stratified`: one a step of `1 .. int(steps
    span) - 1`, step 0 left out)."""
    m = int(steps * n) if n < 1 else int(n)
    if rule == "random" and not 1 <= m <= steps:
        raise ValueError(f"update.times: {m} random grid times of a {steps}-step grid; need 1 to {steps}")
    upper = max(2, int(steps * span))
    if rule == "stratified" and not 1 <= m <= upper - 1:
        raise ValueError(
            f"update.times: {m} stratified grid times over steps 1..{upper - 1}; need 1 to {upper - 1} "
            "(set update.times, update.time_span or sampler.steps)"
        )
    if not 0 < span <= 1:
        raise ValueError(f"update.time_span {span}: a share of the grid in (0, 1]")
    if rule == "subset" and not 1 <= m <= int(steps * span):
        raise ValueError(
            f"update.times: {m} distinct grid times of steps 0..{int(steps * span) - 1}; need 1 to "
            f"{int(steps * span)} (set update.times, update.time_span or sampler.steps)"
        )
    if rule not in RULES:
        raise ValueError(f"grid time rule {rule!r}: one of {', '.join(RULES)}")
    return m


RULES = ("random", "stratified", "subset")  # `grid_times`' rules


def companion_update(
    companion: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], step: int, rate: float, cap: float
) -> float:
    """After optimizer step `step` (1-based, over the run): `companion = d companion + (1 - d)
    weights`, `d = min(rate * step, cap)`, in place (DiffusionNFT's `return_decay` type 1, AWM's
    `kl_ema_decay_type: linear`). Returns d."""
    d = min(rate * step, cap)
    for name, w in weights.items():
        companion[name].mul_(d).add_(w.detach().to(companion[name].dtype), alpha=1.0 - d)
    return d


def row_advantages(advantages: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`[B, m]`: the advantage of each (sample, time) row, the scheme's advantage of the sampler
    step whose grid time the row is noised at (`advantages [B, T]`, `steps [B, m]` from
    `grid_times`); a step without credit (NaN) gets advantage 0 (which weighs nothing in GRPO's and
    AWM's policy terms, but is DiffusionNFT's r = 0.5, a pull toward the old policy, and leaves
    every KL term acting). Outcome credit repeats the sample's advantage at every step, so every row
    of a sample gets it: the papers' form."""
    a = torch.nan_to_num(advantages.float(), nan=0.0)
    return a.gather(1, steps.to(a.device))


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process of a rectified flow: `x_t = (1 - t) x0 + t eps`, `t` per row."""
    tt = _rows(t, x0)
    return (1.0 - tt) * x0 + tt * eps


def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def _mean_rows(x: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N]: the mean over every dimension but the first."""
    return x.mean(dim=tuple(range(1, x.dim())))


def _kl(v: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """The velocities' squared distance, averaged over C, H, W, then rows (0 without `other`)."""
    if other is None:
        return v.new_zeros(())
    return _mean_rows((v - other.detach()) ** 2).mean()


@OBJECTIVES.register(
    "nft",
    title="DiffusionNFT",
    needs_old=True,
    companion="old",
    companion_decay=(0.001, 0.5),  # NVlabs/DiffusionNFT config/nft.py: decay_type 1
    companion_moves="iteration",  # scripts/train_nft_sd3.py: the old model moves once an epoch
    samples_with_companion=True,
    times=("random", 0.99, 1.0),  # timestep_fraction 0.99: 9 of 10 steps
    paper='arXiv 2509.16117, "negative-aware fine-tuning"',
)
def nft(batch: MatchingBatch, beta: float = 1.0, adv_clip: float = 5.0, kl_beta: float = 1e-4) -> ObjectiveOutput:
    """DiffusionNFT: the implicit positive and negative policies `v+-` built from the policy and
    the old policy, each pulled toward the clean latent with weight `r` or `1 - r`, `r = 0.5 + A / (2
    adv_clip)` from the clipped advantage.

    With `v_old` detached: `v+ = beta v + (1 - beta) v_old`, `v- = (1 + beta) v_old - beta v`,
    `x0+- = x_t - t v+-`, the adaptive weights `w+- = mean |x0+- - x0|` (detached, at least 1e-5), and
    loss = adv_clip * mean_rows[(r |x0+ - x0|^2 / w+ + (1 - r) |x0- - x0|^2 / w-) / beta]
         + kl_beta * mean_rows |v - v_ref|^2
    (each |.|^2 averaged over C, H, W). `beta` 1 (the authors' 0.1 for OCR and multi-reward)."""
    if batch.v_old is None:
        raise ValueError("objective 'nft' needs the old policy's velocity (v_old)")
    if beta <= 0 or adv_clip <= 0:
        raise ValueError(f"nft: beta and adv_clip must be positive; got beta={beta}, adv_clip={adv_clip}")
    x0, tt, v_old = batch.x0, _rows(batch.t, batch.x0), batch.v_old.detach()
    x_t = batch.x_t
    a = batch.advantages.clamp(-adv_clip, adv_clip)
    r = (a / adv_clip / 2.0 + 0.5).clamp(0.0, 1.0).to(x0.dtype)
    x0_pos = x_t - tt * (beta * batch.v + (1.0 - beta) * v_old)
    x0_neg = x_t - tt * ((1.0 + beta) * v_old - beta * batch.v)
    with torch.no_grad():
        w_pos = _mean_rows((x0_pos.double() - x0.double()).abs()).clamp_min(1e-5).to(x0.dtype)
        w_neg = _mean_rows((x0_neg.double() - x0.double()).abs()).clamp_min(1e-5).to(x0.dtype)
    positive = _mean_rows((x0_pos - x0) ** 2) / w_pos
    negative = _mean_rows((x0_neg - x0) ** 2) / w_neg
    per_row = (r * positive + (1.0 - r) * negative) / beta
    policy = (per_row * adv_clip).mean()
    kl = _kl(batch.v, batch.v_ref)
    loss = policy + kl_beta * kl
    return ObjectiveOutput(
        loss,
        {
            "policy_loss": float(policy.detach()),
            "kl": float(kl.detach()),
            "r_mean": float(r.mean()),
            "old_deviation": float(((batch.v.detach() - v_old) ** 2).mean()),
        },
    )


def awm_log_prob(
    v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, weighting: str, power: float
) -> torch.Tensor:
    """AWM's per-row log-likelihood surrogate: minus the flow-matching error `mean |v - (eps - x0)|^2`
    (over C, H, W, in fp64), shaped by `weighting`: `uniform`, `t`, `t**2`, or `ghuber` (the authors'
    default: `-((e + 1e-10)^p - 1e-10^p) t / p`, p = `power`)."""
    err = _mean_rows((v.double() - (eps.double() - x0.double())) ** 2)
    tt = t.double()
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -err * tt
    if weighting == "t**2":
        return -err * tt**2
    if weighting == "ghuber":
        return -((err + 1e-10) ** power - math.pow(1e-10, power)) * tt / power
    raise ValueError(f"awm weighting {weighting!r}: one of uniform, t, t**2, ghuber")


@OBJECTIVES.register(
    "awm",
    title="AWM",
    needs_ema=True,
    companion="kl_ema",
    companion_decay=(0.001, 0.3),  # scxue/advantage_weighted_matching config/dgx_awm.py: kl_ema_decay 0.3, linear
    companion_moves="iteration",  # scripts/train_sd3_awm.py: the KL's EMA moves once an epoch
    version="2",
    times=("stratified", 6, 0.9),  # train_timesteps 6, time_type discrete_wo_init, timestep_fraction 0.9
    paper='arXiv 2509.25050, "advantage weighted matching"',
)
def awm(
    batch: MatchingBatch,
    adv_clip: float = 5.0,
    advantage_max: float = 1.0,
    weighting: str = "ghuber",
    power: float = 0.25,
    clip_range: float = 1.0,
    kl_beta: float = 1e-3,
    ema_beta: float = 1.0,
    old_log_prob: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """AWM: the flow-matching log-likelihood surrogate of each row weighted by its advantage, in
    PPO's clipped form per row (on-policy, the ratio is 1 and the gradient `-A grad log p`), plus
    KL terms to the base model and to an EMA adapter.

    `A = clip(a, +-adv_clip) / adv_clip * advantage_max`; `log p` = `awm_log_prob`; ratio =
    exp(log p - old), old = `old_log_prob` or `log p` detached; loss = mean_rows max(-A ratio,
    -A clip(ratio, 1 +- clip_range)) + kl_beta mean |v - v_ref|^2 + ema_beta mean |v - v_ema|^2.
    Defaults: the authors' GenEval config (`clip_range` 1: on-policy the ratio is 1 anyway;
    `kl_beta` 3e-3 for OCR, 1e-4 PickScore)."""
    a = batch.advantages.clamp(-adv_clip, adv_clip).double() / adv_clip * advantage_max
    lp = awm_log_prob(batch.v, batch.x0, batch.eps, batch.t, weighting, power)
    old = lp.detach() if old_log_prob is None else old_log_prob.double().detach()
    ratio = torch.exp(lp - old)
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)).mean()
    kl = _kl(batch.v, batch.v_ref)
    ema = _kl(batch.v, batch.v_ema)
    loss = policy.to(batch.v.dtype) + kl_beta * kl + ema_beta * ema
    return ObjectiveOutput(
        loss,
        {
            "policy_loss": float(policy.detach()),
            "kl": float(kl.detach()),
            "ema_kl": float(ema.detach()),
            "clip_frac": float(((ratio.detach() - 1.0).abs() > clip_range).double().mean()),
        },
    )


@OBJECTIVES.register(
    "dgpo",
    title="DGPO",
    whole_groups=True,
    needs_old=True,
    needs_ref=True,  # the preference's reference, whatever the KL weight
    companion="old",
    companion_decay=(0.001, 0.3),  # Luo-Yihong/DGPO scripts/train_sd3_dgpo.py: ema_ref decay min(0.3, 0.001 step)
    samples_with_companion=500,  # config/dgpo.py geneval_sd3_4gpu: switch_ema_ref 500 (200 in the base recipe)
    times=("subset", 4, 0.5),  # num_train_timesteps 4 of steps 0..trunc_steps, trunc_steps 4 of 10 (geneval)
    paper='arXiv 2510.08425, "direct group preference optimization"',
)
def dgpo(
    batch: MatchingBatch,
    beta_dpo: float = 101.0,
    adv_clip: float = 5.0,
    clip_range: float = 1e-2,
    kl_beta: float = 0.02,
    reference: str = "base",
) -> ObjectiveOutput:
    """DGPO: each sample's flow-matching error weighted by its clipped advantage and by its group's
    preference weight, which grows with how much worse than the reference the policy fits the
    group's good samples (and better its bad ones).

    With `d_i = mean |v - (eps - x0)|^2` (over C, H, W):

        s_G = beta_dpo / |G| sum_{j in G} A_j (d_j - d_j_ref)     (detached)
        loss = mean_rows sigmoid(s_G(i)) A_i d_i + kl_beta mean |v - v_ref|^2

    (eq. 10 of the paper in the gradient form of the authors' `compute_group_dgpo_loss_allreduce`).
    `d_ref` is the base model's error (`reference` base; `old`: the companion adapter's, the
    authors' `use_ema_ref`). PPO-style clipping of the error (the authors' `clip_dsm`): with ratio =
    exp(d_old - d), a row whose ratio left `1 + clip_range` (A > 0) or `1 - clip_range` (A < 0)
    contributes no gradient; `clip_range` 0 turns it off. Every row of a group must be in the batch
    (`batch.groups`); the rows of a group share their time and noise. Defaults: the authors'
    GenEval config (their base compressibility recipe: `beta_dpo` 100, `clip_range` 5e-2)."""
    if batch.groups is None or batch.v_ref is None or batch.v_old is None:
        raise ValueError("objective 'dgpo' needs the rows' groups, the base model's and the old policy's velocities")
    if reference not in ("base", "old"):
        raise ValueError(f"dgpo: reference {reference!r}: base or old")
    target = (batch.eps - batch.x0).double()
    a = batch.advantages.double().clamp(-adv_clip, adv_clip)
    d = _mean_rows((batch.v.double() - target) ** 2)
    with torch.no_grad():
        d_old = _mean_rows((batch.v_old.double() - target) ** 2)
        d_ref = d_old if reference == "old" else _mean_rows((batch.v_ref.double() - target) ** 2)
    clipped = torch.zeros_like(d, dtype=torch.bool)
    if clip_range > 0:
        ratio = torch.exp(d_old - d.detach())
        clipped = torch.where(a > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    d_used = torch.where(clipped, d.detach(), d)
    groups = torch.unique(batch.groups, return_inverse=True)[1].to(d.device)
    size = torch.bincount(groups).double()[groups]
    s = torch.zeros(int(groups.max()) + 1, dtype=torch.float64, device=d.device)
    s.scatter_add_(0, groups, a * beta_dpo * (d.detach() - d_ref) / size)
    w = torch.sigmoid(s)[groups]
    policy = (w * a * d_used).mean()
    kl = _kl(batch.v, batch.v_ref)
    loss = policy.to(batch.v.dtype) + kl_beta * kl
    return ObjectiveOutput(
        loss,
        {
            "policy_loss": float(policy.detach()),
            "kl": float(kl.detach()),
            "dsm": float(d.detach().mean()),
            "preference_weight": float(w.mean()),
            "clip_frac": float(clipped.double().mean()),
        },
    )
