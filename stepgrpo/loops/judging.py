"""The computations of the credit-quality check (`stepgrpo.tasks.quality`): step rewards of a stored
iteration by any completion method, the Monte-Carlo continuations of its states, and the per-row
LoRA scores of the gradient check. METHODS.md, "Judging credit".

Shapes: `B` trajectories, `T` steps, `M` continuations, `C, H, W` latent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stepgrpo.errors import StageError
from stepgrpo.loops.sampling import complete_chunks, encode, generator, stored_predictions
from stepgrpo.loops.scoring import decode_distinct, reward_images, score_images
from stepgrpo.reporting.report import track
from stepgrpo_core.completions import completed_through
from stepgrpo_core.conditioning import take
from stepgrpo_core.credit import SCHEMES, assign, reads_branch, reads_tree
from stepgrpo_core.loss import step_weights
from stepgrpo_core.quality import GradientSums, TrueValues, continue_states, gradient_check, true_advantages
from stepgrpo_core.rollout import step_log_prob

if TYPE_CHECKING:
    from stepgrpo.config import Config
    from stepgrpo.policy import Policy


def window_of(data: Any, num_steps: int) -> tuple[int, int]:
    """The stored rollout's SDE window `(start, end)`."""
    start, size = data.kernel_params.get("window", [0, num_steps])
    return int(start), int(start) + int(size)


def method_rewards(
    pol: Policy | None,
    cfg: Config,
    reward: Any,
    data: Any,
    prompts: Any,
    method: str,
    finals: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """The step rewards `[B, T+1]` fp64 of the stored states `data` completed by `method` and scored
    with `reward`, as the complete and score stages would give them (the states the method does not
    complete, and `x_T`, get the stored final rewards `finals [B]`), and the transformer rows it cost.
    `pol` is used only when the method calls the model (`rollout` with stored velocities does not)."""
    B, T1 = data.states.shape[:2]
    T = T1 - 1
    through = completed_through(method, window_of(data, T)[1], T)
    sigmas = torch.from_numpy(data.sigmas)
    if (done := stored_predictions(method, data, through)) is not None:
        latents, nfe = done.latents.numpy(), 0
    else:
        assert pol is not None, f"completion {method!r} needs the policy"
        parts, nfe = [], 0
        for _, out in complete_chunks(
            pol, method, data.states, sigmas, prompts.texts, data.prompt_ids, max(1, cfg.model.max_batch), through
        ):
            parts.append(out.latents.cpu().numpy())
            nfe += out.nfe
        latents = np.concatenate(parts)
    flat = latents[:, :through].reshape(-1, *latents.shape[2:])
    decoder = pol.decoder if pol is not None else _decoder(cfg)
    images = torch.from_numpy(decode_distinct(decoder, flat, max(1, cfg.model.max_batch), ""))
    pids = np.repeat(data.prompt_ids, through)
    out = score_images(
        reward, images, prompts.texts_of(pids), prompts.metadata_of(pids), len(images), decoder.device, ""
    )
    grid = finals.double()[:, None].expand(B, T1).clone()
    grid[:, :through] = out.scores.double().reshape(B, through)
    return grid, nfe


def _decoder(cfg: Config) -> Any:
    from stepgrpo.loops import workspace

    return workspace.decoder(cfg.model)


def continuations(
    pol: Policy,
    cfg: Config,
    reward: Any,
    data: Any,
    prompts: Any,
    noise: float | torch.Tensor,
    finals: torch.Tensor,
    m: int,
    seeds: tuple[Any, ...],
    done: Callable[[int], torch.Tensor | None],
    save: Callable[[int, torch.Tensor], None],
) -> tuple[torch.Tensor, int]:
    """Final rewards `[B, T+1, M]` of `m` SDE continuations of every stored state inside the SDE
    window (the states from its end on evolve deterministically: their entries are `finals [B]`,
    `R_T`), and their transformer rows. State `k`'s rewards `[B, M]` are read back with `done(k)`
    when a stopped check finished them (their rows counted as computed), else computed and kept
    with `save(k, ...)`. Chunk `b0` of state `k` draws from `generator(*seeds, k, b0)`.

    A branched run (`sampler.branch_window`, `branch_anchor`) is continued under its own policy: a trajectory's one
    stochastic step is its group's branch step `b` (`branch_steps`), so its states up to `b` are
    continued with the kernel at `b` alone and the ODE elsewhere, and its states after `b` are
    deterministic (`R_T`). A tree run (`sampler.branch_tree`) likewise: the kernel at its stochastic
    steps alone (its splits and `sampler.tree_sde`), the states after the last deterministic."""
    B, T1 = data.states.shape[:2]
    T = T1 - 1
    start, end = window_of(data, T)
    branch = branch_steps(cfg, data.log_probs)
    tree = cfg.sampler.tree()
    splits = [int(s) for s, _ in tree] if tree is not None else None
    sigmas = torch.from_numpy(data.sigmas).to(pol.device)
    cond = encode(pol, prompts.texts, data.prompt_ids)
    out = finals.double()[:, None, None].expand(B, T1, m).clone()
    rows_per_call = max(1, cfg.model.max_batch // m)  # trajectories a call continues, m times each
    nfe0, read_back = pol.nfe, 0
    for k in track(range(end), "continue"):
        parts = continued_rows(k, B, (start, end - start), branch, splits)
        found = done(k)
        if found is not None:
            out[:, k] = found
            read_back += sum(len(r) for r, _ in parts) * m * (T - k)  # what computing them cost (a CFG pair once)
            continue
        for todo, window in parts:
            for c0 in range(0, len(todo), rows_per_call):
                rows = torch.from_numpy(todo[c0 : c0 + rows_per_call])
                reps = rows.repeat_interleave(m)  # trajectory of each continuation
                x = torch.from_numpy(data.states[rows.numpy(), k]).to(pol.device, pol.dtype).repeat_interleave(m, 0)
                gen = generator(*seeds, k, int(rows[0]), device=pol.device)
                x_T = continue_states(
                    pol.velocity, x, sigmas, k, take(cond, reps), data.kernel, noise, window, gen, sde_steps=splits
                )
                images = reward_images(pol.decoder, x_T)[0]
                pids = data.prompt_ids[reps.numpy()]
                scored = score_images(
                    reward, images, prompts.texts_of(pids), prompts.metadata_of(pids), len(images),
                    pol.decoder.device, "",
                )  # fmt: skip
                out[rows, k] = scored.scores.double().reshape(len(rows), m)
        save(k, out[:, k])
    return out, pol.nfe - nfe0 + read_back


def continued_rows(
    k: int, rows: int, window: tuple[int, int], branch: np.ndarray | None, splits: list[int] | None
) -> list[tuple[np.ndarray, tuple[int, int]]]:
    """The rows continued from state `k`, each part with its SDE window: every row in the run's
    window; a branched run's rows up to their branch step, each branch step's rows with that step
    alone; a tree's every row while a stochastic step is left (its continuations take them)."""
    if splits is not None:
        return [(np.arange(rows), window)] if any(s >= k for s in splits) else []
    if branch is not None:
        return [(np.flatnonzero(branch == b), (int(b), 1)) for b in np.unique(branch[branch >= k])]
    return [(np.arange(rows), window)]


def branch_steps(cfg: Config, log_probs: np.ndarray) -> np.ndarray | None:
    """A branched run's branch step of each stored trajectory `[B]` (the one step with a density in
    its stored `log_probs [B, T]`), None for any other run. A trajectory with no such step, or
    several, is refused."""
    from stepgrpo_core.branching import branch_steps_of

    if not cfg.sampler.branches():
        return None
    try:
        return branch_steps_of(torch.from_numpy(np.asarray(log_probs))).numpy()
    except ValueError as err:
        raise StageError(str(err)) from None


def gradient_sums(
    pol: Policy,
    cfg: Config,
    data: Any,
    texts: Any,
    tables: Mapping[str, torch.Tensor],
    group_ids: torch.Tensor,
    trained: list[int],
    noise: float | torch.Tensor,
) -> tuple[dict[str, torch.Tensor], int]:
    """Per-group sums of `A s` for every table, from one LoRA score per trained row (`GradientSums`)."""
    from stepgrpo.loops.batching import update_velocity

    params = pol.trainable_parameters()
    velocity = update_velocity(pol, cfg.optim.detach_uncond)  # the velocity the update differentiates
    sums = GradientSums(dict(tables), group_ids, sum(p.numel() for p in params))
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


def finite(obj: Any) -> Any:
    """`obj` with NaN / inf numbers as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def scheme_setup(cfg: Config, schemes: list[str]) -> dict[str, dict[str, Any]]:
    """Each judged scheme's options: the run's own for its scheme, else the scheme's defaults."""
    return {s: dict(cfg.credit.options) if s == cfg.credit.scheme else {} for s in schemes}


def judged_tables(
    cfg: Config,
    schemes: list[str],
    grids: dict[str | None, torch.Tensor],
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    branch: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each scheme's advantages `[B, T]` (clipped as the loss clips them) from each method's step
    rewards `grids` (the run's own method first, named by the scheme alone; another method's as
    `scheme:method`); a scheme that reads only `R_T` is judged once. `branch [B]`: a branched run's
    branch steps (`branch_steps`). Also what was skipped, with why."""
    tables, skipped, tree = {}, [], cfg.sampler.tree()
    for method, rewards in grids.items():
        step_rewards = bool(torch.isfinite(rewards).all())
        grid = rewards if step_rewards else rewards[:, -1:].expand_as(rewards)  # final-only runs: R_T everywhere
        for s, options in scheme_setup(cfg, schemes).items():
            reads_steps = SCHEMES.facts(s)["step_rewards"]
            if method != cfg.completion.method and not reads_steps:
                continue  # the same advantages as with the run's own rewards
            if reads_steps and not step_rewards:
                skipped.append(f"{s}: needs a reward for every state; this run was scored on final samples only")
                continue
            if reads_tree(s) and tree is None:
                skipped.append(f"{s}: credits a tree rollout's nodes; this run's rollout is no tree")
                continue
            if reads_branch(s) and branch is None:
                skipped.append(f"{s}: compares siblings that share a branch step; this run's rollout does not branch")
                continue
            adv = assign(s, grid.float(), group_ids, mask, tree, branch, **options).advantages.double()
            name = s if method == cfg.completion.method else f"{s}:{method}"
            tables[name] = adv.clamp(-cfg.optim.adv_clip, cfg.optim.adv_clip)
    return tables, skipped


def methods_to_judge(cfg: Config, requested: list[str] | None) -> list[str] | None:
    """The completion methods a check judges beside the run's own (validated, in order, without
    repeats); None when it is the run's own alone (the check as it was before methods)."""
    from stepgrpo_core.completions import validate_method

    names = [validate_method(m) for m in dict.fromkeys(requested or [])]
    return names if [m for m in names if m != cfg.completion.method] else None


def schemes_to_judge(requested: list[str] | None) -> list[str]:
    """The schemes a check judges: `requested` (validated), or every registered scheme."""
    names = requested or SCHEMES.names()
    for s in names:
        SCHEMES.validate(s)
    return list(dict.fromkeys(names))


TRUTH = ("true", "true_a", "true_b")  # A* and its two halves' tables
BOOTSTRAP_DRAWS = 2000


def judge_gradients(
    pol: Policy,
    cfg: Config,
    data: Any,
    texts: list[str],
    tables: dict[str, torch.Tensor],
    tv: TrueValues,
    group_ids: torch.Tensor,
    noise: Any,
    seed: int,
) -> tuple[dict[str, Any], int]:
    """Each scheme's batch gradient against the true advantages' (and each half's), with uniform and
    with `noise` step weighting (`{"uniform" | "noise": {reliability, half_cosine, rows}}`), and the
    number of LoRA score rows it took."""
    trained = cfg.trained_steps()
    weights = step_weights("noise", data.kernel, torch.from_numpy(data.sigmas), noise, trained)
    w = torch.zeros(len(data.sigmas) - 1, dtype=torch.float64)  # [T]
    w[trained] = weights.double()
    truth = {name: true_advantages(v) for name, v in zip(TRUTH, (tv.value, *tv.halves))}
    plain = {**truth, **tables}
    weighted = {f"{name}@noise": t * w for name, t in plain.items()}
    sums, rows = gradient_sums(pol, cfg, data, texts, plain | weighted, group_ids, trained, noise)
    judged = list(tables)
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
    return gradient, rows


def check_continuations(continuations: int) -> None:
    """M continuations split into two halves: an even number >= 2."""
    if continuations < 2 or continuations % 2:
        raise StageError(f"--continuations must be an even number >= 2 (two halves); got {continuations}")
