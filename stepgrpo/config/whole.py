"""The whole config (its sections and the checks across them), and the part of it each stage's
cache key is built from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import yaml
from pydantic import Field, model_validator

from stepgrpo.config._section import MAX_TRAJECTORIES, Section
from stepgrpo.config.running import CurriculumConfig, RunConfig, ScaleConfig, StorageConfig, TrackingConfig
from stepgrpo.config.sampling import CompletionConfig, CreditConfig, ModelConfig, RewardConfig, SamplerConfig
from stepgrpo.config.training import CalibrationConfig, OptimConfig, UpdateConfig


class Config(Section):
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
    def _offload_from_a_gpu(self) -> Config:
        if self.scale.update_offload and not self.model.device.startswith("cuda"):
            raise ValueError(
                f"scale.update_offload moves a sharded update's shards from GPU to host memory, and model.device is "
                f"{self.model.device!r}: they are in host memory already (leave update_offload false)"
            )
        return self

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
        self._width_pruning()
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
        if (anchor := self.sampler.branch_anchor) is not None and self.run.group_size % len(anchor):
            raise ValueError(
                f"sampler.branch_anchor {anchor}: run.group_size ({self.run.group_size}) must be a multiple of its "
                f"{len(anchor)} steps (the children of each step)"
            )
        from stepgrpo_core.credit import reads_branch, reads_tree

        if reads_branch(self.credit.scheme) and not self.sampler.branches():
            raise ValueError(
                f"credit.scheme {self.credit.scheme} compares siblings that share a branch step: set "
                "sampler.branch_anchor or sampler.branch_window (or pick another scheme)"
            )

        if reads_tree(self.credit.scheme) and tree is None:
            raise ValueError(
                f"credit.scheme {self.credit.scheme} reads the rollout's tree: set sampler.branch_tree (or pick "
                "another scheme)"
            )
        b = self.sampler.window() if self.sampler.branch_window or anchor else None
        b = (tree[0][0], tree[-1][0] + 1) if tree else b  # a tree's splits (a tree_sde step may be the last)
        if b is not None and b[1] == self.sampler.steps and not self.optim.train_final_step:
            listed = [s for s, _ in tree] if tree else anchor if anchor else list(range(*b))
            raise ValueError(
                f"the branch steps {listed} reach the final step, "
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

    def _width_pruning(self) -> None:
        """Refuse a width pruning with nothing to act on: it cuts a tree's trained transitions after
        its last split."""
        if self.optim.width_pruning == "off":
            return
        name = f"optim.width_pruning {self.optim.width_pruning}"
        tree = self.sampler.tree()
        if tree is None:
            raise ValueError(f"{name} prunes a tree's transitions: set sampler.branch_tree (or width_pruning: off)")
        if not self.update.on_transitions:
            raise ValueError(
                f"{name} prunes the rollout's transitions; update.objective {self.update.objective} trains on noised "
                "copies of the samples: set width_pruning: off"
            )
        last = max(int(b) for b, _ in self.sampler.branch_tree or ())
        if not any(k > last for k in self.trained_steps() if k in dict(tree)):
            raise ValueError(
                f"{name} acts on the trained stochastic steps after the tree's last split (step {last}); there are "
                f"none: set sampler.tree_sde to reach past step {last + 1} (BranchGRPO: [0, {self.sampler.steps}])"
            )

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

    def notes(self, user_set: Collection[str] = ()) -> list[str]:
        """What a run of this config should be told once before it starts (not errors), about what the
        user set themselves (`user_set`: `section.field` keys; a shipped recipe's own values are not
        questioned)."""
        o = self.optim
        if "optim.clip_range" not in user_set:
            return []
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
        "sampler.tree_sde",
        "sampler.branch_anchor",
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
    "sampler.tree_sde": None,
    "sampler.branch_anchor": None,
    "optim.step_weighting": "uniform",
    "optim.width_pruning": "off",
    "optim.width_keep": 0.5,
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
