"""What each pipeline stage returns: small typed records that round-trip through JSON.

A stage's output lives in the run directory; its result names it (`digest`) and carries the
counts, NFEs, seconds and summary numbers the flows track. A result is also what the downstream
stages take: `stepgrpo.tasks.keys` builds a stage's cache key from its upstream results'
`key_inputs`, so the key names exactly the data a stage reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, model_validator

from stepgrpo.storage.publish import SEAL_KEY


class Result(BaseModel):
    """A stage's typed result (frozen; unknown fields are an error)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the peak GPU memory of the call that returned it (`stepgrpo.tasks.base.stage_task`; None on a CPU)
    peak_memory_gib: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _untyped_record(cls, data: Any) -> Any:
        """Records written as plain dicts (calibration and evaluation files of older runs) also
        named their stage; the type says it now. A stored record's seal (`stepgrpo.storage.publish.seal`) is
        checked by the reader that reads its file, not part of the result."""
        if isinstance(data, dict) and ("stage" in data or SEAL_KEY in data):
            data = {k: v for k, v in data.items() if k not in ("stage", SEAL_KEY)}
        return data

    def to_json(self) -> str:
        """The result as stored and returned by the flows: JSON, fields without a value left out."""
        return self.model_dump_json(exclude_none=True)

    def record(self) -> dict[str, Any]:
        """`to_json`'s content as a dict (what a flow returns)."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Any:
        return cls.model_validate_json(text)


class StageResult(Result):
    """A result that names published data by its content digest."""

    digest: str

    def key_inputs(self, name: str) -> dict[str, Any]:
        """What a downstream stage's cache key records of this input, named `name` there."""
        return {name: self.digest}


class PromptsResult(StageResult):
    rows: int


class CalibrateResult(StageResult):
    """DenseGRPO's `psi` table (one noise level per step) and the history of its rounds."""

    key: str
    psi: list[float]
    rounds: list[dict[str, Any]]
    seconds: float


class DrawResult(StageResult):
    """The training prompts an iteration draws under the curriculum (`stepgrpo.tasks.draw`)."""

    iteration: int
    prompt_ids: list[int]  # one per group, in group order
    seen: int  # training prompts with a group in the window
    zero_spread: int  # of those, prompts whose groups all had zero spread
    weight_max: float  # the largest weight, relative to an average prompt's 1


class RolloutResult(StageResult):
    iteration: int
    trajectories: int
    nfe: int  # transformer rows of the SDE sampling
    nfe_ode: int  # of the ODE reference of each group
    seconds: float


class CompleteResult(StageResult):
    iteration: int
    method: str
    nfe: int
    seconds: float


class ScoreResult(StageResult):
    """One reward's rows of an iteration (`stepgrpo.loops.scoring.reward_summary` for the numbers)."""

    iteration: int
    reward_name: str
    reward_version: str
    images: str  # where the images came from: stored, decoded, decoded+stored, none (rows were stored)
    seconds: float
    reward_mean: float
    reward_std: float
    group_reward_std: float
    zero_std_groups: float
    reward_strict: float | None = None
    ode_reward_mean: float | None = None
    ode_reward_strict: float | None = None
    reward_per_state: list[float] | None = None

    def key_inputs(self, name: str) -> dict[str, Any]:
        return {name: self.digest, "reward": [self.reward_name, self.reward_version]}


class CreditResult(StageResult):
    iteration: int
    scheme: str
    options_digest: str
    seconds: float
    adv_mean: float
    adv_std: float
    adv_abs_max: float
    zero_std_ratio: float
    turning_points: int
    gain_mean: list[float]

    def key_inputs(self, name: str) -> dict[str, Any]:
        return {name: self.digest, "scheme": self.scheme, "options_digest": self.options_digest}


Steps = list[float | None]  # one value per trained step (`trained_step_ids`), None where not finite


class UpdateStats(BaseModel):
    """What an update measured (`stepgrpo.loops.training.Diagnostics.summary`, stored in the
    checkpoint's `state.json`): loss terms, the ratio's spread, clipping and zero-gradient shares
    overall, on the first and later optimizer steps and per trained step, where the gradient energy
    sits, the signal check, and the LoRA's movement. A value is None where it was not finite (or
    not recorded by the version that stored it). Frozen; names it does not know are kept out."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    loss: float | None = None
    policy_loss: float | None = None
    kl: float | None = None
    approx_kl: float | None = None
    ratio_mean: float | None = None
    ratio_std: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    clip_frac: float | None = None
    clip_frac_first: float | None = None
    clip_frac_later: float | None = None
    clip_frac_first_by_step: Steps = []
    clip_frac_later_by_step: Steps = []
    zero_grad_frac: float | None = None
    zero_grad_frac_first: float | None = None
    zero_grad_frac_later: float | None = None
    zero_grad_frac_first_by_step: Steps = []
    zero_grad_frac_later_by_step: Steps = []
    clip_frac_by_part: Steps = []  # per optimizer step of the iteration (part 0 on-policy)
    zero_grad_frac_by_part: Steps = []
    grad_energy_share: Steps = []
    grad_norm: float | None = None
    signal_cosine: float | None = None  # the two halves of this update's batches
    signal_cosine_window: float | None = None  # the same, summed over the recent iterations
    signal_iterations: int = 0  # how many iterations that window sums
    update_norms: Steps = []  # each optimizer step's change
    update_norm: float | None = None  # the iteration's change
    lora_distance: float | None = None  # from the initial LoRA
    trained_steps: int | None = None
    trained_step_ids: list[int] = []
    trained_trajectories: int | None = None
    optimizer_steps: int | None = None
    # the flow-matching objectives (`update.objective` nft, awm): (sample, time) rows trained, the
    # companion adapter's last decay, and each objective's own terms
    rows: int | None = None
    companion_decay: float | None = None
    r_mean: float | None = None  # nft: the mean weight of the positive branch
    old_deviation: float | None = None  # nft: mean |v - v_old|^2
    ema_kl: float | None = None  # awm: mean |v - v_ema|^2


class UpdateResult(StageResult):
    """The checkpoint an update published (`digest`), what the update measured (`stats`) and its
    transformer forwards (`nfe`; 0 for checkpoints stored before it was recorded)."""

    iteration: int
    seconds: float
    stats: UpdateStats
    nfe: int = 0


class EvaluateResult(Result):
    """Held-out reward of one policy: one score per (seed, prompt), seed-major, so two
    evaluations of a run compare pair by pair (`stepgrpo.reporting.report.paired_gain`)."""

    label: str  # "base" or "iter_<k>"
    iteration: int | None = None  # None: the base model
    key: str
    reward_name: str
    reward_version: str
    prompts: int
    seeds: int
    reward_mean: float
    reward_std: float
    nfe: int
    scores: list[float]
    grid: str  # the image grid, relative to the run directory
    seconds: float
    reward_strict: float | None = None
    strict_scores: list[float] | None = None
    sub: dict[str, float] = {}  # each sub-score's mean

    @model_validator(mode="before")
    @classmethod
    def _flat_sub_scores(cls, data: Any) -> Any:
        """Evaluations stored before `sub` kept each sub-score as a `sub_<name>` field."""
        if isinstance(data, dict) and any(k.startswith("sub_") for k in data):
            data = dict(data)
            data["sub"] = {k.removeprefix("sub_"): data.pop(k) for k in list(data) if k.startswith("sub_")}
        return data


class QualityResult(Result):
    """The credit-quality check of one stored iteration (`stepgrpo.tasks.quality`, METHODS.md "Judging credit")."""

    key: str  # what the check read (its cache key)
    iteration: int
    continuations: int  # M, SDE continuations per state
    seed: int  # the continuations' seed (each chunk's generator derives from it, the run seed and k)
    reward_name: str
    reward_version: str
    trajectories: int  # B
    groups: int  # prompt groups (the bootstrap's unit)
    trained_steps: list[int]
    schemes: list[str]  # judged, in order; a scheme that needs step rewards is skipped on final-only runs
    skipped: list[str]  # schemes that could not be judged, with why
    steps: list[dict[str, Any]]  # per trained step: stepgrpo_core.quality.step_table
    gradient: dict[str, Any]  # "uniform" / "noise": {"reliability", "half_cosine", "rows": per scheme}
    values: list[list[float]]  # [B, T+1] V(x_k), the Monte-Carlo true values
    value_halves: list[list[list[float]]]  # [2, B, T+1] the same from each half of the continuations
    nfe: int  # transformer rows of the continuations
    score_rows: int  # per-row scores of the gradient check
    seconds: float
    seconds_continuations: float
    seconds_gradient: float
    # completion method -> {"nfe_per_trajectory", "seconds"}: the step rewards judged (the run's own
    # first; another method's tables are named `scheme:method`); None: the run's own method alone
    methods: dict[str, dict[str, float]] | None = None


class Gain(NamedTuple):
    """A paired held-out gain of the trained model over the base: the mean difference and its 95 %
    interval, the prompt the unit (`stepgrpo.reporting.report.paired_gain`). Unpacks as
    `mean, low, high`; prints as `+0.0645 [+0.0240, +0.1049]`."""

    mean: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes 0 (the gain is beyond the evaluation's noise)."""
        return self.low > 0 or self.high < 0
