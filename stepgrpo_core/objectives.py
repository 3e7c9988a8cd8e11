"""Update objectives on forward-noised copies of each sample's clean latent: DiffusionNFT and AWM.

Where PPO-clip GRPO (`loss.grpo_loss`) trains on the rollout's own transitions and their
log-probabilities, these two train the velocity by flow matching: each sample's clean latent `x0`
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
`scripts/train_sd3_awm.py`), with their defaults as the defaults.
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

    @property
    def x_t(self) -> torch.Tensor:
        return noised(self.x0, self.eps, self.t)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar
    stats: dict[str, float] = field(default_factory=dict)


Objective = Callable[..., ObjectiveOutput]
# Facts: `matching`: trains on forward-noised copies of the clean latent (`MatchingBatch`); False
# for PPO-clip GRPO, which trains on the rollout's transitions (`loss.grpo_loss`, its options in
# the config's `optim` section). `needs_old`: the update evaluates the sampling policy's velocity;
# `needs_ema`: an EMA adapter's; `needs_ref`: the base model's (the KL term, when its weight is not
# 0). `companion`: the adapter kept beside the trained one in every checkpoint (`old`: the policy
# that samples the rollouts; `kl_ema`: the KL term's slowly moving target), moved after every
# optimizer step by `companion_update` with decay `min(rate * step, cap)` (`companion_decay`:
# (rate, cap)); `samples_with_companion`: the rollouts are drawn by it rather than by the trained
# adapter. `times`: how many of the sampler's grid times each sample is trained at, and how they
# are drawn (`grid_times`): `(rule, n, span)` with n a count, or a fraction of the grid when below
# 1, and span the share of the grid stratified times are drawn from.
OBJECTIVES: Registry[Objective] = Registry(
    "objective",
    options=lambda name: _options(name),
    matching=True,
    needs_old=False,
    needs_ema=False,
    needs_ref=True,
    companion=None,
    companion_decay=None,
    samples_with_companion=False,
    times=None,
    title=None,  # how a model card names it ("GRPO", "AWM"); None: the entry's name
)


def _options(name: str) -> dict[str, object]:
    """An objective's options and their defaults: its keyword parameters after the batch (none for
    `grpo`, whose options are the `optim` section's)."""
    if not OBJECTIVES.facts(name)["matching"]:
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
    matching=False,
    needs_ref=True,
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
    `timestep_fraction` is `span`)."""
    m = times_count(rule, n, steps, span)
    upper = max(2, int(steps * span))
    if rule == "random":
        u = torch.rand(batch, steps, generator=generator)
        return u.argsort(dim=1)[:, :m]
    if rule == "stratified":
        bounds = torch.linspace(1, upper, m + 1).long()
        lower, upper = bounds[:-1], bounds[1:]
        u = torch.rand(m, generator=generator)
        k = lower + (u * (upper - lower)).long()
        return k.clamp(max=steps - 1).expand(batch, m).clone()
    raise ValueError(f"grid time rule {rule!r}: random or stratified")


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
    if rule not in ("random", "stratified"):
        raise ValueError(f"grid time rule {rule!r}: random or stratified")
    return m


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
    `grid_times`); a step without credit (NaN) weighs 0. Outcome credit repeats the sample's
    advantage at every step, so every row of a sample gets it: the papers' form."""
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
    times=("stratified", 6, 0.9),  # train_timesteps 6, time_type discrete_wo_init, timestep_fraction 0.9
    paper='arXiv 2509.25050, "advantage weighted matching"',
)
def awm(
    batch: MatchingBatch,
    adv_clip: float = 5.0,
    advantage_max: float = 1.0,
    weighting: str = "ghuber",
    power: float = 0.25,
    clip_range: float = 1e-4,
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
    Defaults: the authors' GenEval config (`kl_beta` 3e-3 for OCR, 1e-4 PickScore)."""
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
