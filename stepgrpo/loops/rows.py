"""What a row of the update's loss is, by the objective's `rows` fact
(`stepgrpo_core.objectives.OBJECTIVES`): which trajectories an iteration trains, how an optimizer
step's part of them is cut into cells, and the loss of one cell. The loop that takes the parts
through AdamW is one, `stepgrpo.loops.training.update`; it reads these and the registry's facts,
never an objective's name.

- `Transitions` (`rows: transitions`, GRPO): a cell is some trajectories at one trained step k,
  their stored log-probability against the policy's (`_step_loss`). Cells run step by step, each
  step over its micro-batches; a step's weight is `optim.step_weighting`'s.
- `Noised` (`rows: noised`, DiffusionNFT / AWM / DGPO): a cell is some samples at one of their
  grid times, their clean latent `x_T` noised afresh (`MatchingBatch`); the grid times and the
  forward noise are drawn per part from the update's generator (times, then noise). Cells run
  micro-batch by micro-batch, each over its times. With `whole_groups` (DGPO) the parts, the
  micro-batches and each rank's share are whole groups, and a group's rows share their times and
  noise (the draws are per group).

A cell's `weight` makes the part's loss the mean over its rows whatever the micro-batches and
ranks. A `Block` is the cells whose gradient the signal check reads together (per half).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stepgrpo.config import Config
from stepgrpo.loops.batching import micro_batches, update_velocity
from stepgrpo_core.branching import width_pruned
from stepgrpo_core.conditioning import take
from stepgrpo_core.kernels import diffusion_coefficient
from stepgrpo_core.loss import grpo_loss, step_weights
from stepgrpo_core.objectives import OBJECTIVES, MatchingBatch, grid_times, noised, row_advantages
from stepgrpo_core.rollout import step_log_prob

if TYPE_CHECKING:
    from stepgrpo.loops.batching import Batch, DataParallel
    from stepgrpo.policy import Policy


Batches = list[list[torch.Tensor]]  # per half of a part, its micro-batches (trajectory indices)


@dataclass(frozen=True)
class Cell:
    idx: torch.Tensor  # [n] long: trajectories of the batch
    col: int  # the trained step k (transitions), or the column of the part's grid times (noised)
    weight: float  # the cell's share of the part's mean loss
    filler: bool = False  # a sharded update's pass of weight 0, keeping the ranks' passes equal


@dataclass(frozen=True)
class Block:
    key: int | None  # the trained step its cells share (the signal check's per-step energy); None: mixed
    halves: list[list[Cell]]  # the cells of each half of the part (one half outside the signal check)


def shuffled_parts(rows: torch.Tensor, steps: int, generator: torch.Generator) -> list[torch.Tensor]:
    """An inner epoch's trajectories, shuffled by `generator` and split into (at most) `steps`
    non-empty parts, one an optimizer step."""
    order = rows[torch.randperm(len(rows), generator=generator)]
    return [p for p in order.tensor_split(min(steps, max(1, len(order)))) if len(p)]


def group_parts(
    rows: torch.Tensor, group_ids: torch.Tensor, steps: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """As `shuffled_parts`, by whole groups: the groups of `rows` shuffled and split into (at most)
    `steps` parts, each part its groups' rows, group after group."""
    gids = group_ids[rows]
    order = list(dict.fromkeys(gids.tolist()))
    perm = torch.randperm(len(order), generator=generator).tolist()
    members = {g: rows[gids == g] for g in order}
    split = torch.arange(len(order)).tensor_split(min(steps, max(1, len(order))))
    return [torch.cat([members[order[perm[i]]] for i in s.tolist()]) for s in split if len(s)]


def group_batches(part: torch.Tensor, group_ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`part` (whole groups, group after group) in micro-batches of whole groups, as many groups as
    fit in `size` rows (at least one)."""
    gids = group_ids[part]
    out: list[torch.Tensor] = []
    for g in dict.fromkeys(gids.tolist()):
        members = part[gids == g]
        if out and len(out[-1]) + len(members) <= size:
            out[-1] = torch.cat([out[-1], members])
        else:
            out.append(members)
    return out


class Transitions:
    """GRPO's rows: (trajectory, trained step) pairs of the rollout (module doc)."""

    signal_check = True

    def __init__(self, pol: Policy, cfg: Config, batch: Batch, companion: dict | None, keep_zero: bool) -> None:
        self.pol, self.cfg, self.batch = pol, cfg, batch
        # (trajectory, step) pairs with a density: every trajectory at every stochastic step, or, in a
        # branched rollout, each trajectory at its group's branch step alone
        self.has = torch.isfinite(batch.old_log_probs).cpu()
        self.adv = torch.nan_to_num(batch.advantages.float(), nan=0.0)
        self.pruned = 0  # trained transitions a tree's width pruning left out (`optim.width_pruning`)
        if cfg.optim.width_pruning != "off":
            trained = torch.zeros(self.has.shape[1], dtype=torch.bool)
            trained[cfg.trained_steps()] = True
            o, tree, ids = cfg.optim, cfg.sampler.tree() or [], batch.group_ids.cpu()
            kept = width_pruned(self.has & trained, self.adv.cpu(), ids, tree, o.width_pruning, o.width_keep)
            self.pruned = int((self.has & trained).sum() - kept.sum())
            self.has = kept | (self.has & ~trained)
        self.steps = [k for k in cfg.trained_steps() if bool(self.has[:, k].any())]
        steps = cfg.optim.step_weighting, batch.kernel, batch.sigmas, batch.noise, self.steps
        # per-step loss weights, mean 1 over the trained steps (`optim.step_weighting`)
        self.weight = dict(zip(self.steps, step_weights(*steps).tolist()))
        self.velocity = update_velocity(pol, cfg.optim.detach_uncond)
        self.keep_zero = keep_zero

    def trained(self) -> torch.Tensor:
        """The trajectories the update trains: those with an advantage on a trained step they have a
        density at (all of those where zero-advantage samples are kept)."""
        if not self.steps:
            return torch.zeros(0, dtype=torch.long)
        has = self.has[:, self.steps]
        if not self.keep_zero:
            has = has & (self.adv[:, self.steps] != 0).cpu()
        return torch.nonzero(has.any(dim=1)).reshape(-1)

    def parts(self, rows: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        return shuffled_parts(rows, self.cfg.optim.optimizer_steps, generator)

    def split(self, halves: list[torch.Tensor], size: int, parallel: DataParallel | None) -> list[list[torch.Tensor]]:
        return parallel.micro_batches(halves, size) if parallel else micro_batches(halves, size)

    def blocks(self, part: torch.Tensor, batches: Batches, generator: torch.Generator) -> Iterator[Block]:
        # the part's (trajectory, step) pairs with a density: len(part) x steps unless branched
        n = int(self.has[part][:, self.steps].sum())
        for k in self.steps:
            cells = [
                [Cell(i, k, self.weight[k] * len(i) / n) for idx in mine if len(i := idx[self.has[idx, k]])]
                for mine in batches
            ]
            yield Block(k, cells)

    def filler(self, part: torch.Tensor, block: Block) -> Cell:
        """A cell of weight 0 at the block's step (a sharded update's rank with fewer cells runs it)."""
        k = int(block.key)  # type: ignore[arg-type]
        return Cell(part[self.has[part, k]][:1], k, 0.0, filler=True)

    def loss(self, cell: Cell) -> Any:
        b, idx, k = self.batch, cell.idx, cell.col
        return _step_loss(
            self.pol,
            self.velocity,
            self.cfg,
            b.states[idx],
            b.old_log_probs[idx, k],
            self.adv[idx, k],
            take(b.cond, idx),
            b.sigmas,
            k,
            b.kernel,
            b.noise,
        )


class Noised:
    """The flow-matching objectives' rows: (sample, grid time) pairs on `x_T` noised afresh (module doc)."""

    signal_check = False

    def __init__(self, pol: Policy, cfg: Config, batch: Batch, companion: dict | None, keep_zero: bool) -> None:
        u = cfg.update.resolved
        self.pol, self.cfg, self.batch, self.u, self.companion = pol, cfg, batch, u, companion
        self.objective = OBJECTIVES.get(cfg.update.objective)
        self.facts = OBJECTIVES.facts(cfg.update.objective)
        self.options = u["options"]
        self.whole_groups = bool(self.facts["whole_groups"])
        self.x0 = batch.states[:, -1]
        self.adv = torch.nan_to_num(batch.advantages.float(), nan=0.0)
        self.velocity = update_velocity(pol, cfg.optim.detach_uncond)
        needs_ref = self.facts["needs_ref"]
        self.wants_ref = needs_ref is True or (needs_ref == "kl" and float(self.options.get("kl_beta", 0.0)) > 0)
        self.keep_zero = keep_zero
        self.draws: dict[str, torch.Tensor] = {}

    def trained(self) -> torch.Tensor:
        """The samples the update trains: all where zero-advantage samples are kept, else those
        with an advantage (with whole groups: the groups with one)."""
        if self.keep_zero:
            return torch.arange(len(self.adv))
        has = (self.adv != 0).any(dim=1)
        if self.whole_groups:
            g = self.batch.group_ids
            has = torch.isin(g, g[has])
        return torch.nonzero(has).reshape(-1)

    def parts(self, rows: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
        steps = self.cfg.optim.optimizer_steps
        if self.whole_groups:
            return group_parts(rows, self.batch.group_ids, steps, generator)
        return shuffled_parts(rows, steps, generator)

    def split(self, halves: list[torch.Tensor], size: int, parallel: DataParallel | None) -> list[list[torch.Tensor]]:
        if not self.whole_groups:
            return parallel.micro_batches(halves, size) if parallel else micro_batches(halves, size)
        out = [group_batches(h, self.batch.group_ids, size) for h in halves]
        return [parallel.whole(cs) for cs in out] if parallel else out

    def blocks(self, part: torch.Tensor, batches: Batches, generator: torch.Generator) -> Iterator[Block]:
        u, T = self.u, self.adv.shape[1]
        # the units that share a draw: each sample, or each group (its members share times and noise)
        if self.whole_groups:
            gids = self.batch.group_ids[part]
            position = {g: i for i, g in enumerate(dict.fromkeys(gids.tolist()))}  # each group's unit, in order
            unit = torch.tensor([position[g] for g in gids.tolist()])
        else:
            unit = torch.arange(len(part))
        n_units = int(unit.max()) + 1 if len(unit) else 0
        ks = grid_times(str(u["time_rule"]), float(u["times"]), T, n_units, generator, float(u["time_span"]))
        m = ks.shape[1]
        eps = torch.randn((n_units, m, *self.x0.shape[1:]), generator=generator)
        ks, eps = ks[unit], eps[unit]
        self.draws = {"ks": ks, "eps": eps, "adv": row_advantages(self.adv[part], ks)}
        self.where = {int(r): j for j, r in enumerate(part.tolist())}
        cells = [Cell(idx, col, len(idx) / (len(part) * m)) for mine in batches for idx in mine for col in range(m)]
        yield Block(None, [cells])

    def filler(self, part: torch.Tensor, block: Block) -> Cell:
        """A cell of weight 0 (a sharded update's rank with fewer cells runs it): the part's first sample."""
        return Cell(part[:1], 0, 0.0, filler=True)

    def loss(self, cell: Cell) -> Any:
        b, idx, col = self.batch, cell.idx, cell.col
        j = torch.tensor([self.where[int(r)] for r in idx.tolist()])
        c = take(b.cond, idx)
        x0 = self.x0[idx]
        t = b.sigmas[self.draws["ks"][j, col].to(b.sigmas.device)].to(x0.dtype)
        eps = self.draws["eps"][j, col].to(x0.device, x0.dtype)
        x_t = noised(x0, eps, t)
        with torch.no_grad():
            v_old = self._other(x_t, t, c) if self.facts["needs_old"] else None
            v_ema = self._other(x_t, t, c) if self.facts["needs_ema"] else None
            v_ref = None
            if self.wants_ref:
                with self.pol.reference():
                    v_ref = self.pol.velocity(x_t, t, c)
        v = self.velocity(x_t, t, c)
        groups = b.group_ids[idx] if self.whole_groups else None
        a = self.draws["adv"][j, col].to(x0.device)
        out = self.objective(MatchingBatch(x0, eps, t, a, v, v_old, v_ref, v_ema, groups), **self.options)
        return out

    def _other(self, x: torch.Tensor, t: torch.Tensor, c: Any) -> torch.Tensor:
        """The companion adapter's velocity (the trained one restored after), without gradient."""
        from stepgrpo.loops import workspace

        if self.companion is None:
            raise ValueError(f"objective {self.cfg.update.objective!r} needs its companion adapter")
        mine = workspace.lora_state(self.pol)
        workspace.set_lora(self.pol, self.companion)
        try:
            return self.pol.velocity(x, t, c)
        finally:
            workspace.set_lora(self.pol, mine)


ROWS = {"transitions": Transitions, "noised": Noised}  # the objectives' `rows` fact -> its rows


def _step_loss(
    pol: Policy,
    velocity: Any,
    cfg: Config,
    states: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    cond: Any,
    sigmas: torch.Tensor,
    k: int,
    kernel: str,
    noise: Any,
) -> Any:
    """The GRPO loss of step `k` on some trajectories (`states [n, T+1, C, H, W]`, the rest `[n]`)."""
    o = cfg.optim
    out = step_log_prob(velocity, states, sigmas, cond, k, kernel, noise)
    ref_mean = kl_std = None
    if o.kl_beta > 0:
        with torch.no_grad(), pol.reference():
            ref_mean = step_log_prob(pol.velocity, states, sigmas, cond, k, kernel, noise).mean
        # Flow-GRPO's form divides by the diffusion coefficient, the exact KL by the step's std
        kl_std = out.std if o.kl_form == "exact" else diffusion_coefficient(kernel, out.std, sigmas[k], sigmas[k + 1])
    return grpo_loss(
        out.log_prob,
        old_log_prob,
        advantages,
        clip_range=o.clip_range,
        adv_clip=o.adv_clip,
        kl_beta=o.kl_beta,
        mean=out.mean if ref_mean is not None else None,
        ref_mean=ref_mean,
        kl_std=kl_std,
    )
