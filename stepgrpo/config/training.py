"""The sections that say how the policy learns: the optimizer (and the papers' presets), the
update's objective, DenseGRPO's calibration."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stepgrpo.config._section import ConfigError, Section, registered
from stepgrpo_core.registry import Registry

# The papers' optimizers, as their authors' code sets them; `optim.preset: NAME` writes these fields
# where it stands (a config file's own optim keys and later `--set`s win). Each value with its source.
_BUILT_IN: dict[str, tuple[dict[str, Any], str]] = {
    "flow_grpo": (
        {"clip_range": 1e-4, "optimizer_steps": 2, "inner_epochs": 1, "adv_clip": 5.0, "kl_beta": 0.04},
        "Flow-GRPO's code (yifan123/flow_grpo, config/base.py and config/grpo.py, its GenEval and OCR configs): "
        "train.clip_range 1e-4; gradient_accumulation_steps = num_batches_per_epoch // 2, i.e. 2 AdamW steps a "
        "sampled batch; num_inner_epochs 1; adv_clip_max 5; train.beta 0.04 (0.01 in its PickScore configs), "
        "the KL form of kl_form flow_grpo",
    ),
    "flow_grpo_fast": (
        {"clip_range": 1e-5, "optimizer_steps": 2, "inner_epochs": 1, "adv_clip": 5.0, "kl_beta": 0.0},
        "Flow-GRPO's code, its `*_fast_nocfg` configs (config/grpo.py: an SDE window of 3 steps): "
        "train.clip_range 1e-5, 2 AdamW steps a sampled batch, train.beta 0",
    ),
    "tp_grpo": (
        {"clip_range": 1e-5, "optimizer_steps": 2, "inner_epochs": 1, "adv_clip": 5.0, "kl_beta": 1e-4},
        "TP-GRPO's code (YunzeTong/TurningPoint-GRPO, config/my_grpo.py on config/base.py and the launch flags of "
        "scripts/multi_node/common_op3.sh): train.clip_range 1e-5; 2 AdamW steps a sampled batch; "
        "--config.train.beta=0.0001",
    ),
}


# The presets as a registry (the one list: `stepgrpo config variants`): an entry returns its fields,
# its source is its `paper` fact.
OPTIMIZER_PRESETS: Registry[Callable[[], dict[str, Any]]] = Registry("optimizer preset")


def _register(name: str, fields: dict[str, Any], source: str) -> None:
    def entry() -> dict[str, Any]:
        return dict(fields)

    entry.__doc__ = "Sets optim " + ", ".join(f"{k}={v:g}" for k, v in fields.items()) + "."
    OPTIMIZER_PRESETS.register(name, paper=source, pattern=f"optim.preset: {name}")(entry)


for _name, (_fields, _source) in _BUILT_IN.items():
    _register(_name, _fields, _source)


def expand_preset(optim: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    """`optim` with preset `name`'s fields written under its own (its explicit fields win)."""
    if name is None:
        return dict(optim)
    if name not in OPTIMIZER_PRESETS:
        raise ConfigError(
            f"{where}: optim.preset {name!r} is not one of {', '.join(map(repr, OPTIMIZER_PRESETS.names()))} "
            "(or leave it out and set optim.clip_range / optimizer_steps / kl_beta yourself)"
        )
    return {**OPTIMIZER_PRESETS.get(name)(), **optim}


class OptimConfig(Section):
    preset: str | None = None
    """Which paper's optimizer the clip, steps a sampled batch, inner epochs, advantage clip and KL
    weight came from (`stepgrpo config variants` lists the presets, each value with its source):
    written where the preset is named; fields set beside it or later win. Those papers' log-probs
    drop a `1 / (2 std^2)` factor that stepgrpo's exact density keeps, so the same clip range is
    tighter here (METHODS.md)."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in OPTIMIZER_PRESETS:
            raise ValueError(f"{v!r} is not one of {', '.join(map(repr, OPTIMIZER_PRESETS.names()))}")
        return v

    lr: float = Field(3e-4, gt=0, le=1.0)
    """AdamW learning rate (Flow-GRPO: 3e-4)."""
    weight_decay: float = Field(1e-4, ge=0)
    """AdamW weight decay (Flow-GRPO: 1e-4)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    clip_range: float = Field(1e-4, gt=0, le=1.0)
    """PPO ratio clip epsilon (Flow-GRPO: 1e-4; our log-prob is the exact density, see METHODS.md)."""
    adv_clip: float = Field(5.0, gt=0)
    """Advantages are clipped to [-adv_clip, adv_clip] (Flow-GRPO: 5)."""
    kl_beta: float = Field(0.04, ge=0)
    """Weight of the KL to the reference (LoRA disabled) model: 0.04 GenEval/OCR, 0.01 PickScore
    (Flow-GRPO's betas, which assume `kl_form: flow_grpo`)."""
    kl_form: Literal["flow_grpo", "exact"] = "flow_grpo"
    """`flow_grpo`: `mean_CHW((mu - mu_ref)^2) / (2 eps_t^2)` with `eps_t` the kernel's diffusion
    coefficient without `sqrt(-dt)` (Flow-GRPO's code; published betas mean this). `exact`: the
    Gaussian KL of the step, dividing by its variance `eps_t^2 |dt|`; `beta_exact = beta |dt|`
    gives the same penalty on the flow / psi kernels (METHODS.md)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    inner_epochs: int = Field(1, ge=1, le=1000)
    """Passes over one iteration's trajectories."""
    optimizer_steps: int = Field(2, ge=1)
    """AdamW steps per inner epoch: the trajectories are shuffled and split into this many equal
    parts, each step taking the gradient of one part accumulated over every trained step (Flow-GRPO:
    2, each from half the batch)."""
    micro_batch: int = Field(8, ge=1, le=1 << 20)
    """Trajectories per forward/backward: a memory bound only, it does not change the gradient."""
    train_steps: tuple[int, ...] | None = None
    """Which denoising steps are trained (indices k in [0, T)); None trains every step of the SDE
    window except the final one (unless `train_final_step`)."""
    train_final_step: bool = False
    """Also train step T-1 when `train_steps` is None. Off as in Flow-GRPO (`timestep_fraction`
    0.99) and TP-GRPO: its std is tiny and its noise barely changes the image, yet it dominates the
    gradient."""
    width_pruning: Literal["off", "per_branch", "extremes"] = "off"
    """A tree's width pruning (BranchGRPO, arXiv 2509.06040; its code's `width_pruning_mode`): the
    stochastic transitions after the tree's last split (`sampler.tree_sde` reaching past it) are
    cut to `width_keep` of them before the update, per group; the rollout and credit are unchanged.
    `per_branch` (mode 1) keeps each leaf's best `max(1, int(n width_keep))` of its `n` by advantage
    (ties: the earlier step); `extremes` (mode 2) keeps the group's best half and worst half of
    `max(2, int(N width_keep))`. Depth pruning is `train_steps`."""
    width_keep: float = Field(0.5, gt=0, le=1)
    """The share of the transitions after a tree's last split that `width_pruning` keeps (BranchGRPO: 0.5)."""
    step_weighting: Literal["uniform", "noise"] = "uniform"
    """Per-step loss weight, orthogonal to credit: `uniform` (every trained step 1) or `noise`
    (TempFlow-GRPO, arXiv 2508.04324: proportional to the step's transition std, normalized to mean 1
    over the trained steps; `stepgrpo_core.loss.step_weights`)."""
    detach_uncond: bool = True
    """With CFG, detach the unconditional branch in the update so the gradient flows through the
    conditional prediction only (Flow-GRPO's `compute_log_prob`)."""
    diagnostics: bool = True
    """Learning diagnostics of the first optimizer step (per-step gradient energy, the signal check
    between two halves of its trajectories); costs two copies of the LoRA gradient per trained step."""
    ema_decay: float | None = Field(None, ge=0.0, lt=1.0)
    """EMA of the trained weights (used for evaluation and the final export); None disables it."""
    kl_reference: Literal["base", "ema"] = "base"
    """The KL term's reference: `base` the model before training (LoRA: the adapter disabled; full
    fine-tuning: a frozen copy); `ema` the EMA of the trained weights (full fine-tuning with
    `ema_decay`), a reference that follows the policy slowly."""
    lr_schedule: Literal["constant", "warmup", "cosine"] = "constant"
    """Learning rate per iteration: `constant`; `warmup` (linear from 0 over `warmup_iterations`,
    then `lr`); `cosine` (the warm-up, then a cosine from `lr` to `lr * lr_final` at `lr_horizon`).
    Every optimizer step of an iteration uses that iteration's rate."""
    warmup_iterations: int = Field(0, ge=0)
    """Iterations of linear warm-up (`warmup` and `cosine`)."""
    lr_horizon: int | None = Field(None, ge=1)
    """With `cosine`: the iteration at which the decay ends (usually `run.iterations`); required."""
    lr_final: float = Field(0.1, ge=0.0, le=1.0)
    """With `cosine`: the final rate as a fraction of `lr`."""

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        if self.lr_schedule == "cosine" and self.lr_horizon is None:
            raise ValueError(
                "optim.lr_schedule cosine needs optim.lr_horizon (the iteration its decay ends; e.g. run.iterations)"
            )
        if self.lr_schedule == "cosine" and self.lr_horizon is not None and self.lr_horizon <= self.warmup_iterations:
            raise ValueError(
                f"optim.lr_horizon {self.lr_horizon} must exceed optim.warmup_iterations {self.warmup_iterations}"
            )
        if self.lr_schedule == "warmup" and self.warmup_iterations == 0:
            raise ValueError("optim.lr_schedule warmup needs optim.warmup_iterations >= 1")
        return self

    def lr_at(self, iteration: int) -> float:
        """The learning rate of iteration `iteration` (0-based) under `lr_schedule`."""
        import math

        if self.lr_schedule == "constant":
            return self.lr
        if iteration < self.warmup_iterations:
            return self.lr * (iteration + 1) / self.warmup_iterations
        if self.lr_schedule == "warmup":
            return self.lr
        assert self.lr_horizon is not None
        t = min(1.0, (iteration - self.warmup_iterations) / max(1, self.lr_horizon - self.warmup_iterations))
        return self.lr * (self.lr_final + (1.0 - self.lr_final) * 0.5 * (1.0 + math.cos(math.pi * t)))


class UpdateConfig(Section):
    objective: str = Field("grpo", json_schema_extra=registered("objectives"))
    """What the update optimizes: a name in `stepgrpo_core.objectives.OBJECTIVES` (`stepgrpo config
    variants` lists them). `grpo`: PPO-clip on the rollout's transitions (the `optim` section's clip,
    KL and steps); the others: flow matching on fresh forward-noised copies of each sample's clean
    latent at a few grid times, weighted by the advantage of the step at that time (docs/METHODS.md,
    "Update objectives"). The `optim` section's AdamW, steps a batch, gradient clip and EMA apply to all."""
    options: dict[str, float | int | str] = Field(default_factory=dict)
    """The objective's options (`stepgrpo config variants` lists them with the authors' defaults)."""
    times: float | None = Field(None, gt=0)
    """Grid times each sample is trained at: a count, or a fraction of `sampler.steps` when below 1;
    None: the objective's (its `times` fact)."""
    time_rule: Literal["random", "stratified", "subset"] | None = None
    """How the grid times are drawn (`stepgrpo_core.objectives.grid_times`); None: the objective's
    (nft `random`, awm `stratified`)."""
    time_span: float | None = Field(None, gt=0, le=1)
    """The share of the grid stratified times come from (steps `1 .. int(T span) - 1`); None: the
    objective's (awm 0.9, its `timestep_fraction`)."""
    companion_rate: float | None = Field(None, ge=0)
    """The companion adapter's decay after optimizer step s is `min(rate s, cap)`: its rate (nft,
    the sampling adapter: 0.001; awm, the KL's EMA target: 0.001); None: the objective's."""
    companion_cap: float | None = Field(None, ge=0, lt=1)
    """The cap of that decay (nft 0.5, awm 0.3, dgpo 0.3); None: the objective's."""
    companion_samples_after: int | None = Field(None, ge=0)
    """The companion adapter samples the rollouts once the run has taken more than this many
    optimizer steps (DGPO's `switch_ema_ref`: 500 GeneVal, 200 OCR); None: the objective's
    (`samples_with_companion`: nft always, awm never, dgpo after 500)."""
    zero_advantage: Literal["keep", "drop"] | None = None
    """Samples whose advantages are all zero: trained (`keep`: their loss still acts, e.g.
    DiffusionNFT's pull toward the old policy and every KL term) or left out (`drop`, as Flow-GRPO
    does); None: as the objective's authors do (grpo drops them; the objectives on noised copies keep them)."""

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, v: str) -> str:
        from stepgrpo_core.objectives import OBJECTIVES

        return OBJECTIVES.validate(v)

    @model_validator(mode="after")
    def _known_options(self) -> UpdateConfig:
        from stepgrpo_core.objectives import OBJECTIVES, check_objective_options

        check_objective_options(self.objective, dict(self.options))
        mine = (self.times, self.time_rule, self.time_span, self.companion_rate, self.companion_cap)
        if self.companion_samples_after is not None and OBJECTIVES.facts(self.objective)["companion"] is None:
            raise ValueError(
                f"update.companion_samples_after: objective {self.objective!r} keeps no companion adapter to "
                "sample with"
            )
        if self.on_transitions and mine != (None,) * 5:
            raise ValueError(
                "update.times / time_rule / time_span / companion_rate / companion_cap belong to the objectives that "
                f"train on noised copies of the samples; objective {self.objective!r} trains the rollout's own steps "
                "(optim.train_steps)"
            )
        return self

    @property
    def on_transitions(self) -> bool:
        """The objective trains on the rollout's own transitions (their log-densities: a stochastic
        step is needed), not on forward-noised copies of the final samples (`OBJECTIVES` fact `rows`)."""
        from stepgrpo_core.objectives import OBJECTIVES

        return OBJECTIVES.facts(self.objective)["rows"] == "transitions"

    @property
    def resolved(self) -> dict[str, Any]:
        """The objective's settings with its registry facts and defaults filled in (computed on each
        read: a cached copy would go stale in a `model_copy(update=...)`, which validates nothing): `rows`,
        `whole_groups`, `keep_zero`, `options` (all of them), `times`, `time_rule`, `time_span`,
        `companion` (the checkpoint group or None), `rate`, `cap`, `samples_with_companion` (True,
        False, or the optimizer step after which the companion samples)."""
        from stepgrpo_core.objectives import OBJECTIVES

        facts = OBJECTIVES.facts(self.objective)
        rule, n, span = facts["times"] or (None, None, 1.0)
        rate, cap = facts["companion_decay"] or (0.0, 0.0)
        keep = facts["keeps_zero_advantage"] if self.zero_advantage is None else self.zero_advantage == "keep"
        return {
            "rows": facts["rows"],
            "whole_groups": bool(facts["whole_groups"]),
            "keep_zero": bool(keep),
            "options": {**OBJECTIVES.describe(self.objective)["options"], **self.options},
            "times": self.times if self.times is not None else n,
            "time_rule": self.time_rule or rule,
            "time_span": span if self.time_span is None else self.time_span,
            "companion": facts["companion"],
            "rate": rate if self.companion_rate is None else self.companion_rate,
            "cap": cap if self.companion_cap is None else self.companion_cap,
            "samples_with_companion": facts["samples_with_companion"]
            if self.companion_samples_after is None
            else self.companion_samples_after,
            "companion_moves": facts["companion_moves"],
            "version": str(facts["version"]),
        }


class CalibrationConfig(Section):
    rounds: int = Field(8, ge=1, le=10_000)
    """DenseGRPO `psi` calibration rounds (each samples with the run's SDE window)."""
    prompts: int = Field(4, ge=1, le=1 << 16)
    """Prompts sampled per round (each with the run's group size)."""
    eps1: float = Field(2.0, ge=0)
    """Balance threshold on |#(g_k > 0) - #(g_k < 0)| (DenseGRPO: 2)."""
    eps2: float = Field(0.1, gt=0)
    """Step of each psi update. DenseGRPO's 0.01 over a few rounds moves psi ~2-3.5 by about 1 %,
    i.e. not at all; 0.1 over 8 rounds can move a step's psi by up to 0.8 (METHODS.md)."""
    init_a: float = Field(0.7, ge=0)
    """Initial psi[k] = init_a * sqrt(s / (1 - s)), the flow kernel's noise (a choice, METHODS.md)."""
