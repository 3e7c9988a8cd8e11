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

import torch

from stepgrpo.config import CODE_SALT, Config, digest_of
from stepgrpo.errors import StageError
from stepgrpo.loops import judging, training, workspace
from stepgrpo.loops.sampling import stored_noise
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import QualityResult
from stepgrpo.storage.errors import StorageError
from stepgrpo.storage.publish import read_json, seal, write_file_atomic
from stepgrpo.storage.run import Run
from stepgrpo.storage.schema import completion_stage
from stepgrpo.tasks.base import stage_task, warn
from stepgrpo_core.credit import SCHEMES
from stepgrpo_core.quality import step_table, true_values

QUALITY_DIR = Run.QUALITY_DIR
VERSION = "1"  # bumped when the check computes other numbers from the same inputs (part of its key)


@stage_task("credit_quality")
def credit_quality(
    run: Run,
    cfg: Config,
    iteration: int,
    continuations: int,
    schemes: list[str],
    seed: int = 0,
    methods: list[str] | None = None,
) -> QualityResult:
    """The credit-quality check of `iteration` with `continuations` per state for `schemes`, on the
    run's own step rewards and on those of each other completion method in `methods`."""
    return execute(run, cfg, iteration, continuations, schemes, seed, methods)


def key_of(
    run: Run,
    cfg: Config,
    iteration: int,
    continuations: int,
    schemes: list[str],
    seed: int,
    methods: list[str] | None = None,
) -> str:
    """Everything the check reads (module doc), as one digest; loads no model."""
    identity = workspace.reward_identity(cfg.reward)
    rollout = run.stage_manifest(iteration, "rollout") or {}
    setup = judging.scheme_setup(cfg, schemes)
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
    if methods:  # a check of the run's own rewards keeps the key it had before methods could be judged
        parts["methods"] = list(methods)
    if cfg.sampler.branches():  # continued under the branched policy (`judging.continuations`)
        parts["continued"] = "branched"
    if cfg.sampler.branch_tree is not None:  # continued with the kernel at the tree's stochastic steps alone
        parts["continued"] = "tree" if cfg.sampler.tree_sde is None else f"tree {cfg.sampler.tree()}"
    return digest_of(parts)


def record_path(run: Run, iteration: int, key: str) -> Path:
    return run.record_path(QUALITY_DIR, f"iter_{iteration}-{key[:16]}")


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


def execute(
    run: Run,
    cfg: Config,
    iteration: int,
    continuations: int,
    schemes: list[str],
    seed: int = 0,
    methods: list[str] | None = None,
) -> QualityResult:
    judging.check_continuations(continuations)
    if run.stage_manifest(iteration, "rollout") is None:
        raise StageError(f"run {run.run_id} has no published rollout at iteration {iteration}")
    methods = judging.methods_to_judge(cfg, methods)
    key = key_of(run, cfg, iteration, continuations, schemes, seed, methods)
    path = run.inside(record_path(run, iteration, key))
    found = read(run, path, key)
    if found is not None:
        return found
    result = compute(run, cfg, iteration, continuations, schemes, seed, key, methods)
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
    run: Run,
    cfg: Config,
    iteration: int,
    continuations: int,
    schemes: list[str],
    seed: int,
    key: str,
    methods: list[str] | None = None,
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
    pol = workspace.policy_at(run, cfg, iteration)
    prompts = stored_prompts(run)
    reward = workspace.reward(cfg.reward)
    # the run's own step rewards, then each other completion method's on the same states
    grids = {cfg.completion.method: rewards}
    B = int(rewards.shape[0])
    stored = run.stage_manifest(iteration, completion_stage(cfg.completion.method)) if cfg.completion.method else None
    cost = {str(cfg.completion.method): {"nfe_per_trajectory": (stored["attrs"]["nfe"] / B) if stored else 0.0}}
    for method in [m for m in methods or [] if m != cfg.completion.method]:
        t = time.perf_counter()
        grids[method], nfe = judging.method_rewards(pol, cfg, reward, data, prompts, method, rewards[:, -1])
        cost[method] = {"nfe_per_trajectory": nfe / B, "seconds": time.perf_counter() - t}
    branch = judging.branch_steps(cfg, data.log_probs)
    branch_t = torch.from_numpy(branch) if branch is not None else None
    tables, skipped = judging.judged_tables(cfg, schemes, grids, group_ids, training.trained_mask(cfg), branch_t)
    judged = list(tables)

    noise = stored_noise(data.kernel_params, pol.device)
    partial = partial_dir(run, key)
    partial.mkdir(parents=True, exist_ok=True)

    def save(k: int, done: torch.Tensor) -> None:
        write_file_atomic(
            partial / f"k{k}.json", json.dumps(seal({"key": key, "k": k, "rewards": done.tolist()})).encode()
        )

    finals, nfe = judging.continuations(
        pol,
        cfg,
        reward,
        data,
        prompts,
        noise,
        rewards[:, -1],
        continuations,
        (cfg.run.seed, "credit-quality", iteration, seed),
        lambda k: read_partial(partial / f"k{k}.json", key, k, (B, continuations)),
        save,
    )
    t1 = time.perf_counter()
    tv = true_values(finals)
    own = rewards if bool(torch.isfinite(rewards).all()) else rewards[:, -1:].expand_as(rewards)
    steps = step_table(own, tv, tables, group_ids, trained)
    gradient, rows = judging.judge_gradients(pol, cfg, data, prompts.texts, tables, tv, group_ids, noise, seed)
    t2 = time.perf_counter()
    return QualityResult(
        key=key,
        iteration=iteration,
        continuations=continuations,
        seed=seed,
        reward_name=identity["name"],
        reward_version=identity["version"],
        trajectories=B,
        groups=int(torch.unique(group_ids).numel()),
        trained_steps=trained,
        schemes=judged,
        skipped=skipped,
        steps=judging.finite(steps),
        gradient=judging.finite(gradient),
        values=tv.value.tolist(),
        value_halves=tv.halves.tolist(),
        nfe=nfe,
        score_rows=rows,
        seconds=t2 - t0,
        seconds_continuations=t1 - t0,
        seconds_gradient=t2 - t1,
        methods=cost if methods else None,
    )
