"""Seeds, conditioning, and the two sampling loops every stage and benchmark shares.

Seeds: everything random in iteration `i` derives from `(run.seed, what, i, ...)` through
`seed_for`, never from a global RNG, so a resumed run draws the same numbers as an uninterrupted
one.

`sample_groups` is the group rollout (GRPO's groups share a prompt and an initial noise): the
rollout stage, the `psi` calibration and the reference loop (`loops.reference`) all sample through it.
`complete_chunks` is the ODE-completion loop of the complete stage and the reference loop.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.reporting.report import track
from stepgrpo_core.conditioning import take

if TYPE_CHECKING:
    from stepgrpo.policy import Policy


def seed_for(*parts: Any) -> int:
    """A 63-bit seed from any JSON-able parts (`seed_for(run_seed, "noise", i, g)`)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little") >> 1


def generator(*parts: Any, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for(*parts))


def encode(pol: Policy, texts: Sequence[str], prompt_ids: np.ndarray) -> Any:
    """Conditioning for every trajectory `[len(prompt_ids)]`, encoding each distinct prompt once."""
    unique, inverse = np.unique(prompt_ids, return_inverse=True)
    cond = pol.encode([texts[int(p)] for p in unique])
    return take(cond, torch.from_numpy(inverse.reshape(-1)).long())


class Plan(NamedTuple):
    """Who samples what in an iteration: trajectories of a group are adjacent."""

    prompt_ids: np.ndarray  # [B] prompt row of each trajectory
    group_ids: np.ndarray  # [B]
    seeds: np.ndarray  # [P] one noise seed per group


def iteration_plan(cfg: Config, splits: Sequence[str], iteration: int, drawn: np.ndarray | None = None) -> Plan:
    """The plan of `iteration`: its groups' prompts are `drawn` (one id per group, the curriculum's
    draw, `stepgrpo.tasks.draw`), or a permutation of the training prompts from `(run.seed, iteration)`;
    the noise derives from `(run.seed, iteration)` alone."""
    train_ids = np.array([i for i, s in enumerate(splits) if s == "train"])
    if len(train_ids) == 0:
        raise StageError("the prompt source has no 'train' prompts to sample")
    P, G = cfg.run.prompts_per_iteration, cfg.run.group_size
    if drawn is not None:
        if len(drawn) != P:
            raise StageError(f"iteration {iteration}: the stored draw holds {len(drawn)} prompts, the run samples {P}")
        chosen = np.asarray(drawn, np.int64)
    else:
        chosen = uniform_prompts(cfg, train_ids, iteration)
    seeds = np.array([seed_for(cfg.run.seed, "noise", iteration, g) for g in range(P)], np.int64)
    return Plan(np.repeat(chosen, G), np.repeat(np.arange(P), G), seeds)


def uniform_prompts(cfg: Config, train_ids: np.ndarray, iteration: int) -> np.ndarray:
    """The uniform draw of `iteration`: `run.prompts_per_iteration` of `train_ids` from a permutation
    seeded by `(run.seed, iteration)` (more than the split holds: the permutation repeats)."""
    pick = torch.randperm(len(train_ids), generator=generator(cfg.run.seed, "prompts", iteration)).numpy()
    return train_ids[np.resize(pick, cfg.run.prompts_per_iteration)]


@dataclass
class GroupChunk:
    """The trajectories of whole groups sampled in one call."""

    rows: np.ndarray  # [n] trajectory indices (whole groups)
    cond: Any  # conditioning of those rows
    sde: Any  # `stepgrpo_core.rollout.Rollout` (states [n, T+1, ...], log_probs, stds)
    ode_final: torch.Tensor | None  # [n, C, H, W] the ODE sample of each group's x_0, repeated per member
    nfe_ode: int  # transformer rows the ODE reference cost


def sample_groups(
    pol: Policy,
    texts: Sequence[str],
    prompt_ids: np.ndarray,
    group_noise: Sequence[tuple[Any, ...]],
    group_size: int,
    sigmas: torch.Tensor,
    *,
    kernel: str,
    noise: float | torch.Tensor,
    sde_seed: Callable[[int], tuple[Any, ...]],
    groups_per_call: int,
    window: tuple[int, int] | None = None,
    ode_reference: bool = False,
    progress: str = "sample",
    groups: range | None = None,
    shared_x0: bool = True,
    ode_solver: str = "euler",
    sde_solver: str | None = None,
    branch_window: tuple[int, int] | None = None,
    branch_tree: list[tuple[int, int]] | None = None,
    branch_anchor: list[int] | None = None,
) -> Iterator[GroupChunk]:
    """Sample `len(group_noise)` groups of `group_size` trajectories, `groups_per_call` at a time.

    Group `g` starts from the noise of `generator(*group_noise[g])`, shared by its members (with
    `shared_x0` False, member `m` draws its own from `generator(*group_noise[g], m)`); the call
    that starts at group `c0` draws its SDE noise from `generator(*sde_seed(c0))`. With
    `ode_reference`, each distinct `x_0` is also sampled by the ODE (one per group when its members
    share it; a deterministic kernel's rollout is that sample already). `ode_solver`: the
    deterministic steps' solver (`ODE_SOLVERS`: `euler`, or `dpm2`, DPM-Solver++ 2M). `sde_solver`:
    a stochastic multistep solver that takes every step instead of `kernel` (`SDE_SOLVERS`:
    `sa_solver`, its tau `noise`), its noise from the same generator. `branch_window`: branched
    rollouts (`stepgrpo_core.branching`; shared `x_0`), group `g` branching at the step drawn from
    `generator(*group_noise[g], "branch")`, its prefix sampled once; `branch_tree`: each group a tree
    (`tree_rollout`; `SamplerConfig.tree`: its splits and other stochastic steps), every node once;
    `branch_anchor`: each group's members branch off its ODE anchor, `G / len(branch_anchor)` at
    each listed step (`anchor_rollout`), the anchor once.
    `groups`: only these groups (a shard's; it starts at a call boundary).
    """
    from stepgrpo_core.branching import anchor_rollout, branched_rollout, draw_branch_steps, tree_rollout
    from stepgrpo_core.kernels import KERNELS
    from stepgrpo_core.rollout import rollout

    G, P = group_size, len(group_noise)
    groups = groups or range(P)
    for c0 in track(range(groups.start, groups.stop, groups_per_call), progress):
        called = range(c0, min(groups.stop, c0 + groups_per_call))
        if shared_x0:
            x0 = torch.cat(
                [
                    pol.initial_noise(1, generator(*group_noise[g], device=pol.device)).expand(G, -1, -1, -1)
                    for g in called
                ]
            )
        else:
            x0 = torch.cat(
                [
                    pol.initial_noise(1, generator(*group_noise[g], m, device=pol.device))
                    for g in called
                    for m in range(G)
                ]
            )
        rows = np.arange(c0 * G, (called[-1] + 1) * G)
        cond = encode(pol, texts, prompt_ids[rows])
        g = generator(*sde_seed(c0), device=pol.device)
        if sde_solver is not None:  # the solver takes every step (the kernel's `ode` leaves them all to it)
            step, kind, deterministic = SDE_SOLVERS[sde_solver](sigmas, float(noise), g), "ode", False
        else:
            step = None if ode_solver == "euler" else ODE_SOLVERS[ode_solver](sigmas)
            kind, deterministic = kernel, bool(KERNELS.facts(kernel)["deterministic"])
        if branch_tree is not None:  # each group a tree, every node once
            sde = tree_rollout(pol.velocity, x0[::G], sigmas, cond, branch_tree, kernel, noise, g)
        elif branch_anchor is not None:  # each group's anchor once, its members off it at the listed steps
            children = G // len(branch_anchor)
            sde = anchor_rollout(pol.velocity, x0[::G], sigmas, cond, branch_anchor, children, kernel, noise, g)
        elif branch_window is not None:  # each group's shared prefix once, then its members' branches
            at = torch.cat([draw_branch_steps(branch_window, 1, generator(*group_noise[c], "branch")) for c in called])
            sde = branched_rollout(pol.velocity, x0[::G], sigmas, cond, G, at, kernel, noise, g, ode_step=step)
        else:
            sde = rollout(
                pol.velocity, x0, sigmas, cond, kernel=kind, noise=noise, window=window, generator=g, ode_step=step
            )
        ode_final, nfe_ode = None, 0
        if ode_reference and deterministic:
            ode_final = sde.states[:, -1]  # the rollout is the ODE's own sample: nothing to recompute
        elif ode_reference:
            before = pol.nfe
            step = G if shared_x0 else 1  # one ODE sample per distinct x_0
            firsts = torch.arange(0, len(rows), step)
            ode = rollout(pol.velocity, x0[::step], sigmas, take(cond, firsts), kernel="ode")
            ode_final, nfe_ode = ode.states[:, -1].repeat_interleave(step, dim=0), pol.nfe - before
        yield GroupChunk(rows, cond, sde, ode_final, nfe_ode)


class _OnGrid:
    """A diffusers multistep scheduler driven on the rollout's grid: its sigmas and timesteps
    replaced by the grid's (`first`: a cap on the first sigma the scheduler reads), stepped in order."""

    def _install(self, scheduler: Any, sigmas: torch.Tensor, first: float | None = None) -> None:
        scheduler.set_timesteps(len(sigmas) - 1)
        self.grid = sigmas.detach().float().cpu().clone()
        self.timesteps = self.grid[:-1] * 1000
        read = self.grid.clone()
        if first is not None:
            read[0] = min(float(read[0]), first)
        scheduler.sigmas, scheduler.timesteps = read, self.timesteps
        scheduler.set_begin_index(0)
        self.scheduler = scheduler

    def _in_order(self, k: int) -> None:
        at = self.scheduler.step_index
        if at is not None and at != k:
            raise ValueError(f"{type(self).__name__} steps in order: expected step {at}, got {k}")


class DPMSolver(_OnGrid):
    """DPM-Solver++ (arXiv 2211.01095) multistep, deterministic, on a flow-matching grid: diffusers'
    `DPMSolverMultistepScheduler` (data prediction `x0 = x - sigma v` from the flow velocity,
    `alpha = 1 - sigma`), its sigmas replaced by the rollout's grid. `order` 2 is DiffusionNFT's
    `dpm2` sampler: first order at the first step and, on grids under 15 steps, at the last two
    (diffusers' `lower_order_final`, as the authors' solver does). One object per rollout call:
    it keeps the previous steps' predictions. `step(k, x_k, v_k) -> x_{k+1}` (`rollout`'s `ode_step`)."""

    def __init__(self, sigmas: torch.Tensor, order: int = 2) -> None:
        from diffusers import DPMSolverMultistepScheduler

        scheduler = DPMSolverMultistepScheduler(
            num_train_timesteps=1000,
            solver_order=order,
            prediction_type="flow_prediction",
            algorithm_type="dpmsolver++",
            use_flow_sigmas=True,
            lower_order_final=True,
            final_sigmas_type="zero",
        )
        self._install(scheduler, sigmas)

    def step(self, k: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._in_order(k)
        sch = self.scheduler
        sch.sigmas = sch.sigmas.to(x.device)
        return sch.step(v.float(), self.timesteps[k], x.float(), return_dict=False)[0]


ODE_SOLVERS = {"euler": None, "dpm2": lambda sigmas: DPMSolver(sigmas, order=2).step}


class SASolver(_OnGrid):
    """SA-Solver (arXiv 2309.05019), the stochastic Adams predictor-corrector AWM samples with, on a
    flow-matching grid: diffusers' `SASolverScheduler` (data prediction `x0 = x - sigma v`,
    `alpha = 1 - sigma`; predictor and corrector of order 2, PEC: one transformer pass a step) with
    the rollout's grid as its sigmas, and AWM's stochasticity `tau(sigma) = tau` on
    `0.3 <= sigma <= 0.9`, 0 elsewhere. As AWM's solver: the solver reads the grid's first sigma
    as at most `1 - 1e-3` (the log-SNR is -inf at 1), and the last step returns the data prediction
    of the last state, `x - sigma v` (its "denoise to zero": the log-SNR is +inf at 0). Unlike it,
    diffusers' corrector acts from the second step on (AWM's skips its first). The stored state
    `x_k` is where `v_k` was evaluated (the predictor's output); the corrector refines it inside
    the solver before the next prediction. The step noise comes from `generator`, so a rollout is
    reproducible; the steps have no density under the policy alone (each depends on the solver's
    history), so only an objective that trains on the final sample uses it. One object per rollout
    call. `step(k, x_k, v_k) -> x_{k+1}` (`rollout`'s `ode_step`)."""

    BAND = (0.3, 0.9)  # AWM's: stochastic where 0.3 <= sigma <= 0.9

    def __init__(self, sigmas: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> None:
        from diffusers import SASolverScheduler

        lo, hi = self.BAND
        scheduler = SASolverScheduler(
            num_train_timesteps=1000,
            predictor_order=2,
            corrector_order=2,
            prediction_type="flow_prediction",
            algorithm_type="data_prediction",
            use_flow_sigmas=True,
            lower_order_final=True,
            tau_func=lambda t: tau if 1000 * lo <= float(t) <= 1000 * hi else 0.0,  # t: the evaluated sigma x 1000
        )
        self._install(scheduler, sigmas, first=1 - 1e-3)
        self.generator = generator

    def step(self, k: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._in_order(k)
        if k == len(self.grid) - 2 and float(self.grid[-1]) == 0:  # the step to sigma 0: the data prediction
            return x.float() - float(self.grid[k]) * v.float()
        return self.scheduler.step(
            v.float(), self.timesteps[k], x.float(), generator=self.generator, return_dict=False
        )[0]


# the stochastic multistep solvers: (grid, tau, generator) -> `rollout`'s ode_step
SDE_SOLVERS = {"sa_solver": lambda sigmas, tau, generator: SASolver(sigmas, tau, generator).step}


def sample_iteration(
    pol: Policy,
    cfg: Config,
    texts: Sequence[str],
    plan: Plan,
    iteration: int,
    noise: float | torch.Tensor,
    groups: range | None = None,
) -> Iterator[GroupChunk]:
    """The rollout of `iteration` (or of its `groups`): its plan's groups on the `cfg.sampler` grid,
    kernel and SDE window, whole groups per call up to `model.max_batch` rows (`groups_per_call`),
    with each distinct initial noise's ODE reference where `sampler.ode_reference` asks for it."""
    from stepgrpo.runtime.sharding import groups_per_call

    G = cfg.run.group_size
    start, end = cfg.sampler.window()
    return sample_groups(
        pol,
        texts,
        plan.prompt_ids,
        [(int(s),) for s in plan.seeds],
        G,
        pol.sigmas(cfg.sampler.steps),
        kernel=cfg.sampler.kernel,
        noise=noise,
        window=(start, end - start),
        sde_seed=lambda c0: (cfg.run.seed, "sde", iteration, c0),
        groups_per_call=groups_per_call(cfg),
        ode_reference=cfg.sampler.ode_reference,
        progress=f"rollout {iteration}",
        groups=groups,
        shared_x0=cfg.sampler.shared_x0,
        ode_solver=cfg.sampler.ode_solver,
        sde_solver=cfg.sampler.sde_solver,
        branch_window=cfg.sampler.branch_window,
        branch_tree=cfg.sampler.tree(),
        branch_anchor=cfg.sampler.branch_anchor,
    )


def complete_chunks(
    pol: Policy,
    method: str,
    states: np.ndarray,
    sigmas: torch.Tensor,
    texts: Sequence[str],
    prompt_ids: np.ndarray,
    max_batch: int,
    through: int,
    progress: str = "complete",
) -> Iterator[tuple[int, Any]]:
    """ODE-complete `states [B, T+1, ...]` (numpy, as stored) `max_batch` trajectories at a time:
    yields `(first row, Completion)`; states from `through` on are `x_T` (`stepgrpo_core.completions`)."""
    from stepgrpo_core.completions import complete

    for c0 in track(range(0, len(states), max_batch), progress):
        rows = slice(c0, c0 + max_batch)
        chunk = torch.from_numpy(states[rows]).to(pol.device, pol.dtype)
        cond = encode(pol, texts, prompt_ids[rows])
        yield c0, complete(method, pol.velocity, chunk, sigmas.to(pol.device), cond, max_batch, through)  # no_grad


def stored_predictions(method: str, data: Any, through: int) -> Any | None:
    """The completion by `method` of the stored rollout `data` (`RolloutData`) from the velocities it
    stored, where the method reuses them (`rollout_velocity`: `rollout`): no model is loaded or called,
    0 NFEs. Rows with equal states and prompt share a completion, as `complete_chunks` gives them.
    None where the method calls the model, or the rollout stored no velocities (made before they were
    kept): complete with the policy then (`complete_chunks`)."""
    from stepgrpo_core.completions import Method, complete

    if not Method.parse(method).facts["rollout_velocity"] or data.velocities is None:
        return None
    keys = [int(p).to_bytes(8, "little", signed=True) for p in data.prompt_ids]
    return complete(
        method,
        None,  # type: ignore[arg-type]  # not called: the velocities are given
        torch.from_numpy(data.states),
        torch.from_numpy(data.sigmas),
        None,
        1,
        through,
        velocities=torch.from_numpy(data.velocities),
        cond_keys=keys,
    )


def stored_noise(kernel_params: dict[str, Any], device: str | torch.device = "cpu") -> float | torch.Tensor:
    """The kernel's `noise` as a stored rollout records it: a float, or the psi table as an fp32 tensor."""
    noise = kernel_params["noise"]
    return torch.tensor(noise, dtype=torch.float32, device=device) if isinstance(noise, list) else float(noise)
