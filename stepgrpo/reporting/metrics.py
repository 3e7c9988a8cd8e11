"""What one iteration and one evaluation put in MLflow and in the run's reward table, from their
stage results (`stepgrpo.flows.progress.TrainingLog` logs them)."""

from __future__ import annotations

import math
from typing import Any

from stepgrpo.results import (
    CompleteResult,
    CreditResult,
    DrawResult,
    EvaluateResult,
    RolloutResult,
    ScoreResult,
    UpdateResult,
)

BY_NFE = "heldout/reward_by_nfe"  # logged at step = cumulative training NFEs (`TrainingLog.evaluation`)
BY_PASSES = "heldout/reward_by_passes"  # logged at step = cumulative forward-equivalent passes


def eval_metrics(ev: EvaluateResult) -> dict[str, float]:
    out = {"eval/mean": ev.reward_mean, "eval/std": ev.reward_std, "eval/strict": ev.reward_strict}
    out |= {f"eval/sub_{k}": v for k, v in ev.sub.items()}
    return {k: float(v) for k, v in out.items() if v is not None}


def iteration_metrics(
    rollout: RolloutResult,
    clean: CompleteResult | RolloutResult,
    rewards: ScoreResult,
    credit: CreditResult,
    update: UpdateResult,
    draw: DrawResult | None = None,
    step_rewards: bool = True,
) -> dict[str, float]:
    """MLflow metrics of one iteration from its stage results (`draw`: the curriculum's, if any).
    Only series that can carry information: a run scored on final samples alone (`step_rewards`
    False, outcome credit) has no per-step gains, turning points, completion or ODE-reference NFEs,
    so it logs none of those all-zero series."""
    r, c, u = rewards, credit, update.stats
    out: dict[str, Any] = {
        "reward/mean": r.reward_mean,
        "reward/std": r.reward_std,
        "reward/strict": r.reward_strict,
        "advantage/mean": c.adv_mean,
        "advantage/std": c.adv_std,
        "advantage/abs_max": c.adv_abs_max,
        "zero_std_ratio": c.zero_std_ratio,
        "turning_points": c.turning_points,
        "reward/ode_mean": r.ode_reward_mean,
        "reward/group_std": r.group_reward_std,
        "reward/zero_std_groups": r.zero_std_groups,
        "nfe/rollout": rollout.nfe,
        "nfe/ode_reference": rollout.nfe_ode,
        "nfe/complete": clean.nfe if isinstance(clean, CompleteResult) else 0,
        "nfe/update": update.nfe,
    }
    out |= {
        "clip_frac": u.clip_frac,
        "approx_kl": u.approx_kl,
        "kl": u.kl,
        "loss": u.loss,
        "grad_norm": u.grad_norm,
        "signal_cosine": u.signal_cosine,
        "signal_cosine_window": u.signal_cosine_window,
        "ratio/mean": u.ratio_mean,
        "ratio/std": u.ratio_std,
        "ratio/min": u.ratio_min,
        "ratio/max": u.ratio_max,
        "lora/distance": u.lora_distance,
        "lora/update_norm": u.update_norm,
        "clip_frac/first": u.clip_frac_first,
        "clip_frac/later": u.clip_frac_later,
        "zero_grad_frac/first": u.zero_grad_frac_first,
        "zero_grad_frac/later": u.zero_grad_frac_later,
    }
    for name, values in (
        ("grad_energy_share", u.grad_energy_share),
        ("clip_frac_later", u.clip_frac_later_by_step),
        ("zero_grad_frac_later", u.zero_grad_frac_later_by_step),
    ):
        out |= {f"{name}/step_{k}": v for k, v in zip(u.trained_step_ids, values)}
    for name, values in (("clip_frac", u.clip_frac_by_part), ("zero_grad_frac", u.zero_grad_frac_by_part)):
        out |= {f"{name}/part_{p}": v for p, v in enumerate(values)}  # each optimizer step of the batch
    if step_rewards:
        out |= {f"gain/step_{k}": g for k, g in enumerate(c.gain_mean)}
    else:
        for name in ("turning_points", "nfe/complete", "reward/ode_mean"):
            out.pop(name)
        if not out["nfe/ode_reference"]:  # the ODE reference costs what it costs, step rewards or not
            out.pop("nfe/ode_reference")
    if draw is not None:
        out["curriculum/seen"] = draw.seen
        out["curriculum/zero_spread"] = draw.zero_spread
        out["curriculum/weight_max"] = draw.weight_max
    stages = {"rollout": rollout, "score": rewards, "credit": credit, "update": update}
    stages |= {"complete": clean} if isinstance(clean, CompleteResult) else {}
    out |= {f"seconds/{name}": result.seconds for name, result in stages.items()}
    out |= {f"memory/{name}_gib": r.peak_memory_gib for name, r in stages.items() if r.peak_memory_gib is not None}
    return {k: float(v) for k, v in out.items() if isinstance(v, int | float) and math.isfinite(float(v))}


def iteration_row(iteration: int, rewards: ScoreResult, update: UpdateResult) -> dict[str, Any]:
    """One row of the run's reward table (console, Prefect artifact)."""
    u = update.stats
    return {
        "iteration": iteration,
        "reward_mean": rewards.reward_mean,
        "reward_strict": rewards.reward_strict,
        "ode_reward_mean": rewards.ode_reward_mean,
        "group_reward_std": rewards.group_reward_std,
        **{
            k: getattr(u, k)
            for k in ("loss", "clip_frac", "approx_kl", "signal_cosine", "signal_cosine_window", "lora_distance")
        },
    }
