"""The sections that say how trajectories are made and scored: the model, the sampler, the
completion of intermediate states, the reward, the credit scheme."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stepgrpo.config._section import DEFAULT_MODEL, MAX_STEPS, Section, completion_choices, registered


class ModelConfig(Section):
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


class SamplerConfig(Section):
    steps: int = Field(10, ge=1, le=MAX_STEPS)
    """T, the number of denoising steps of a training rollout (Flow-GRPO: 10)."""
    kernel: str = Field("flow", json_schema_extra=registered("kernels"))
    """Transition kernel of the stochastic steps: a name in `stepgrpo_core.kernels.KERNELS`."""
    noise: float = Field(0.7, ge=0.0)
    """Kernel noise parameter: `a` for flow (0.7; below sqrt 2) and cps (0.7; at most 1), `eta` for ddim
    (1.0; at most 1); unused by ode and psi. Checked against the kernel's range."""
    sde_window_start: int = Field(0, ge=0)
    """First stochastic step of the SDE window (MixGRPO, arXiv 2507.21802; Flow-GRPO-Fast); steps
    outside are ODE."""
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
    step with `kernel` and its own noise, then the ODE on (`tree_sde`: stochastic steps between).
    Every node is computed once; each transition is trained once. `credit.scheme: tree` credits it
    (BranchGRPO's tree advantage). It replaces the SDE window; None: no tree."""
    tree_sde: tuple[int, int] | None = None
    """A tree's stochastic steps besides its splits: `[lo, hi]`, and at steps `lo .. hi - 1` every
    node takes its one child's step with `kernel` (a transition trained once, as a split's) where
    it would follow the ODE. BranchGRPO's own rollouts: every step, `[0, T]`; BranchGRPO-Mix: a
    window. None: the ODE between the splits."""
    branch_anchor: list[int] | None = None
    """Anchor branching (G2RPO's singular stochastic sampling, Step-GRPO's k candidates a step;
    `stepgrpo_core.branching.anchor_rollout`): `[b_1, b_2, ...]`, steps increasing: each group's
    anchor follows the ODE from its initial noise, computed once, and at each listed step
    `run.group_size / len(steps)` members branch from the anchor's state there, each taking that
    step with `kernel` and its own noise, then the ODE on. The members that branch at one step are
    siblings: `credit.scheme: granular` or `local` compares them. It replaces the SDE window; None:
    no anchor."""
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
    def _noise_in_range(self) -> SamplerConfig:
        from stepgrpo_core.kernels import KERNELS

        spec = KERNELS.facts(self.kernel)["noise"]
        if spec is not None and not spec[1] <= self.noise <= spec[2]:
            name, lo, hi = spec
            raise ValueError(
                f"sampler.noise={self.noise:g}: kernel {self.kernel!r} takes its {name} in [{lo:g}, {hi:g}] "
                f"(stepgrpo_core.kernels, {self.kernel!r}'s docstring says why); the recipes use 0.7 for flow / cps, "
                "1.0 for ddim"
            )
        return self

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

        chosen = [n for n in ("branch_window", "branch_tree", "branch_anchor") if getattr(self, n) is not None]
        if self.tree_sde is not None and self.branch_tree is None:
            raise ValueError(
                "sampler.tree_sde: the stochastic steps between a tree's splits; set sampler.branch_tree (or, "
                "unbranched, sampler.sde_window_start / sde_window_size)"
            )
        if not chosen:
            return self
        name = f"sampler.{chosen[0]}"
        if len(chosen) > 1:
            raise ValueError(
                f"{' and '.join('sampler.' + n for n in chosen)}: each is a way to branch a group "
                "(at a drawn step, as a tree, off an anchor); set one"
            )
        if self.branch_anchor is not None:
            steps = self.branch_anchor
            if not steps or steps != sorted(set(steps)) or steps[0] < 0 or steps[-1] >= self.steps:
                raise ValueError(
                    f"sampler.branch_anchor {steps}: the branch steps, increasing within the {self.steps} steps "
                    f"(0 <= step < {self.steps})"
                )
        elif self.branch_window is not None:
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
            if self.tree_sde is not None and not 0 <= self.tree_sde[0] < self.tree_sde[1] <= self.steps:
                lo, hi = self.tree_sde
                raise ValueError(
                    f"sampler.tree_sde [{lo}, {hi}]: the stochastic steps lo .. hi - 1 must lie in the {self.steps} "
                    f"steps (0 <= lo < hi <= {self.steps})"
                )
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

    def branches(self) -> bool:
        """Whether each trajectory takes one stochastic step, its branch step (`branch_window`,
        `branch_anchor`): its members' densities sit at that step alone."""
        return self.branch_window is not None or self.branch_anchor is not None

    def tree(self) -> list[tuple[int, int]] | None:
        """A tree rollout's stochastic steps `[(step, factor), ...]`, increasing: its splits
        (`branch_tree`) and, factor 1, the steps of `tree_sde` between them (a node's one child).
        None without a tree."""
        if self.branch_tree is None:
            return None
        splits = {int(b): int(f) for b, f in self.branch_tree}
        sde = range(*self.tree_sde) if self.tree_sde is not None else range(0)
        return sorted({**dict.fromkeys(sde, 1), **splits}.items())

    def window(self) -> tuple[int, int]:
        """The stochastic steps `[start, end)` (branched: the steps a group may branch at)."""
        if self.branch_window is not None:
            return int(self.branch_window[0]), int(self.branch_window[1])
        if (tree := self.tree()) is not None:
            return int(tree[0][0]), int(tree[-1][0]) + 1
        if self.branch_anchor is not None:
            return int(self.branch_anchor[0]), int(self.branch_anchor[-1]) + 1
        size = self.sde_window_size or self.steps - self.sde_window_start
        return self.sde_window_start, self.sde_window_start + size


class CompletionConfig(Section):
    method: str | None = Field("remaining", json_schema_extra=completion_choices)
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


class RewardConfig(Section):
    name: str = Field("shapes", json_schema_extra=registered("rewards"))
    """Reward model: a name in `stepgrpo.rewards.REWARDS`."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the reward factory (e.g. a hub id or local path of its weights)."""

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        from stepgrpo.rewards import REWARDS

        return REWARDS.validate(v)


class CreditConfig(Section):
    scheme: str = Field("outcome", json_schema_extra=registered("schemes"))
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
