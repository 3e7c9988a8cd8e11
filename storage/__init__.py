"""The run directory: Zarr stage stores, append-only Parquet tables, atomic publish, locks, schema.

Every array, axis, dtype, chunking, column and the schema version is declared in
`stepgrpo.storage.schema`. The layout of a run is in `stepgrpo.storage.run`'s docstring.

Public API: a `Run` and its three parts, `run.stages`, `run.tables` and `run.checkpoints`:

- `Run.create(root, run_id, config, exist_ok=False) -> Run`, `Run.open(path) -> Run`
  (`SchemaVersionError` names the version found and what to do). `run.config`, `run.manifest`.
- Stages, named `"rollout"`, `"completions/<method>"`, `"images/<source>"`, `"checkpoint"`:
  `stage_path(iteration, stage) -> Path`, `stage_manifest(iteration, stage) -> dict | None`
  (None until published; `["digest"]` is the content digest for cache keys, `["counts"]`,
  `["attrs"]`, `["schema_version"]`), `iterations(stage="rollout") -> list[int]`.
- Writing a stage (`run.stages`): `begin_rollout(iteration, *, sigmas [T+1], seeds [B], prompt_ids [B],
  group_ids [B], latent_shape (C, H, W), latent_dtype, kernel, kernel_params, attrs=None)` and
  `begin_completion(iteration, method, *, latent_dtype=None, attrs=None)` return a
  `StageWriter`: `writer.write(start, **arrays)` writes trajectories `start .. start+n`
  (`states [n,T+1,C,H,W]`, `log_probs [n,T]`, `stds [n,T]`; completions: `latents`),
  `writer.publish(attrs=None, inputs=None) -> manifest`. Beginning takes the stage's lock (a
  second writer gets `StageLockedError`; a crashed writer's stale lock and leftovers are cleaned)
  and refuses a published stage (`AlreadyPublishedError`). Other processes join a begun stage with
  `run.attach(iteration, stage, writer.token)` and write disjoint trajectories.
- Reading (`run.stages`): `read_rollout(iteration, trajectories=None) -> RolloutData`,
  `read_completion(iteration, method, trajectories=None) -> CompletionData`,
  `read_array(iteration, stage, name, trajectories=None) -> np.ndarray`; a damaged chunk raises
  `CorruptChunkError` naming the array and chunk.
- Decoded images (`run.stages`; a cache of the VAE decode, so re-scoring skips it):
  `begin_images(iteration, source, *, k [K], image_shape (3, Y, X))` with `source` `"rollout"`
  (final states) or `"completions/<method>"`, then `write(start, images=[n,K,3,Y,X] uint8)`;
  `read_images(iteration, source) -> ImagesData | None` (None when absent or decoded from other
  content than the source holds now); `images_stage(source)` names the stage.
- Prompts (`run.tables`): `write_prompts(prompt_ids, texts, splits, metadata=None)`, `read_prompts() -> pa.Table`,
  `prompts_manifest() -> dict | None`.
- Rewards (`run.tables`): `append_rewards(iteration, reward_name, reward_version, traj, k, value, strict=None,
  sub=None)` (NaN/inf values raise ValueError naming the rows; stored keys are refused, identical
  re-appends are no-ops), `read_rewards(iteration=None, reward_name=None, reward_version=None,
  as_pandas=False)`, `reward_grid(iteration, reward_name, reward_version=None, field="value") ->
  Tensor [B, T+1]`, `rewards_digest(iteration, reward_name, reward_version) -> str`.
- Advantages (`run.tables`): `append_advantages(iteration, scheme, options, traj, k, value)`,
  `read_advantages(iteration=None, scheme=None, options_digest=None, as_pandas=False)`,
  `advantage_grid(iteration, scheme, options_digest=None) -> Tensor [B, T]`,
  `advantages_digest(...)`, `scheme_options(options_digest)`; `stepgrpo.storage.options_digest(options)`.
- Checkpoints (`run.checkpoints`): `save_checkpoint(iteration, tensors {group: {name: Tensor}}, state JSON)`,
  `load_checkpoint(iteration=None) -> Checkpoint`, `latest_checkpoint()`, and
  `begin_checkpoint(iteration)` to write other data files (e.g. a diffusers LoRA directory) under
  `writer.path` before `writer.publish()`. Files other than JSON/YAML/Parquet/safetensors are
  refused: a run directory is data, never code.

Example::

    run = Run.create("runs", "demo", config)
    with run.stages.begin_rollout(0, sigmas=sigmas, seeds=seeds, prompt_ids=pids, group_ids=gids,
                                  latent_shape=(16, 64, 64), latent_dtype="bfloat16",
                                  kernel="sde", kernel_params={"eta": 0.7}) as w:
        w.write(0, states=states, log_probs=log_probs, stds=stds)  # trajectories 0..B-1
        manifest = w.publish(inputs={"cache_key": key})
    data = run.stages.read_rollout(0)                 # data.states: [B, T+1, C, H, W] float32
    run.stage_manifest(0, "rollout")["digest"]  # what downstream cache keys use
"""

from stepgrpo.storage.errors import (
    AlreadyPublishedError,
    CorruptChunkError,
    IncompleteStageError,
    NotPublishedError,
    SchemaVersionError,
    StageLockedError,
    StorageError,
)
from stepgrpo.storage.publish import options_digest
from stepgrpo.storage.run import Checkpoint, CompletionData, RolloutData, Run, StageWriter, find_run
from stepgrpo.storage.schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "AlreadyPublishedError",
    "Checkpoint",
    "CompletionData",
    "CorruptChunkError",
    "IncompleteStageError",
    "NotPublishedError",
    "RolloutData",
    "Run",
    "SchemaVersionError",
    "StageLockedError",
    "StageWriter",
    "find_run",
    "StorageError",
    "options_digest",
]
