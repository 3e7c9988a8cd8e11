"""The policy update of one iteration, and what a checkpoint holds.

The math (the objectives' losses, the step log-densities) is `stepgrpo_core`'s; what a row of an
objective's loss is, `stepgrpo.loops.rows`'s. This module only loops, the same way for every
objective: over inner epochs, over `optim.optimizer_steps` parts of the trajectories (shuffled by a
generator seeded from the run seed and the iteration), and inside each part over its cells (a
trained step or grid time, on a micro-batch), accumulating one gradient per part (Flow-GRPO
accumulates over the timesteps and half the batch). `micro_batch` bounds memory only.
`Diagnostics` (GRPO's per-step view) and `RowStats` record what the update says about learning.

A checkpoint is data only (safetensors + JSON): the LoRA weights, the AdamW state flattened to
named tensors, the EMA of the LoRA weights when enabled, the torch RNG state, and the iteration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stepgrpo.config import Config
from stepgrpo.loops.batching import (  # noqa: F401  (the update's API, as it was)
    Batch,
    DataParallel,
    flat_params,
    micro_batches,
    update_velocity,
)
from stepgrpo.policy.shards import local_shard

# torch's AdamW keeps per-parameter tensors under these names (plus "step").
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


if TYPE_CHECKING:
    from stepgrpo.policy import Policy


def make_optimizer(params: list[torch.nn.Parameter], cfg: Config, iteration: int = 0) -> torch.optim.AdamW:
    """AdamW at the learning rate of `iteration` (`optim.lr_schedule`)."""
    o = cfg.optim
    # foreach=False: the same arithmetic whatever the parameter count (bit-identical resume)
    return torch.optim.AdamW(params, lr=o.lr_at(iteration), betas=o.betas, weight_decay=o.weight_decay, foreach=False)


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW state as `{"<param index>.<name>": tensor}` (safetensors holds no nested dicts)."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            if hasattr(value, "full_tensor"):  # a sharded update's moment: made whole (every rank calls this)
                value = value.full_tensor().cpu()
            out[f"{idx}.{name}"] = torch.as_tensor(value).detach().clone()
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value.clone()
    params = [p for group in opt.param_groups for p in group["params"]]
    for idx, moments in state.items():  # a sharded update's moments: this rank's shards of the whole ones
        p = params[idx]
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            for name, value in moments.items():
                if value.shape == p.shape and value.dim():
                    moments[name] = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


def ema_update(ema: dict[str, torch.Tensor], weights: Mapping[str, torch.Tensor], decay: float) -> None:
    """`ema = decay * ema + (1 - decay) * weights`, in place."""
    for name, w in weights.items():
        ema[name].mul_(decay).add_(w.detach().to(ema[name].dtype), alpha=1.0 - decay)


def rng_tensor() -> torch.Tensor:
    return torch.random.get_rng_state().clone()


def update(
    pol: Policy,
    opt: torch.optim.Optimizer,
    cfg: Config,
    batch: Batch,
    generator: torch.Generator,
    companion: dict[str, torch.Tensor] | None = None,
    ema: dict[str, torch.Tensor] | None = None,
    initial: Mapping[str, torch.Tensor] | None = None,
    signal: dict[str, torch.Tensor] | None = None,
    parallel: DataParallel | None = None,
) -> dict[str, Any]:
    """One iteration's policy update on `batch` under `update.objective`; returns its diagnostics.

    Args:
        generator: shuffles the trajectories and draws the objective's grid times and noise
            (seeded from the run seed and the iteration).
        companion: the objective's second adapter (`OBJECTIVES` fact `companion`: DiffusionNFT's
            and DGPO's old policy, AWM's KL target), moved in place after every optimizer step.
        ema: the EMA of the LoRA weights, updated in place after every optimizer step.
        initial: the LoRA weights before training (for the distance travelled); None skips it.
        signal: the running sums of the two halves' gradients over past iterations (`accumulate_signal`),
            updated in place; empty or None starts them.
        parallel: this process's rank of a data-parallel update (`DataParallel`); None: one process.

    What a row of the loss is comes from the objective's facts (`stepgrpo.loops.rows`): the rollout's
    transitions at the trained steps (GRPO) or `x_T` noised afresh at grid times (DiffusionNFT, AWM,
    DGPO). Per inner epoch the trained trajectories are shuffled and split into
    `optim.optimizer_steps` parts (of whole groups where the objective reads groups); each AdamW step
    takes the mean gradient over one part's rows (Flow-GRPO accumulates over the timesteps and half
    the batch). Samples whose advantages are all zero are trained or dropped as the objective's
    authors do (`update.zero_advantage` overrides). After each AdamW step the EMA moves, and the
    companion after each step or once after the iteration's last, as its `companion_moves` fact
    says (`companion_update`, the run's optimizer step counting from 1).

    Data-parallel, every rank draws the same order, parts, times and noise; each takes its share of
    the part's micro-batches (`DataParallel.micro_batches`: whole ones where they share out evenly,
    else every `world`-th row; whole groups where the objective reads groups), weighs its loss by the
    whole part's size, and the ranks sum their gradients before clipping: each optimizer step sees
    the gradient the one-process update sees, up to the order of the float sums.
    """
    from stepgrpo.loops.rows import ROWS
    from stepgrpo_core.objectives import companion_update

    o, u = cfg.optim, cfg.update.resolved
    rows_of = ROWS[u["rows"]](pol, cfg, batch, companion, u["keep_zero"])
    rows = rows_of.trained()
    trained = pol.trainable_parameters()
    # by name, what the EMA and the companion follow: a sharded update's local shards
    named = {n: local_shard(p) for n, p in pol.transformer.named_parameters() if p.requires_grad}
    over_ranks = parallel.total if parallel else float  # a sum of this rank's squares, over the ranks' shards
    before = _snapshot(trained)
    dot = parallel.dot if parallel else _dot
    diag = Diagnostics(rows_of.steps, dot) if rows_of.signal_check else RowStats()
    decay = float("nan")
    for epoch in range(o.inner_epochs):
        for pi, part in enumerate(rows_of.parts(rows, generator)):
            first = epoch == 0 and pi == 0
            # The signal check: the first step's trajectories in two halves of whole groups, each
            # half's gradient measured apart (at the same weights, before any optimizer step).
            check = first and o.diagnostics and rows_of.signal_check
            halves = _halves(part, batch.group_ids) if check else [part]
            opt.zero_grad(set_to_none=True)
            batches = rows_of.split(halves, o.micro_batch, parallel)
            for block in rows_of.blocks(part, batches, generator):
                accumulated = []  # after each half (the signal check)
                for cells in block.halves:
                    if parallel:  # a sharded update's ranks run equal passes (filler cells weigh 0)
                        cells = parallel.even(cells, lambda: rows_of.filler(part, block))
                    for cell in cells:
                        out = rows_of.loss(cell)
                        if not bool(torch.isfinite(out.loss)):
                            raise FloatingPointError(
                                f"the update's loss is {float(out.loss)} at step {cell.col} of {len(cell.idx)} rows "
                                f"(optim.lr {o.lr:g}, update.objective {cfg.update.objective}): lower optim.lr"
                            )
                        # the mean over the part's rows, whatever the micro-batches
                        (out.loss * cell.weight).backward()
                        if cell.filler:
                            continue
                        diag.backward_rows += len(cell.idx)
                        diag.add_loss(cell.col, first, len(cell.idx), out, part=len(diag.grad_norms))
                    if check:
                        accumulated.append(parallel.gradient(trained) if parallel else flat_params(trained, grad=True))
                if accumulated and parallel:  # one sum a step, after both halves: the ranks wait once, for equal work
                    accumulated = parallel.across(accumulated)
                for total in accumulated:
                    diag.add_half(total)
                diag.end_step(block.key)
            if parallel:
                parallel.sum_grads(trained)
            diag.grad_norms.append(float(local_shard(torch.nn.utils.clip_grad_norm_(trained, o.max_grad_norm))))
            step_start = _snapshot(trained)
            opt.step()
            diag.update_norms.append(math.sqrt(over_ranks(_squared_distance(trained, step_start))))
            del step_start
            if ema is not None and o.ema_decay is not None:
                ema_update(ema, named, o.ema_decay)
            if companion is not None and u["companion_moves"] == "step":
                decay = companion_update(companion, named, adam_steps(opt), float(u["rate"]), float(u["cap"]))
    if companion is not None and u["companion_moves"] == "iteration" and diag.grad_norms:
        decay = companion_update(companion, named, adam_steps(opt), float(u["rate"]), float(u["cap"]))
    diag.iteration_norm = math.sqrt(over_ranks(_squared_distance(trained, before)))
    del before
    if initial is not None:
        diag.lora_distance = math.sqrt(over_ranks(_squared_distance(trained, [initial[n] for n in named])))
    diag.trained_trajectories = len(rows)
    if parallel:
        diag.gather(parallel)
    out = diag.summary()
    out["backward_rows"] = diag.backward_rows
    if cfg.optim.width_pruning != "off":
        out["width_pruned"] = rows_of.pruned
    if companion is not None:
        out["companion_decay"] = decay
    if signal is not None and len(diag.halves) == 2:
        out.update(accumulate_signal(signal, *diag.halves, dot=dot))
    return out


def adam_steps(opt: torch.optim.Optimizer) -> int:
    """The optimizer steps AdamW has taken over the run (its state's `step`; 0 before the first)."""
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


# The signal check over iterations: each half's gradient is summed across iterations with this
# decay (a window of about 1 / (1 - decay) = 20 iterations). One iteration's cosine is noisy (its
# halves hold few trajectories); a direction the batches keep agreeing on adds up linearly in the
# sums while noise adds up as a square root, so the cosine of the sums rises when the recipe has a
# signal and stays near 0 when it follows noise.
SIGNAL_DECAY = 0.95


def accumulate_signal(
    signal: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor, dot: Any = None
) -> dict[str, float]:
    """`signal["a"|"b"] = decay * signal + half gradient`, `signal["n"]` counts iterations; returns
    `signal_cosine_window` (the cosine of the two sums) and `signal_iterations`."""
    for name, g in (("a", a), ("b", b)):
        prev = signal.get(name)
        signal[name] = g.float().cpu() if prev is None else prev.mul(SIGNAL_DECAY).add(g.float().cpu())
    signal["n"] = signal.get("n", torch.zeros((), dtype=torch.int64)) + 1
    cosine = _cosine(signal["a"], signal["b"], dot or _dot)
    return {"signal_cosine_window": cosine, "signal_iterations": float(signal["n"])}


def _halves(part: torch.Tensor, group_ids: torch.Tensor) -> list[torch.Tensor]:
    """`part` (trajectory indices) as two disjoint halves of whole groups, in order of first
    appearance; a part of one group is split by trajectories. Fewer than 2 rows: one half."""
    if len(part) < 2:
        return [part]
    groups = group_ids[part.cpu()]
    order = list(dict.fromkeys(groups.tolist()))
    if len(order) < 2:
        return [part[: len(part) // 2], part[len(part) // 2 :]]
    first = torch.tensor([g in set(order[: len(order) // 2]) for g in groups.tolist()], device=part.device)
    return [part[first], part[~first]]


class Diagnostics:
    """What one update says about learning (METHODS.md, "Learning diagnostics").

    Per trained step `k` and phase (`first`: the first optimizer step, on-policy; `later`: the
    rest): the clip fraction and the fraction of trajectories the clip gives zero gradient; the same
    two per optimizer step of the iteration (`*_by_part`: part 0 is on-policy, so 0 there). From
    the first optimizer step: each step's share of the gradient energy `|g_k|^2 / sum_j |g_j|^2`
    and the signal check, the cosine between the gradients of two disjoint halves (whole groups)
    of its trajectories: near 0 means the batch gradient is noise (`accumulate_signal` sums the
    halves over iterations, where a weak but real direction shows). Ratio mean / std / range over
    every row; the norm of each optimizer step's change and the LoRA's distance from its start.
    """

    def __init__(self, steps: Sequence[int], dot: Any = None) -> None:
        self.dot = dot or _dot  # a sharded update's vectors are shards: their dot products are summed over ranks
        self.steps = list(steps)
        self.rows: dict[tuple[int, bool], float] = {}
        self.sums: dict[str, dict[tuple[int, bool], float]] = {"clip_frac": {}, "zero_grad_frac": {}}
        self.part_rows: dict[int, float] = {}  # optimizer step of the iteration -> rows
        self.part_sums: dict[str, dict[int, float]] = {name: {} for name in self.sums}
        self.totals: dict[str, float] = {
            n: 0.0 for n in ("loss", "policy_loss", "kl", "approx_kl", "ratio_mean", "ratio_sq")
        }
        self.ratio_min, self.ratio_max = float("inf"), float("-inf")
        self.energy: dict[int, float] = {}
        self.halves: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None
        self._pending: list[torch.Tensor] = []
        self.grad_norms: list[float] = []
        self.update_norms: list[float] = []
        self.iteration_norm = float("nan")
        self.lora_distance = float("nan")
        self.trained_trajectories = 0
        self.backward_rows = 0  # rows through a backward pass (the run's cost; not stored in the checkpoint)

    def add_loss(self, k: int, first: bool, n: int, loss: Any, part: int = 0) -> None:
        key = (k, first)
        self.rows[key] = self.rows.get(key, 0.0) + n
        self.part_rows[part] = self.part_rows.get(part, 0.0) + n
        for name in self.sums:
            self.sums[name][key] = self.sums[name].get(key, 0.0) + n * getattr(loss, name)
            self.part_sums[name][part] = self.part_sums[name].get(part, 0.0) + n * getattr(loss, name)
        for name in ("policy_loss", "kl"):
            self.totals[name] += n * float(getattr(loss, name))
        self.totals["loss"] += n * float(loss.loss.detach())
        self.totals["approx_kl"] += n * loss.approx_kl
        self.totals["ratio_mean"] += n * loss.ratio_mean
        self.totals["ratio_sq"] += n * (loss.ratio_std**2 + loss.ratio_mean**2)
        self.ratio_min, self.ratio_max = min(self.ratio_min, loss.ratio_min), max(self.ratio_max, loss.ratio_max)

    def add_half(self, accumulated: torch.Tensor) -> None:
        """After each half of a trained step of the first optimizer step: the accumulated gradient."""
        delta = accumulated - (self._last if self._last is not None else torch.zeros_like(accumulated))
        self._last = accumulated
        self._pending.append(delta)

    def end_step(self, k: int | None) -> None:
        """Step `k`'s halves are in: its gradient energy, and the halves' running gradients."""
        if not self._pending or k is None:
            return
        step = torch.stack(self._pending).sum(0)
        self.energy[k] = self.dot(step, step)
        self.halves = self._pending if not self.halves else [a + b for a, b in zip(self.halves, self._pending)]
        self._pending = []

    def gather(self, parallel: DataParallel) -> None:
        """Sum the per-row statistics of every rank of a data-parallel update (the gradient-based
        ones are computed from summed gradients already)."""
        keys = [(k, f) for k in self.steps for f in (True, False)]
        parts = list(range(len(self.grad_norms)))  # every rank takes the same optimizer steps
        names = sorted(self.sums)
        totals = sorted(self.totals)
        local = [self.rows.get(key, 0.0) for key in keys]
        local += [self.sums[n].get(key, 0.0) for n in names for key in keys]
        local += [self.part_rows.get(p, 0.0) for p in parts]
        local += [self.part_sums[n].get(p, 0.0) for n in names for p in parts]
        local += [self.totals[n] for n in totals]
        summed = parallel.sum(torch.tensor(local, dtype=torch.float64)).tolist()
        rows, rest = summed[: len(keys)], summed[len(keys) :]
        self.rows = {key: r for key, r in zip(keys, rows) if r > 0}
        for i, n in enumerate(names):
            values = rest[i * len(keys) : (i + 1) * len(keys)]
            self.sums[n] = {key: v for key, v, r in zip(keys, values, rows) if r > 0}
        rest = rest[len(names) * len(keys) :]
        part_rows, rest = rest[: len(parts)], rest[len(parts) :]
        self.part_rows = {p: r for p, r in zip(parts, part_rows) if r > 0}
        for i, n in enumerate(names):
            values = rest[i * len(parts) : (i + 1) * len(parts)]
            self.part_sums[n] = {p: v for p, v, r in zip(parts, values, part_rows) if r > 0}
        self.totals = dict(zip(totals, rest[len(names) * len(parts) :]))
        self.ratio_min = parallel.extreme(self.ratio_min, "min")
        self.ratio_max = parallel.extreme(self.ratio_max, "max")

    def summary(self) -> dict[str, Any]:
        n = sum(self.rows.values())
        mean = (lambda name: self.totals[name] / n) if n else (lambda name: float("nan"))
        out: dict[str, Any] = {name: mean(name) for name in ("loss", "policy_loss", "kl", "approx_kl", "ratio_mean")}
        out["ratio_std"] = math.sqrt(max(0.0, mean("ratio_sq") - mean("ratio_mean") ** 2)) if n else float("nan")
        out["ratio_min"] = self.ratio_min if n else float("nan")
        out["ratio_max"] = self.ratio_max if n else float("nan")
        for name, sums in self.sums.items():
            out[name] = sum(sums.values()) / n if n else float("nan")
            for phase, first in (("first", True), ("later", False)):
                rows = sum(r for (k, f), r in self.rows.items() if f == first)
                out[f"{name}_{phase}"] = (
                    sum(v for (k, f), v in sums.items() if f == first) / rows if rows else float("nan")
                )
                out[f"{name}_{phase}_by_step"] = [
                    sums[(k, first)] / self.rows[(k, first)] if (k, first) in self.rows else float("nan")
                    for k in self.steps
                ]
            # per optimizer step of the iteration (all trained steps' rows of its part)
            out[f"{name}_by_part"] = [
                self.part_sums[name].get(p, 0.0) / self.part_rows[p] if self.part_rows.get(p) else float("nan")
                for p in range(len(self.grad_norms))
            ]
        total = sum(self.energy.values())
        out["grad_energy_share"] = [
            self.energy[k] / total if total > 0 and k in self.energy else float("nan") for k in self.steps
        ]
        out["signal_cosine"] = _cosine(*self.halves, self.dot) if len(self.halves) == 2 else float("nan")
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")
        out["update_norms"] = list(self.update_norms)
        out["update_norm"] = self.iteration_norm
        out["lora_distance"] = self.lora_distance
        out["trained_steps"] = float(len(self.steps))
        out["trained_step_ids"] = list(self.steps)
        out["trained_trajectories"] = float(self.trained_trajectories)
        out["optimizer_steps"] = float(len(self.grad_norms))
        return out


class RowStats:
    """What one update of a flow-matching objective measured: each statistic its loss reports
    (`ObjectiveOutput.stats`, and the loss), averaged over the (sample, time) rows; the norms of
    each optimizer step's change and of the iteration's, the LoRA's distance from its start."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.seen = 0
        self.halves: list[torch.Tensor] = []  # no signal check
        self.grad_norms: list[float] = []
        self.update_norms: list[float] = []
        self.iteration_norm = float("nan")
        self.lora_distance = float("nan")
        self.trained_trajectories = 0
        self.backward_rows = 0

    def add_loss(self, col: int, first: bool, n: int, out: Any, part: int = 0) -> None:
        self.seen += n
        for name, value in {"loss": float(out.loss.detach()), **out.stats}.items():
            self.sums[name] = self.sums.get(name, 0.0) + n * value

    def add_half(self, accumulated: torch.Tensor) -> None:
        raise RuntimeError("the signal check reads trained steps; a flow-matching update has none")

    def end_step(self, k: int | None) -> None:
        pass

    def gather(self, parallel: DataParallel) -> None:
        """Sum every rank's statistics (a rank may have had no rows, so no statistic names: the
        names are the union of the ranks')."""
        import torch.distributed as dist

        seen: list[list[str] | None] = [None] * parallel.world
        dist.all_gather_object(seen, sorted(self.sums))
        names = sorted({n for names in seen for n in names or []})
        local = [float(self.seen), *(self.sums.get(n, 0.0) for n in names)]
        total = parallel.sum(torch.tensor(local, dtype=torch.float64))
        self.seen, self.sums = int(total[0]), dict(zip(names, total[1:].tolist()))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: value / self.seen for name, value in self.sums.items()} if self.seen else {}
        out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")
        out["update_norms"] = list(self.update_norms)
        out["update_norm"] = self.iteration_norm
        out["lora_distance"] = self.lora_distance
        out["trained_trajectories"] = float(self.trained_trajectories)
        out["optimizer_steps"] = float(len(self.grad_norms))
        out["rows"] = float(self.seen)
        return out


def _snapshot(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """A copy of the parameters (a sharded update's local shards), in their dtype: what a norm of a
    step is measured from, without one flat fp32 vector of them all."""
    return [local_shard(p).detach().clone() for p in params]


def _squared_distance(params: Sequence[torch.nn.Parameter], ref: Sequence[torch.Tensor]) -> float:
    """sum over `params` of ||p - ref||^2 (this rank's shards; float64), one parameter at a time."""
    out = 0.0
    for p, r in zip(params, ref, strict=True):
        out += float((local_shard(p).detach().double() - r.to(local_shard(p).device).double()).square().sum())
    return out


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double())


def _cosine(a: torch.Tensor, b: torch.Tensor, dot: Any = _dot) -> float:
    denom = math.sqrt(dot(a, a) * dot(b, b))
    return dot(a, b) / denom if denom > 0 else float("nan")


def checkpoint_state(iteration: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON part of a checkpoint: finite numbers, and lists of numbers with null for NaN."""

    def finite(v: Any) -> bool:
        return isinstance(v, int | float) and math.isfinite(v)

    clean: dict[str, Any] = {k: v for k, v in summary.items() if finite(v)}
    clean |= {k: [x if finite(x) else None for x in v] for k, v in summary.items() if isinstance(v, list)}
    return json.loads(json.dumps({"iteration": iteration, "update": clean}))


def trained_mask(cfg: Config) -> torch.Tensor:
    """`[T]` bool: the steps the update trains (`Config.trained_steps`)."""
    mask = torch.zeros(cfg.sampler.steps, dtype=torch.bool)
    mask[cfg.trained_steps()] = True
    return mask
