"""The credit-quality stage: each scheme's advantages and gradient against Monte-Carlo true
advantages of one stored iteration (METHODS.md, "Judging credit"; `stepgrpo_core.quality`).

Under the policy the iteration was sampled with, every stored state `x_k` inside the SDE window is
continued `M` times with the policy's own kernel (fresh seeds, recorded), and the continuations'
final images are scored with the run's reward: `V(x_k)` and `A*_k`. Every scheme (the registry's,
plug-ins included) turns the iteration's stored rewards into advantages as the credit stage does.
Per-row LoRA scores of the trained rows then give each scheme's batch gradient, compared with the
true-advantage gradient, with uniform and with `noise` step weighting.

Stored as one sealed JSON record per check, `credit_quality/iter_<k>-<key>.json` (the key covers
everything the check reads: the rollout, the policy, the stored rewards, the reward model, `M`,
the seed, the schemes and their versions and options, the trained steps), so a stored check is
reused, and a damaged one is set aside and computed again. The continuations, most of the cost,
are kept state by state while the check runs (`credit_quality/.partial-<key>/k<k>.json`, sealed):
a stopped check resumes at the first state it had not finished, and the folder goes when the
record is published.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stepgrpo.config import CODE_SALT, Config, digest_of
from stepgrpo.errors import StageError
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import encode, generator, stored_noise
from stepgrpo.loops.scoring import reward_images, score_images
from stepgrpo.prompts import stored_prompts
from stepgrpo.reporting.report import track
from stepgrpo.results import QualityResult
from stepgrpo_core.conditioning import take
from stepgrpo_core.credit import SCHEMES, assign
from stepgrpo_core.loss import step_weights
from stepgrpo_core.quality import (
    GradientSums,
    continue_states,
    gradient_check,
    step_table,
    true_advantages,
    true_values,
)
from stepgrpo_core.rollout import step_log_prob
from storage.errors import StorageError
from storage.publish import read_json, seal, write_file_atomic
from storage.run import Run
from tasks.base import stage_task, warn
from tasks.credit import trained_mask

QUALITY_DIR = Run.QUALITY_DIR
TRUTH = ("true", "true_a", "true_b")  # A* and its two halves' tables
BOOTSTRAP_DRAWS = 2000
VERSION = "1"  # bumped when the check computes other numbers from the same inputs (part of its key)


if TYPE_CHECKING:
    from stepgrpo.policy import Policy


@stage_task("credit_quality")
def credit_quality(
    run: Run, cfg: Config, iteration: int, continuations: int, schemes: list[str], seed: int = 0
) -> QualityResult:
    """The credit-quality check of `iteration` with `continuations` per state for `schemes`."""
    return execute(run, cfg, iteration, continuations, schemes, seed)


def scheme_setup(cfg: Config, schemes: list[str]) -> dict[str, dict[str, Any]]:
    """Each judged scheme's options: the run's own for its scheme, else the scheme's defaults."""
    return {s: dict(cfg.credit.options) if s == cfg.credit.scheme else {} for s in schemes}


def key_of(run: Run, cfg: Config, iteration: int, continuations: int, schemes: list[str], seed: int) -> str:
    """Everything the check reads (module doc), as one digest; loads no model."""
    identity = workspace.reward_identity(cfg.reward)
    rollout = run.stage_manifest(iteration, "rollout") or {}
    setup = scheme_setup(cfg, schemes)
    parts = {
        "stage": "credit_quality",
        "iteration": iteration,
        "rollout": rollout.get("digest"),
        "rollout_key": rollout.get("inputs", {}).get("key"),  # the policy it was sampled with
        "rewards": run.tables.rewards_digest(iteration, identity["name"], identity["version"]),
        "reward": identity,
        "continuations": continuations,
        "seed": seed,
        "schemes": {s: [SCHEMES.facts(s)["version"], setup[s]] for s in schemes},
        "trained": cfg.trained_steps(),
        "adv_clip": cfg.optim.adv_clip,
        "detach_uncond": cfg.optim.detach_uncond,
        "salt": CODE_SALT,
        "version": VERSION,
    }
    return digest_of(parts)


def record_path(run: Run, iteration: int, key: str) -> Path:
    return Path(run.path) / QUALITY_DIR / f"iter_{iteration}-{key[:16]}.json"


def read(run: Run, path: Path, key: str) -> QualityResult | None:
    """The stored check at `path` if it is there, intact and made under `key`; a damaged one is set aside."""
    if not path.is_file():
        return None
    try:
        found = QualityResult.model_validate(read_json(path, "credit-quality record"))  # checks its seal
    except (ValueError, StorageError):
        warn(f"{path} is damaged; kept aside as {run.set_aside_file(path).name}, checking again")
        return None
    return found if found.key == key else None


def check_continuations(continuations: int) -> None:
    """M continuations split into two halves: an even number >= 2."""
    if continuations < 2 or continuations % 2:
        raise StageError(f"--continuations must be an even number >= 2 (two halves); got {continuations}")


def execute(
    run: Run, cfg: Config, iteration: int, continuations: int, schemes: list[str], seed: int = 0
) -> QualityResult:
    check_continuations(continuations)
    if run.stage_manifest(iteration, "rollout") is None:
        raise StageError(f"run {run.run_id} has no published rollout at iteration {iteration}")
    key = key_of(run, cfg, iteration, continuations, schemes, seed)
    path = run.inside(record_path(run, iteration, key))
    found = read(run, path, key)
    if found is not None:
        return found
    result = compute(run, cfg, iteration, continuations, schemes, seed, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = seal(result.model_dump(mode="json", exclude_none=True))
    write_file_atomic(path, (json.dumps(record) + "\n").encode())
    shutil.rmtree(partial_dir(run, key), ignore_errors=True)
    return result


def partial_dir(run: Run, key: str) -> Path:
    """Where a running check keeps the continuations of the states it finished."""
    return run.inside(Path(run.path) / QUALITY_DIR / f".partial-{key[:16]}")


def read_partial(path: Path, key: str, k: int, shape: tuple[int, int]) -> torch.Tensor | None:
    """State `k`'s stored continuation rewards `[B, M]`, if intact and made under `key`."""
    if not path.is_file():
        return None
    try:
        found = read_json(path, "partial credit-quality record")
        rewards = torch.tensor(found["rewards"], dtype=torch.float64)
    except (StorageError, KeyError, TypeError, ValueError):
        return None
    return rewards if found.get("key") == key and found.get("k") == k and tuple(rewards.shape) == shape else None


def compute(
    run: Run, cfg: Config, iteration: int, continuations: int, schemes: list[str], seed: int, key: str
) -> QualityResult:
    t0 = time.perf_counter()
    identity = workspace.reward_identity(cfg.reward)
    rewards = run.tables.reward_grid(iteration, identity["name"], identity["version"]).double()  # [B, T+1]
    if not bool(torch.isfinite(rewards[:, -1]).all()):
        raise StageError(
            f"iteration {iteration} has no {identity['name']} reward for some final samples: score it first"
        )
    data = run.stages.read_rollout(iteration)
    group_ids = torch.from_numpy(data.group_ids).long()
    trained = cfg.trained_steps()
    mask = trained_mask(cfg)
    tables, skipped = {}, []
    step_rewards = bool(torch.isfinite(rewards).all())
    grid = rewards if step_rewards else rewards[:, -1:].expand_as(rewards)  # final-only runs: R_T everywhere
    for s, options in scheme_setup(cfg, schemes).items():
        if SCHEMES.facts(s)["step_rewards"] and not step_rewards:
            skipped.append(f"{s}: needs a reward for every state; this run was scored on final samples only")
            continue
        adv = assign(s, grid.float(), group_ids, mask, **options).advantages.double()
        tables[s] = adv.clamp(-cfg.optim.adv_clip, cfg.optim.adv_clip)  # as the loss clips them
    judged = list(tables)

    pol = workspace.policy_at(run, cfg, iteration)
    noise = stored_noise(data.kernel_params, pol.device)
    finals, nfe = _continuations(run, cfg, pol, iteration, data, rewards, noise, continuations, seed, key)
    t1 = time.perf_counter()
    tv = true_values(finals)
    steps = step_table(grid, tv, tables, group_ids, trained)
    weights = step_weights("noise", data.kernel, torch.from_numpy(data.sigmas), noise, trained)
    w = torch.zeros(rewards.shape[1] - 1, dtype=torch.float64)
    w[trained] = weights.double()
    truth = {
        "true": true_advantages(tv.value),
        "true_a": true_advantages(tv.halves[0]),
        "true_b": true_advantages(tv.halves[1]),
    }
    plain = {**truth, **tables}
    weighted = {f"{name}@noise": t * w for name, t in plain.items()}
    sums, rows = _gradient_sums(pol, cfg, data, stored_prompts(run).texts, plain | weighted, group_ids, trained, noise)
    gradient = {}
    for suffix, label in (("", "uniform"), ("@noise", "noise")):
        check = gradient_check(
            {name: sums[name + suffix] for name in plain},
            judged,
            truth=TRUTH,
            baseline="outcome" if "outcome" in judged else None,
            draws=BOOTSTRAP_DRAWS,
            seed=seed,
        )
        gradient[label] = {"reliability": check.reliability, "half_cosine": check.half_cosine, "rows": check.rows}
    t2 = time.perf_counter()
    return QualityResult(
        key=key,
        iteration=iteration,
        continuations=continuations,
        seed=seed,
        reward_name=identity["name"],
        reward_version=identity["version"],
        trajectories=int(rewards.shape[0]),
        groups=int(torch.unique(group_ids).numel()),
        trained_steps=trained,
        schemes=judged,
        skipped=skipped,
        steps=_finite(steps),
        gradient=_finite(gradient),
        values=tv.value.tolist(),
        value_halves=tv.halves.tolist(),
        nfe=nfe,
        score_rows=rows,
        seconds=t2 - t0,
        seconds_continuations=t1 - t0,
        seconds_gradient=t2 - t1,
    )


def _continuations(
    run: Run,
    cfg: Config,
    pol: Policy,
    iteration: int,
    data: Any,
    rewards: torch.Tensor,
    noise: float | torch.Tensor,
    m: int,
    seed: int,
    key: str,
) -> tuple[torch.Tensor, int]:
    """Final rewards `[B, T+1, M]` of `m` SDE continuations of every stored state inside the SDE
    window (the states from its end on evolve deterministically: their entries are `R_T`), and
    the continuations' NFEs (a state a stopped call finished is read back, its NFEs counted)."""
    B, T1 = rewards.shape
    T = T1 - 1
    start, size = data.kernel_params.get("window", [0, T])
    end = int(start) + int(size)
    sigmas = torch.from_numpy(data.sigmas).to(pol.device)
    prompts = stored_prompts(run)
    reward = workspace.reward(cfg.reward)
    cond = encode(pol, prompts.texts, data.prompt_ids)
    finals = rewards[:, -1:, None].expand(B, T1, m).clone()
    rows_per_call = max(1, cfg.model.max_batch // m)  # trajectories a call continues, m times each
    nfe0 = pol.nfe
    partial = partial_dir(run, key)
    partial.mkdir(parents=True, exist_ok=True)
    read_back = 0
    for k in track(range(end), f"continue {iteration}"):
        done = read_partial(partial / f"k{k}.json", key, k, (B, m))
        if done is not None:
            finals[:, k] = done
            read_back += B * m * (T - k)  # what computing them cost (a CFG pair counts once)
            continue
        for b0 in range(0, B, rows_per_call):
            rows = torch.arange(b0, min(B, b0 + rows_per_call))
            reps = rows.repeat_interleave(m)  # trajectory of each continuation
            x = torch.from_numpy(data.states[rows.numpy(), k]).to(pol.device, pol.dtype).repeat_interleave(m, 0)
            gen = generator(cfg.run.seed, "credit-quality", iteration, seed, k, b0, device=pol.device)
            x_T = continue_states(
                pol.velocity, x, sigmas, k, take(cond, reps), data.kernel, noise, (int(start), int(size)), gen
            )
            images = reward_images(pol.decoder, x_T)[0]
            pids = data.prompt_ids[reps.numpy()]
            out = score_images(
                reward,
                images,
                prompts.texts_of(pids),
                prompts.metadata_of(pids),
                chunk=len(images),
                device=pol.decoder.device,
                progress="",
            )
            finals[rows, k] = out.scores.double().reshape(len(rows), m)
        record = seal({"key": key, "k": k, "rewards": finals[:, k].tolist()})
        write_file_atomic(partial / f"k{k}.json", json.dumps(record).encode())
    return finals, pol.nfe - nfe0 + read_back


def _gradient_sums(
    pol: Policy,
    cfg: Config,
    data: Any,
    texts: Any,
    tables: dict[str, torch.Tensor],
    group_ids: torch.Tensor,
    trained: list[int],
    noise: float | torch.Tensor,
) -> tuple[dict[str, torch.Tensor], int]:
    """Per-group sums of `A s` for every table, from one LoRA score per trained row (`GradientSums`)."""
    from stepgrpo.loops.training import update_velocity

    params = pol.trainable_parameters()
    velocity = update_velocity(pol, cfg.optim.detach_uncond)  # the velocity the update differentiates
    sums = GradientSums(tables, group_ids, sum(p.numel() for p in params))
    cond = encode(pol, texts, data.prompt_ids)
    states = torch.from_numpy(data.states).to(pol.device, pol.dtype)
    sigmas = torch.from_numpy(data.sigmas).to(pol.device)
    finite = np.isfinite(data.log_probs)
    for b in track(range(states.shape[0]), "scores"):
        one = take(cond, torch.tensor([b]))
        for k in trained:
            if not finite[b, k]:
                continue
            lp = step_log_prob(velocity, states[b : b + 1], sigmas, one, k, data.kernel, noise).log_prob.sum()
            grads = torch.autograd.grad(lp, params, allow_unused=True)
            flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
            sums.add(b, k, flat)
    return sums.sums, sums.rows


def _finite(obj: Any) -> Any:
    """`obj` with NaN / inf numbers as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def schemes_to_judge(requested: list[str] | None) -> list[str]:
    """The schemes a check judges: `requested` (validated), or every registered scheme."""
    names = requested or SCHEMES.names()
    for s in names:
        SCHEMES.validate(s)
    return list(dict.fromkeys(names))
