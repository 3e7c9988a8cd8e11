"""The one validated configuration of a stepgrpo run.

A run is described by one `Config` with a sub-config per concern (model, sampler, completion,
reward, credit, optim, calibration, run). Every field has a comment; every model forbids unknown
fields; names of kernels, completions, credit schemes and rewards are checked against their
registries, so a typo fails here with an error that names the field and the allowed values,
never half-way through a run.

`STAGE_FIELDS` says which fields each pipeline stage reads: the cache key of a stage is built
from exactly these (docs/PIPELINE.md, "Caching and restart"), so changing the reward never invalidates
a rollout and changing the credit scheme never invalidates a score.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stepgrpo.paths import SHIPPED_CONFIGS, SHIPPED_MODEL

# Bumped whenever code changes what a stage computes from the same inputs: it is part of every
# cache key, so results written by older code are never reused by newer code.
CODE_SALT = "stepgrpo-stages-3"  # 2: rewards see 8-bit images; 3: flow eps_t at s = 1, ODE reference, Flow-GRPO KL

DEFAULT_MODEL = SHIPPED_MODEL


class ConfigError(ValueError):
    """A configuration that does not validate; the message names each bad field."""


def _run_form(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema as the Prefect run form shows it: a field that takes no null is marked
    required (the form shows the deployment's value and refuses an empty one, which would silently
    become the code's default rather than the recipe's), and each field's description ends with its
    default. A null-able field (e.g. `model.resolution`: null means the model's own) stays optional."""
    props = schema.get("properties", {})
    for name, prop in props.items():
        field = cls.model_fields[name]
        default = field.default_factory() if field.default_factory is not None else field.default
        if not isinstance(default, BaseModel):  # a section's defaults are shown on its own fields
            note = f"Default: `{json.dumps(default)}`."
            prop["description"] = f"{prop['description'].rstrip()}\n\n{note}" if prop.get("description") else note
    nullable = {n for n, p in props.items() if any(o.get("type") == "null" for o in p.get("anyOf", []))}
    schema["required"] = [n for n in props if n not in nullable]


# Absolute bounds, checked before anything is allocated: far beyond any recipe (Flow-GRPO samples
# 10 steps and evaluates 40; its batch is 48 x 24), small enough that a typo fails at once instead of
# allocating gigabytes mid-run.
MAX_STEPS = 1000
MAX_TRAJECTORIES = 1 << 20  # run.prompts_per_iteration x run.group_size


class _Section(BaseModel):
    # The docstring under each field is its description: `stepgrpo config show` prints it, and the
    # JSON schema (the Prefect run form) shows it beside the field, with its default (`_run_form`).
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        json_schema_extra=_run_form,
    )


def _registered(registry: str) -> Callable[[dict[str, Any]], None]:
    """`json_schema_extra` listing a registry's names as the field's choices, read when the schema
    is made (so names that plugins register show too)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["enum"] = _registry(registry).names()

    return extra


def _registry(name: str) -> Any:
    if name == "kernels":
        from stepgrpo_core.kernels import KERNELS

        return KERNELS
    if name == "schemes":
        from stepgrpo_core.credit import SCHEMES

        return SCHEMES
    if name == "objectives":
        from stepgrpo_core.objectives import OBJECTIVES

        return OBJECTIVES
    from stepgrpo.rewards import REWARDS

    return REWARDS


def _completion_choices(schema: dict[str, Any]) -> None:
    """The completion field accepts what the registry's entries declare (`pattern`: a name, or
    `name:N` with N a positive count)."""
    from stepgrpo_core.completions import COMPLETIONS

    patterns = [COMPLETIONS.describe(n)["pattern"] for n in COMPLETIONS.names()]
    regex = "|".join(p.replace(":N", ":[1-9][0-9]*") for p in patterns)
    schema["anyOf"] = [{"type": "string", "pattern": f"^({regex})$", "examples": patterns}, {"type": "null"}]


class ModelConfig(_Section):
    path: str = DEFAULT_MODEL
    """A `StableDiffusion3Pipeline` or `FluxPipeline` directory, or a hub id (`stabilityai/stable-diffusion-3.5-medium`,
    `black-forest-labs/FLUX.1-dev`); its model_index.json selects the policy adapter."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Weights and activations dtype; float32 on CPU, bf16/fp16 on GPU."""
    device: str = "cpu"
    """Torch device of the policy (`cpu`, `cuda`, `cuda:1`)."""
    guidance_scale: float = Field(4.5, ge=1.0)
    """Classifier-free guidance scale while sampling; 1.0 turns CFG off (one forward per step). With a
    Flux model: the value of its guidance embedding (FLUX.1-dev: 3.5), never a second pass."""
    lora_rank: int = Field(32, ge=1, le=4096)
    """LoRA rank r (Flow-GRPO: 32)."""
    lora_alpha: float = Field(64.0, gt=0)
    """LoRA alpha (Flow-GRPO: 64)."""
    lora_targets: tuple[str, ...] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )
    """Transformer modules that get a LoRA adapter (Flow-GRPO: every attention projection of both streams)."""
    resolution: int | None = Field(None, ge=8, le=16384)
    """Image side in pixels; None uses the model's own sample size (Flow-GRPO trains SD3.5-M at 512)."""
    max_batch: int = Field(64, ge=1, le=1 << 20)
    """Largest number of rows sent through the transformer at once (memory bound, not math)."""
    finetune: Literal["lora", "full"] = "lora"
    """What the update trains: `lora` an adapter (the `lora_*` fields); `full` every transformer
    weight (its KL reference a frozen copy or the EMA, `optim.kl_reference`; memory in docs/GPU.md)."""
    init_lora: str | None = None
    """Start from a LoRA instead of a fresh adapter: another run's directory (its exported `lora/`),
    a directory holding `pytorch_lora_weights.safetensors`, or a diffusers LoRA `.safetensors` file.
    Its rank and targets must be `lora_rank` / `lora_targets`; its contents are part of the model's
    identity, so the run's cache keys follow the file, not its path."""
    gradient_checkpointing: bool = False
    """Recompute the transformer's activations in the backward pass instead of storing them (diffusers'
    `enable_gradient_checkpointing`): the same gradients, less memory, about a third more update time."""

    @model_validator(mode="after")
    def _lora_or_full(self) -> ModelConfig:
        if self.finetune == "full" and self.init_lora is not None:
            raise ValueError("model.init_lora starts a LoRA; with model.finetune: full there is none (set one of them)")
        return self


class SamplerConfig(_Section):
    steps: int = Field(10, ge=1, le=MAX_STEPS)
    """T, the number of denoising steps of a training rollout (Flow-GRPO: 10)."""
    kernel: str = Field("flow", json_schema_extra=_registered("kernels"))
    """Transition kernel of the stochastic steps: a name in `stepgrpo_core.kernels.KERNELS`."""
    noise: float = Field(0.7, ge=0.0)
    """Kernel noise parameter: `a` for flow / cps (0.7), `eta` for ddim (1.0); unused by ode and psi."""
    sde_window_start: int = Field(0, ge=0)
    """First stochastic step of the SDE window (MixGRPO / Flow-GRPO-Fast); steps outside are ODE."""
    sde_window_size: int | None = Field(None, ge=1)
    """Number of stochastic steps from `sde_window_start`; None means every step."""
    branch_window: tuple[int, int] | None = None
    """Branched rollouts (TempFlow-GRPO, `stepgrpo_core.branching`): `[lo, hi]`, and each group's
    members share the ODE path from the group's initial noise up to the group's branch step, drawn
    uniformly from steps `lo .. hi - 1` (`[b, b + 1]` fixes it), take that one step with `kernel`,
    each with its own noise, and the ODE after it. The shared prefix is computed once a group; only
    the branch step has a density to train, and a group's normalized rewards are that step's
    sibling advantage (`credit.scheme: outcome`). It replaces the SDE window; None: no branching."""
    branch_tree: list[tuple[int, int]] | None = None
    """Tree rollouts (BranchGRPO, `stepgrpo_core.branching.tree_rollout`): `[[step, factor], ...]`,
    steps increasing, the factors' product `run.group_size`: each group's root follows the ODE from
    its initial noise, and at each step every node splits into `factor` children, each taking that
    step with `kernel` and its own noise, then the ODE on. Every node is computed once; each branch
    transition is trained once. `credit.scheme: tree` credits it (BranchGRPO's tree advantage). It
    replaces the SDE window; None: no tree."""
    ode_solver: Literal["euler", "dpm2"] = "euler"
    """The solver of the rollout's deterministic steps: `euler` (SD3's sampler), or `dpm2`,
    DPM-Solver++ 2M from diffusers' scheduler (DiffusionNFT's 10-step ODE rollouts; multistep, so
    only with the deterministic `kernel: ode`, which makes every step one)."""
    sde_solver: Literal["sa_solver"] | None = None
    """A stochastic multistep solver that takes every step of the rollout instead of `kernel` and
    the SDE window: `sa_solver`, SA-Solver from diffusers' scheduler (AWM's rollouts; its tau is
    `noise`, on 0.3 <= sigma <= 0.9). Its steps have no density under the policy alone (each
    depends on the solver's history), so only an objective that trains on the final samples
    (`update.objective` other than grpo) takes it."""
    eval_steps: int = Field(40, ge=1, le=MAX_STEPS)
    """ODE steps of evaluation sampling (Flow-GRPO evaluates with 40)."""
    shared_x0: bool = True
    """A group's members start from one initial noise `x_0` (GRPO's group shares prompt and noise);
    false gives each member its own `x_0` and its own `R_0` (its own ODE sample), as Flow-GRPO's
    and TP-GRPO's code do (`same_latent = False`)."""
    ode_reference: bool = True
    """Also sample each distinct `x_0` by the ODE (every step deterministic, the same grid): `R_0` of
    outcome runs, and the ODE reward reported beside the SDE's. No credit scheme's advantage reads
    it (outcome reads `R_T`; step rewards read their completions), so false saves its transformer
    passes, `T` an initial noise (one a group with `shared_x0`, one a trajectory without: as many
    as the rollout itself), and the reward of one more image a trajectory; the run then reports no
    ODE reward. Not sampled, nothing of it is stored (schema 5). A deterministic rollout is its own
    ODE sample: there it costs no pass, only the extra reward."""

    @field_validator("kernel")
    @classmethod
    def _known_kernel(cls, v: str) -> str:
        from stepgrpo_core.kernels import KERNELS

        return KERNELS.validate(v)

    @model_validator(mode="after")
    def _solver_needs_ode(self) -> SamplerConfig:
        from stepgrpo_core.kernels import KERNELS

        if self.ode_solver != "euler" and not KERNELS.facts(self.kernel)["deterministic"]:
            raise ValueError(
                f"sampler.ode_solver {self.ode_solver!r} is a multistep ODE solver: its history breaks at a "
                f"stochastic step; use it with sampler.kernel=ode (every step deterministic)"
            )
        if self.sde_solver is not None:
            if self.ode_solver != "euler":
                raise ValueError(
                    f"sampler.sde_solver {self.sde_solver!r} takes every step: sampler.ode_solver "
                    f"{self.ode_solver!r} would have none; leave ode_solver at euler"
                )
            if self.sde_window_start != 0 or self.sde_window_size is not None:
                raise ValueError(
                    f"sampler.sde_solver {self.sde_solver!r} takes every step (its tau band decides where it "
                    "adds noise): unset sampler.sde_window_start / sde_window_size"
                )
            if KERNELS.facts(self.kernel)["per_step"]:
                raise ValueError(
                    f"sampler.sde_solver {self.sde_solver!r} reads sampler.noise as its tau, one number; kernel "
                    f"{self.kernel!r} makes it a per-step table: leave sampler.kernel at flow"
                )
            if self.noise == 0 and self.shared_x0:
                raise ValueError(
                    f"sampler.sde_solver {self.sde_solver!r} with sampler.noise 0 adds no noise: with "
                    "sampler.shared_x0 "
                    "every member of a group would be the same sample, and nothing could be learned; set "
                    "sampler.noise > 0 (AWM samples with 0.4) or sampler.shared_x0=false"
                )
        return self

    @model_validator(mode="after")
    def _branches(self) -> SamplerConfig:
        from stepgrpo_core.kernels import KERNELS

        if self.branch_window is None and self.branch_tree is None:
            return self
        name = "sampler.branch_window" if self.branch_tree is None else "sampler.branch_tree"
        if self.branch_window is not None and self.branch_tree is not None:
            raise ValueError(
                "sampler.branch_window and sampler.branch_tree: one branches at a step, the other a tree; set one"
            )
        if self.branch_window is not None:
            lo, hi = self.branch_window
            if not 0 <= lo < hi <= self.steps:
                raise ValueError(
                    f"sampler.branch_window [{lo}, {hi}]: the branch steps lo .. hi - 1 must lie in the {self.steps} "
                    f"steps (0 <= lo < hi <= {self.steps})"
                )
        else:
            steps = [b for b, _ in self.branch_tree]
            if not steps or steps != sorted(set(steps)) or steps[0] < 0 or steps[-1] >= self.steps:
                raise ValueError(
                    f"sampler.branch_tree {self.branch_tree}: [step, factor] pairs, steps increasing within the "
                    f"{self.steps} steps"
                )
            if any(f < 2 for _, f in self.branch_tree):
                raise ValueError(f"sampler.branch_tree {self.branch_tree}: every factor at least 2 (a node's children)")
        fixes = {
            "sampler.shared_x0 is false: a branched group's members share their initial noise and prefix; set it "
            "true": not self.shared_x0,
            f"sampler.kernel {self.kernel!r} is deterministic: the branch step needs a stochastic kernel (e.g. "
            "flow)": KERNELS.facts(self.kernel)["deterministic"],
            f"sampler.ode_solver {self.ode_solver!r}: a multistep solver's history would cross the branch; use "
            "euler": self.ode_solver != "euler",
            f"sampler.sde_solver {self.sde_solver!r} takes every step; a branched rollout takes one stochastic "
            "step: unset it": self.sde_solver is not None,
            "sampler.sde_window_start / sde_window_size: the branch window replaces the SDE window; unset "
            "them": self.sde_window_start != 0 or self.sde_window_size is not None,
            f"sampler.kernel {self.kernel!r} is calibrated on unbranched rollouts over the SDE window; use flow "
            "or cps": KERNELS.facts(self.kernel)["calibrated"],
        }
        for fix, broken in fixes.items():
            if broken:
                raise ValueError(f"{name}: {fix.replace('sampler.branch_window', name)}")
        return self

    @model_validator(mode="after")
    def _window_inside_grid(self) -> SamplerConfig:
        size = self.sde_window_size or self.steps - self.sde_window_start
        if self.sde_window_start >= self.steps or self.sde_window_start + size > self.steps:
            raise ValueError(
                f"sde window (sde_window_start={self.sde_window_start}, sde_window_size={self.sde_window_size}) "
                f"must lie inside the {self.steps} steps"
            )
        return self

    def window(self) -> tuple[int, int]:
        """The stochastic steps `[start, end)` (branched: the steps a group may branch at)."""
        if self.branch_window is not None:
            return int(self.branch_window[0]), int(self.branch_window[1])
        if self.branch_tree is not None:
            return int(self.branch_tree[0][0]), int(self.branch_tree[-1][0]) + 1
        size = self.sde_window_size or self.steps - self.sde_window_start
        return self.sde_window_start, self.sde_window_start + size


class CompletionConfig(_Section):
    method: str | None = Field("remaining", json_schema_extra=_completion_choices)
    """How every state `x_k` is completed to a clean image: a method of
    `stepgrpo_core.completions.COMPLETIONS` (`stepgrpo config variants` lists them, e.g. `remaining`,
    `substeps:N`); None scores only the final sample (Flow-GRPO)."""

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from stepgrpo_core.completions import validate_method

        return validate_method(v)


class RewardConfig(_Section):
    name: str = Field("shapes", json_schema_extra=_registered("rewards"))
    """Reward model: a name in `stepgrpo.rewards.REWARDS`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the reward factory (e.g. a hub id or local path of its weights)."""

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        from stepgrpo.rewards import REWARDS

        return REWARDS.validate(v)


class CreditConfig(_Section):
    scheme: str = Field("outcome", json_schema_extra=_registered("schemes"))
    """Credit scheme: a name in `stepgrpo_core.credit.SCHEMES` (`stepgrpo config variants` lists them)."""
    options: dict[str, bool | float | int | str] = Field(default_factory=dict)
    """Scheme options, e.g. `global_std` (outcome), `consistency` / `first_step` / `balance` (turning_point)."""

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        from stepgrpo_core.credit import SCHEMES

        return SCHEMES.validate(v)

    @model_validator(mode="after")
    def _known_options(self) -> CreditConfig:
        from stepgrpo_core.credit import check_options

        check_options(self.scheme, self.options)
        return self


# The papers' optimizers, as their authors' code sets them; `optim.preset: NAME` writes these fields
# where it stands (a config file's own optim keys and later `--set`s win). Each value with its source.
OPTIMIZER_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
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


def expand_preset(optim: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    """`optim` with preset `name`'s fields written under its own (its explicit fields win)."""
    if name is None:
        return dict(optim)
    if name not in OPTIMIZER_PRESETS:
        raise ConfigError(
            f"{where}: optim.preset {name!r} is not one of {', '.join(map(repr, OPTIMIZER_PRESETS))} "
            "(or leave it out and set optim.clip_range / optimizer_steps / kl_beta yourself)"
        )
    return {**OPTIMIZER_PRESETS[name][0], **optim}


class OptimConfig(_Section):
    preset: str | None = None
    """Which paper's optimizer the clip, steps a sampled batch, inner epochs, advantage clip and KL
    weight came from (`flow_grpo`, `flow_grpo_fast`, `tp_grpo`: `OPTIMIZER_PRESETS`, each value
    with its source): written where the preset is named; fields set beside it or later win. Those
    papers' log-probs drop a `1 / (2 std^2)` factor that stepgrpo's exact density keeps, so the same
    clip range is tighter here (METHODS.md)."""

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in OPTIMIZER_PRESETS:
            raise ValueError(f"{v!r} is not one of {', '.join(map(repr, OPTIMIZER_PRESETS))}")
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


class UpdateConfig(_Section):
    objective: str = Field("grpo", json_schema_extra=_registered("objectives"))
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
    does); None: as the objective's authors do (grpo drops them; nft, awm and dgpo keep them)."""

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


class CalibrationConfig(_Section):
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


class RunConfig(_Section):
    name: str = "stepgrpo"
    """Config name: the MLflow experiment and the default prefix of run ids."""
    prompts: str = "shapes"
    """Prompt source: `shapes` (the synthetic task, train / held-out split), `geneval` or `ocr`
    (prompt sets shipped as code, `stepgrpo.prompts.sets`, with their own held-out split), a hub
    dataset `hf:<id>[@<split>][:<column>]` (`pip install -e .[datasets]`), a `.txt` file (one prompt
    a line) or a `.jsonl` file (one object a line with a `prompt` field, the rest its metadata, as
    GenEval's `metadata.jsonl`); held-out prompts in `heldout_prompts`."""
    heldout_prompts: str | None = None
    """File (`.txt` or `.jsonl`) or hub dataset (`hf:<id>@test`) of held-out evaluation prompts when
    `prompts` is a file or a hub dataset."""
    iterations: int = Field(2, ge=1)
    """Training iterations (rollout -> complete -> score -> credit -> update)."""
    prompts_per_iteration: int = Field(4, ge=1, le=1 << 16)
    """Distinct prompts per iteration; B = prompts_per_iteration x group_size trajectories."""
    group_size: int = Field(4, ge=2, le=4096)
    """G, trajectories per prompt sharing the initial noise x_0 (Flow-GRPO: 24)."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Master seed: prompts, noise and update shuffling of iteration i derive from (seed, i)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N iterations (0: only before and after training)."""
    eval_prompts: int = Field(16, ge=1, le=1 << 20)
    """Held-out prompts per evaluation."""
    eval_seeds: int = Field(1, ge=1, le=1024)
    """Sampling seeds per held-out prompt."""
    eval_protocol: str | None = None
    """A paper's evaluation protocol (`stepgrpo.prompts.protocols`: geneval, ocr, pickscore,
    drawbench, shapes) under which every held-out evaluation also measures the policy, each with
    its evidence bundle in the run's `evidence/` (as `stepgrpo evaluate RUN --protocol NAME`;
    the name and its prompt file are checked before a run starts, `stepgrpo.checks`)."""

    runs_root: str = "runs"
    """Directory that holds run directories `<runs_root>/<run_id>/`."""

    @field_validator("runs_root")
    @classmethod
    def _no_tilde(cls, v: str) -> str:
        if v.startswith("~"):
            raise ValueError(
                f"run.runs_root {v!r} starts with '~', which only a shell expands: write the directory out "
                "(e.g. $HOME/... on the command line, or an absolute path in the YAML)"
            )
        return v

    def evaluates_after(self, iteration: int) -> bool:
        """Whether a held-out evaluation follows iteration `iteration` (every `eval_every`, and the last)."""
        done = iteration + 1
        return done == self.iterations or bool(self.eval_every and done % self.eval_every == 0)


class CurriculumConfig(_Section):
    """How each iteration's training prompts are drawn (METHODS.md, "Gain-variance curriculum")."""

    draw: Literal["uniform", "gain_variance"] = "uniform"
    """`uniform`: a permutation of the training prompts from `(run.seed, iteration)`. `gain_variance`:
    prompts drawn with weights that follow the variance of their groups' step gains in the last
    `window` iterations (its spread of final rewards where only final samples are scored), so
    prompts whose groups had no reward spread are drawn less; each draw is a stored stage."""
    window: int = Field(50, ge=1)
    """Iterations of history a draw reads (the spread of a prompt is the mean over its groups there)."""
    floor: float = Field(0.2, ge=0.0, le=1.0)
    """Weight of a prompt whose groups had no spread, relative to the average prompt's 1 (an
    unseen prompt also gets 1); 1 makes the draw uniform over the weights."""


class StorageConfig(_Section):
    images: bool = True
    """Keep the uint8 images the reward saw (every scored state) so that re-scoring with another
    reward skips the VAE. 3 x H x W bytes a state: 3 KB at 32 px, 768 KB at 512 px (six times a
    fp16 SD3 latent); turn off for large images if disk matters more than re-scoring time."""
    keep: Literal["all", "last", "tables"] = "all"
    """What the run keeps of each finished iteration (one whose update is published): `all` every
    stage; `last` the latents, completions and images of the last `keep_last` iterations only;
    `tables` none of them (the reward and advantage tables, manifests and checkpoints stay). A
    pruned iteration still resumes and re-credits (`stepgrpo credit`), but cannot be re-scored
    (`stepgrpo rescore`). `stepgrpo prune RUN` applies this to an existing run."""
    keep_last: int = Field(2, ge=1)
    """With `keep: last`, how many of the latest finished iterations keep their latents."""
    checkpoint_every: int = Field(0, ge=0)
    """Keep the weights of every N-th checkpoint (iterations N-1, 2N-1, ...), of the latest and of
    those the run evaluated; the others keep only their update record (the run still resumes, but
    cannot be evaluated there). 0: keep every checkpoint."""


class ScaleConfig(_Section):
    """Where the stages run (docs/SCALING.md). Never part of a cache key: a run computes the same
    bytes in-process and on any number of workers, and may be resumed with other settings here."""

    workers: Literal["process", "ray"] = "process"
    """`process`: every stage in this process (no Ray needed). `ray`: rollout, complete, score and
    evaluate run as shards of whole prompt groups on Ray workers, one Prefect task a shard
    (`pip install -e .[ray]`)."""
    address: str | None = None
    """With `ray`: an existing cluster (`ray://head:10001`, `auto`); None starts a local one for the run."""
    num_workers: int = Field(2, ge=1, le=4096)
    """With `ray` and no `address`: the local cluster's CPUs; also how many shards a stage is split
    into when `groups_per_shard` is 0."""
    groups_per_shard: int = Field(0, ge=0)
    """Prompt groups a shard samples, completes and scores (0: the stage split evenly over the workers,
    or one shard in-process). A multiple of the groups in one model call (`model.max_batch` rows)."""
    cpus_per_shard: float = Field(1.0, gt=0)
    """Ray CPUs a shard task requests."""
    shard_retries: int = Field(3, ge=0)
    """Times Ray runs a shard again on another worker when its worker dies (killed, out of memory, a
    lost node); a shard that raises is not retried (the stage fails naming it; rerun the command)."""
    gpus_per_shard: float = Field(0.0, ge=0)
    """Ray GPUs a shard task requests (0.5: two shards share a GPU); set `model.device: cuda`."""
    stage_retries: int = Field(1, ge=0)
    """Times Prefect runs a stage task again after a failure that may pass (an out-of-memory error,
    a reward server that did not answer; not bad input or damaged data). Safe: every stage is
    idempotent and a retry reuses the shards the failed attempt finished. 0: no retries."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch CPU threads of every stepgrpo process of the run (the flow, Ray shards, the update's
    processes); None: `STEPGRPO_THREADS` when set, else torch's default of one per core. A new run
    records the count, and every computation of the run uses the recorded count from then on, on
    resume too: a CPU kernel's last bits depend on it (docs/RELIABILITY.md, "Same bytes"). The
    shipped shapes configs set 1: the tiny model gains little from two, and loses a lot when a
    second process shares the cores."""
    update_processes: int = Field(1, ge=1, le=4096)
    """Data-parallel processes of the policy update (torch.distributed: gloo on CPU, NCCL on GPUs),
    each with a disjoint part of every optimizer step's trajectories; 1: the update in this process.
    They live for the run. With `workers: process` they run on this node; with `ray` they are Ray
    actors placed by a placement group over the cluster's nodes (`update_placement`), one
    `update_gpus` each: any number, whatever one node holds."""
    update_placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """With `ray`: how the update's ranks are placed over the nodes (Ray's placement-group
    strategies): `pack` on as few nodes as fit (the fastest all-reduce), `spread` over as many as
    possible, `strict_*` or fail."""
    update_cpus: float = Field(0.1, gt=0)
    """With `ray`: Ray CPUs each update rank holds for the run. Small by default: a rank computes
    only while no shard does, so it need not keep a shard from a CPU."""
    update_gpus: float | None = Field(None, ge=0)
    """With `ray`: Ray GPUs each update rank holds for the run; None: 1 with `model.device: cuda`,
    else 0. Below 1 (and `gpus_per_shard` below 1) a rank and a shard share a GPU."""


class TrackingConfig(_Section):
    backend: Literal["mlflow", "wandb"] = "mlflow"
    """Where training runs are tracked: `mlflow` (a SQLite store under the runs root, or
    `MLFLOW_TRACKING_URI`'s) or `wandb` (Weights & Biases: `pip install 'stepgrpo[wandb]'`, log in
    with `wandb login`, or `WANDB_MODE=offline`). The offline commands (`rescore`, `credit`,
    `evaluate`) on a run log where the run was tracked."""
    project: str | None = None
    """The W&B project; null: the MLflow experiment's name (`STEPGRPO_EXPERIMENT`, default stepgrpo)."""


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy: the model to fine-tune, its dtype and device, CFG and the LoRA."""
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    """Training rollouts: steps, transition kernel and its noise, the SDE window; evaluation steps."""
    completion: CompletionConfig = Field(default_factory=CompletionConfig)
    """How each intermediate state is completed to a clean image for its reward (step-level credit)."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward model and its options."""
    credit: CreditConfig = Field(default_factory=CreditConfig)
    """The credit scheme that turns rewards into per-step advantages, and its options."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The GRPO update: AdamW, PPO clip, KL, which steps are trained."""
    update: UpdateConfig = Field(default_factory=UpdateConfig)
    """The update's objective: PPO-clip GRPO, or DiffusionNFT / AWM on forward-noised copies."""
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    """DenseGRPO's calibration of the per-step noise table `psi` (kernel `psi` only)."""
    run: RunConfig = Field(default_factory=RunConfig)
    """The run: prompts, iterations, group size, seed, evaluation, where runs are kept."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """Which training prompts each iteration draws: uniformly, or by the variance of their step gains."""
    storage: StorageConfig = Field(default_factory=StorageConfig)
    """What the run directory keeps, and for how long."""
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    """Where the stages run: in this process or on Ray workers; threads; retries."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Where the training run's metrics, images and LoRA are tracked: MLflow or W&B."""

    @model_validator(mode="after")
    def _steps_in_grid(self) -> Config:
        from stepgrpo_core.completions import COMPLETIONS
        from stepgrpo_core.credit import SCHEMES

        if self.completion.method is None and SCHEMES.facts(self.credit.scheme)["step_rewards"]:
            final_only = [s for s in SCHEMES.names() if not SCHEMES.facts(s)["step_rewards"]]
            raise ValueError(
                f"credit.scheme {self.credit.scheme!r} needs step rewards: set completion.method "
                f"({', '.join(COMPLETIONS.describe(m)['pattern'] for m in COMPLETIONS.names())}); only "
                f"{', '.join(map(repr, final_only))} works with "
                "completion.method null"
            )
        from stepgrpo_core.kernels import KERNELS
        from stepgrpo_core.objectives import OBJECTIVES

        noised = [n for n in OBJECTIVES.names() if OBJECTIVES.facts(n)["rows"] == "noised"]
        if KERNELS.facts(self.sampler.kernel)["deterministic"] and self.update.on_transitions:
            raise ValueError(
                f"sampler.kernel {self.sampler.kernel!r} is deterministic: its steps have no density for "
                f"update.objective {self.update.objective} to train; pick a stochastic kernel (e.g. flow), or an "
                f"objective that trains on the final samples (update.objective: one of {', '.join(noised)})"
            )
        if self.sampler.sde_solver is not None and self.update.on_transitions:
            raise ValueError(
                f"sampler.sde_solver {self.sampler.sde_solver!r}: its steps have no density of their own (each "
                f"depends on the solver's history) for update.objective {self.update.objective} to train; use it "
                f"with an objective that trains on the final samples ({', '.join(noised)}), or sample with a kernel"
            )
        if (
            KERNELS.facts(self.sampler.kernel)["deterministic"]
            and self.sampler.shared_x0
            and not self.sampler.sde_solver
        ):
            raise ValueError(
                f"sampler.kernel {self.sampler.kernel!r} is deterministic and sampler.shared_x0 is true: every member "
                "of a group would be the same sample; set sampler.shared_x0=false (each member its own initial noise, "
                "as DiffusionNFT's ODE rollouts do) or a stochastic kernel"
            )
        if not self.update.on_transitions:
            from stepgrpo_core.objectives import times_count

            u = self.update.resolved
            times_count(str(u["time_rule"]), float(u["times"]), self.sampler.steps, float(u["time_span"]))
            if u["whole_groups"]:
                self._groups_whole()
            return self._batch_fits()
        start, end = self.sampler.window()
        for k in self.optim.train_steps or ():
            if not start <= k < end:
                raise ValueError(f"optim.train_steps: step {k} is outside the SDE window [{start}, {end}) of sampler")
        if (tree := self.sampler.branch_tree) is not None:
            import math

            if math.prod(f for _, f in tree) != self.run.group_size:
                raise ValueError(
                    f"sampler.branch_tree {tree}: its factors' product ({math.prod(f for _, f in tree)}) must be "
                    f"run.group_size ({self.run.group_size}), the leaves of a group's tree"
                )
        from stepgrpo_core.credit import reads_tree

        if reads_tree(self.credit.scheme) and tree is None:
            raise ValueError(
                f"credit.scheme {self.credit.scheme} reads the rollout's tree: set sampler.branch_tree (or pick "
                "another scheme)"
            )
        b = self.sampler.window() if self.sampler.branch_window or tree else None
        if b is not None and b[1] == self.sampler.steps and not self.optim.train_final_step:
            raise ValueError(
                f"the branch steps {list(range(*b)) if tree is None else [s for s, _ in tree]} reach the final step, "
                "which is not trained by default: a branch there would train nothing; end them before step "
                f"{b[1] - 1} or set optim.train_final_step=true"
            )
        if not self.trained_steps():
            raise ValueError(
                f"no step is trained: the SDE window [{start}, {end}) holds only the final step, which is not "
                "trained by default; widen the window or set optim.train_final_step=true"
            )
        if self.optim.kl_reference == "ema" and (self.model.finetune != "full" or self.optim.ema_decay is None):
            raise ValueError(
                "optim.kl_reference ema is the EMA of fully fine-tuned weights: set model.finetune: full and "
                "optim.ema_decay (a LoRA's reference is the base model, its adapter disabled)"
            )
        return self._batch_fits()

    def _groups_whole(self) -> None:
        """Refuse a setting that would split a group where the objective reads whole groups."""
        G, o = self.run.group_size, self.optim
        if o.micro_batch < G:
            raise ValueError(
                f"update.objective {self.update.objective} reads each group whole (its preference weight sums over "
                f"the group): optim.micro_batch={o.micro_batch} would split groups of run.group_size={G}; set "
                f"optim.micro_batch >= {G}"
            )
        if o.optimizer_steps > self.run.prompts_per_iteration:
            raise ValueError(
                f"update.objective {self.update.objective} trains whole groups: optim.optimizer_steps="
                f"{o.optimizer_steps} exceeds the {self.run.prompts_per_iteration} groups of an iteration "
                "(run.prompts_per_iteration); lower optim.optimizer_steps"
            )

    def _batch_fits(self) -> Config:
        B = self.run.prompts_per_iteration * self.run.group_size
        if B > MAX_TRAJECTORIES:
            raise ValueError(
                f"run.prompts_per_iteration x run.group_size = {B} trajectories an iteration exceeds "
                f"{MAX_TRAJECTORIES}: lower one of them (Flow-GRPO's recipes use 48 x 24)"
            )
        if self.optim.optimizer_steps > B:
            raise ValueError(
                f"optim.optimizer_steps={self.optim.optimizer_steps} exceeds the {B} trajectories of an iteration "
                "(run.prompts_per_iteration x run.group_size): each optimizer step needs at least one"
            )
        return self

    def notes(self) -> list[str]:
        """What a run of this config should be told once before it starts (not errors)."""
        o = self.optim
        if o.optimizer_steps == 1 and o.inner_epochs == 1 and self.update.on_transitions:
            return [
                f"optim.clip_range={o.clip_range:g} never acts: one optimizer step on freshly sampled trajectories "
                "sees every PPO ratio at exactly 1; the clip binds from a batch's second step on "
                "(optim.optimizer_steps >= 2, e.g. optim.preset=flow_grpo)"
            ]
        return []

    def trained_steps(self) -> list[int]:
        """Indices k of the steps whose log-probs enter the loss: `optim.train_steps`, or the SDE
        window without the final step `T-1` (unless `optim.train_final_step`). An objective on
        noised copies of the samples (`OBJECTIVES` fact `rows`) trains at grid times of every step: all of them."""
        if not self.update.on_transitions:
            return list(range(self.sampler.steps))
        if self.optim.train_steps:
            return sorted(self.optim.train_steps)
        start, end = self.sampler.window()
        last = self.sampler.steps - 1
        return [k for k in range(start, end) if k != last or self.optim.train_final_step]

    def flat(self) -> dict[str, Any]:
        """`{"optim.lr": 3e-4, ...}`: the flattened config (MLflow params, `--set` keys)."""
        return dict(_flatten(self.model_dump(mode="json")))

    def digest(self) -> str:
        return digest_of(self.model_dump(mode="json"))


# Which config fields each stage reads: a section name means the whole section. These, the
# stage's input digests, the model / reward identity and CODE_SALT make the stage's cache key.
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "prompts": ("run.prompts", "run.heldout_prompts"),
    "draw": (
        "curriculum",
        "reward",
        "run.prompts",
        "run.prompts_per_iteration",
        "run.group_size",
        "run.seed",
    ),
    "rollout": (
        "model",
        "sampler.steps",
        "sampler.kernel",
        "sampler.noise",
        "sampler.sde_window_start",
        "sampler.sde_window_size",
        "sampler.branch_window",
        "sampler.branch_tree",
        "sampler.shared_x0",
        "sampler.ode_reference",
        "sampler.ode_solver",
        "sampler.sde_solver",
        "run.prompts",
        "run.prompts_per_iteration",
        "run.group_size",
        "run.seed",
        "calibration",
    ),
    "complete": ("model", "completion"),
    "score": ("model.path", "model.dtype", "model.device", "reward"),
    "credit": ("credit",),
    "update": ("model", "sampler", "optim", "update", "run.seed"),
    "evaluate": (
        "model",
        "sampler.eval_steps",
        "reward",
        "run.prompts",
        "run.heldout_prompts",
        "run.eval_prompts",
        "run.eval_seeds",
        "run.seed",
    ),
    "calibrate": (
        "model",
        "sampler",
        "completion",
        "reward",
        "calibration",
        "run.prompts",
        "run.group_size",
        "run.seed",
    ),
}


# Fields added after runs were stored, at the value that computes what the code did before them:
# left out of a key at that value, so a stored run keeps its keys (and its stages) under new code.
KEY_NEUTRAL: dict[str, Any] = {
    "sampler.shared_x0": True,
    "sampler.ode_reference": True,
    "sampler.ode_solver": "euler",
    "sampler.sde_solver": None,
    "sampler.branch_window": None,
    "sampler.branch_tree": None,
    "optim.step_weighting": "uniform",
    "optim.preset": None,
    "update.objective": "grpo",
    "update.options": {},
    "update.times": None,
    "update.time_rule": None,
    "update.time_span": None,
    "update.companion_rate": None,
    "update.companion_cap": None,
    "update.companion_samples_after": None,
    "update.zero_advantage": None,
    "run.eval_protocol": None,
}


def stage_fields(config: Config, stage: str) -> dict[str, Any]:
    """The values of the fields `stage` reads, flattened: the config part of its cache key."""
    flat = {k: v for k, v in config.flat().items() if k not in KEY_NEUTRAL or KEY_NEUTRAL[k] != v}
    out: dict[str, Any] = {}
    for field in STAGE_FIELDS[stage]:
        out.update({k: v for k, v in flat.items() if k == field or k.startswith(field + ".")})
    return out


def digest_of(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys), hex."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "options":
            yield from _flatten(v, key + ".")
        elif isinstance(v, Mapping):  # free-form options: one param per option
            yield from ((f"{key}.{ok}", ov) for ok, ov in sorted(v.items()))
            if not v:
                yield key, {}
        else:
            yield key, v


def describe(cfg: Config) -> str:
    """`cfg` as YAML that loads back to it, each field under its description as a comment
    (`stepgrpo config show`)."""
    lines: list[str] = []
    for section, field in Config.model_fields.items():
        sub = getattr(cfg, section)
        lines += [f"# {line.strip()}" for line in (field.description or "").splitlines()]
        lines.append(f"{section}:")
        for name, info in type(sub).model_fields.items():
            for line in (info.description or "").splitlines():
                lines.append(f"  # {line.strip()}")
            value = yaml.safe_dump({name: _plain(getattr(sub, name))}, default_flow_style=True, width=1000)
            lines.append("  " + value.strip().removeprefix("{").removesuffix("}"))
        lines.append("")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------- building a config


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, validate.

    A config file may name a `base` config (a path relative to it) whose sections it overrides
    field by field. Override values are parsed as YAML (`optim.lr=1e-4`, `optim.train_steps=[0,1]`,
    `completion.method=null`). Raises `ConfigError` naming every bad field.
    """
    data = _read_config_file(config_file(path)) if path is not None else {}
    allow_plugins(data)  # the user's own file: the plug-ins it names may be imported
    return validate_config(apply_overrides(data, overrides))


def config_from(
    config: Config | Mapping[str, Any] | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """The config a flow runs with: the typed `config` (the Prefect run form, or what the CLI
    resolved) or the YAML file at `path` (or the defaults), with `key=value` overrides applied."""
    if config is not None and path is not None:
        raise ConfigError(
            "both a config and config_path were given: fill in the config (the run form), or name a YAML file "
            "in config_path, not both"
        )
    if config is None:
        return load_config(path, overrides)
    data = config.model_dump(mode="json") if isinstance(config, Config) else dict(config)
    allow_plugins(data)  # what the caller passed (the run form, the CLI's resolved config), never a stored run's
    return validate_config(apply_overrides(data, overrides))


PLUGIN_SECTIONS = ("reward", "credit")  # the sections whose names may be plug-in references


def allow_plugins(data: Mapping[str, Any]) -> None:
    """Let the plug-in references that the user's own config `data` names be imported
    (`stepgrpo_core.registry.allow`). Never called with a config read from a run directory."""
    from stepgrpo_core.registry import allow, references_in

    allow(*references_in([data.get(s) for s in PLUGIN_SECTIONS if isinstance(data, Mapping)]))


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the config mapping `data` with `key=value` overrides (YAML values) applied."""
    out = copy.deepcopy(dict(data))
    for item in overrides or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. optim.lr=1e-4")
        value = load_yaml(raw, f"--set {key.strip()}") if raw.strip() else None
        if key.strip().split(".")[0] in PLUGIN_SECTIONS:
            allow_plugins({key.strip().split(".")[0]: value})  # an override is the user's own input
        if key.strip() == "optim.preset" and value is not None:  # the preset's fields, then later --sets
            optim = out.get("optim") if isinstance(out.get("optim"), dict) else {}
            out["optim"] = {**optim, **expand_preset({}, value, f"--set {item}")}
        _set_dotted(out, key.strip(), value)
    return out


MAX_YAML_VALUES = 100_000  # values a config may expand to, its aliases followed


def load_yaml(text: str, where: str) -> Any:
    """YAML text as data (safe types only), refused when its aliases expand beyond
    `MAX_YAML_VALUES` values or refer to themselves: a few hundred bytes of nested aliases (a
    "billion laughs") would otherwise expand to billions of values in every walk of the config."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None:
        sizes: dict[int, int] = {}
        open_: set[int] = set()

        def size(n: yaml.Node) -> int:
            if id(n) in sizes:
                return sizes[id(n)]
            if id(n) in open_:
                raise ConfigError(f"{where}: a YAML alias refers to the value it is part of; write the values out")
            open_.add(id(n))
            if isinstance(n, yaml.MappingNode):
                total = 1 + sum(size(k) + size(v) for k, v in n.value)
            elif isinstance(n, yaml.SequenceNode):
                total = 1 + sum(size(v) for v in n.value)
            else:
                total = 1
            open_.discard(id(n))
            sizes[id(n)] = min(total, MAX_YAML_VALUES + 1)
            return sizes[id(n)]

        if size(node) > MAX_YAML_VALUES:
            raise ConfigError(
                f"{where}: its YAML aliases expand to more than {MAX_YAML_VALUES} values (nested anchors, a "
                '"billion laughs"); a config needs no such thing: write the values out'
            )
    return yaml.safe_load(text)


BASE_KEY = "base"  # a config file may start from another one: `base: shapes_outcome.yaml`


def config_file(path: str | Path) -> Path:
    """A config file given as a path, or as the name of a shipped config (`shapes_outcome`: the
    shipped `configs/shapes_outcome.yaml`, `stepgrpo.paths`), when no such file is in the working directory."""
    given = Path(path)
    if given.is_file():
        return given
    if given.parent == Path("configs") and (SHIPPED_CONFIGS / given.name).is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist here (a checkout's path); the shipped recipe is "
            f"`--config {given.stem}` (`stepgrpo config list` names them all)"
        )
    if given.parent != Path(".") or given.suffix in (".yaml", ".yml"):
        return given
    shipped = SHIPPED_CONFIGS / f"{given.name}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config {str(path)!r} is neither a file nor a shipped config; the shipped ones: {names}")


def shipped_recipes() -> list[tuple[str, str]]:
    """The shipped recipes: `(name, the first sentence of its header comment)`, by name (the
    sentence whole, over as many comment lines as it takes)."""
    out = []
    for path in sorted(SHIPPED_CONFIGS.glob("*.yaml")):
        words: list[str] = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if not text and words:
                break  # the end of the first paragraph
            words.append(text)
        paragraph = " ".join(w for w in words if w)
        end = paragraph.find(". ")
        out.append((path.stem, paragraph if end < 0 else paragraph[: end + 1]))
    return out


def _read_config_file(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a mapping, with its `base` file (relative to it) merged underneath."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file {str(path)!r} is its own base (through {' -> '.join(p.name for p in seen)})")
    try:
        loaded = load_yaml(path.read_text(), f"config file {str(path)!r}") or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f", line {where.line + 1}" if where is not None else ""
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{line}: {getattr(err, 'problem', err)}"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    if isinstance(loaded.get("optim"), Mapping):
        loaded["optim"] = expand_preset(loaded["optim"], loaded["optim"].get("preset"), str(path))
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ConfigError(f"{path}: `base` must be the path of another config file, relative to this one")
    return _merge(_read_config_file(path.parent / base, (*seen, path.resolve())), loaded)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section (a section's free-form `options` are replaced whole)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k != "options" else v
    return out


def validate_config(data: Mapping[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p!r} is not a section")
    node[parts[-1]] = value


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """Allowed field names of the model that holds the location `loc` (minus its last part)."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = ".".join(loc) or "config"
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(loc)
            lines.append(f"{where}: unknown field; allowed: {', '.join(allowed)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" + (f" (got {e['input']!r})" if _short(e.get("input")) else ""))
    return "invalid config:\n  " + "\n  ".join(lines)


def _short(value: Any) -> bool:
    return isinstance(value, str | int | float | bool) and len(repr(value)) < 60
