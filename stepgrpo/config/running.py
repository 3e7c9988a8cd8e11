"""The sections that say how a run is driven: prompts and iterations, the curriculum, storage,
scale-out, tracking."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from stepgrpo.config._section import Section


class RunConfig(Section):
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
    """A paper's evaluation protocol (`stepgrpo config variants` lists them) under which every
    held-out evaluation also measures the policy, each with its evidence bundle in the run's
    `evidence/` (as `stepgrpo evaluate RUN --protocol NAME`;
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


class CurriculumConfig(Section):
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


class StorageConfig(Section):
    images: bool = True
    """Keep the uint8 images the reward saw (every scored state) so that re-scoring with another
    reward skips the VAE. 3 x H x W bytes a state: 3 KB at 32 px, 768 KB at 512 px (six times a
    fp16 SD3 latent); turn off for large images if disk matters more than re-scoring time."""
    branch_nodes: Literal["auto", "always", "never"] = "auto"
    """How a branched rollout (`sampler.branch_window`, `branch_tree`, `branch_anchor`) stores its
    states and velocities: `always` each node once, one state a file with a table naming which
    trajectory's file holds each (a member's shared prefix stored once); `never` each trajectory
    whole, one file a trajectory; `auto` by node where a state is at least 16 KiB (every SD3 or
    Flux latent of 256 px or more), whole where smaller files would cost more disk than the prefix
    saves (the shipped model's 1 KiB states). Either reads the same."""
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


class ScaleConfig(Section):
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
    stage_retry_delay_s: float = Field(10.0, ge=0, le=3600)
    """Seconds Prefect waits before it runs a failed stage task again (`stage_retries`): time for a
    preempted node to come back or a reward server to restart."""
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
    update_sharding: Literal["none", "fsdp"] = "none"
    """`none`: every update rank holds the whole policy and its AdamW state, and one all-reduce a
    step sums the gradients (enough for LoRA). `fsdp`: the trained transformer (and a full
    fine-tune's reference copy) sharded over the `update_processes` ranks with PyTorch's FSDP2, per
    block: each rank holds 1 / world of the weights, gradients and AdamW moments (full fine-tuning
    past one GPU's memory; docs/SCALING.md, "Sharded update"). The checkpoints are the same whole
    safetensors either way, so a run resumes with either setting and any number of ranks."""
    update_offload: bool = False
    """With `update_sharding: fsdp` on GPUs: keep the shards and AdamW's state in host memory (FSDP2's
    CPU offload; AdamW then steps on the CPU); slower, for a model whose shards do not fit."""

    @model_validator(mode="after")
    def _sharding(self) -> ScaleConfig:
        if self.update_sharding == "fsdp" and self.update_processes < 2:
            raise ValueError(
                "scale.update_sharding: fsdp shards the update over its ranks, and scale.update_processes is 1: "
                "set scale.update_processes to 2 or more (or leave update_sharding at none)"
            )
        if self.update_offload and self.update_sharding != "fsdp":
            raise ValueError(
                "scale.update_offload keeps a sharded update's shards in host memory: set scale.update_sharding: fsdp"
            )
        return self


class TrackingConfig(Section):
    backend: Literal["mlflow", "wandb"] = "mlflow"
    """Where training runs are tracked: `mlflow` (a SQLite store under the runs root, or
    `MLFLOW_TRACKING_URI`'s) or `wandb` (Weights & Biases: `pip install 'stepgrpo[wandb]'`, log in
    with `wandb login`, or `WANDB_MODE=offline`). The offline commands (`rescore`, `credit`,
    `evaluate`) on a run log where the run was tracked."""
    project: str | None = None
    """The W&B project; null: the MLflow experiment's name (`STEPGRPO_EXPERIMENT`, default stepgrpo)."""
