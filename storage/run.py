"""A run directory: the manifest, per-iteration stage stores, tables and checkpoints.

```
runs/<run_id>/
  manifest.json                   config, code version, schema version, creation time
  prompts.parquet                 written once; manifest (digest, rows) in the Parquet footer
  iter_<k>/rollout.zarr/          ROLLOUT store + _published.json
  iter_<k>/completions/<m>.zarr/  COMPLETION store of method <m> + _published.json
  iter_<k>/images/<s>.zarr/       IMAGES store: decoded images of source <s> (a method, or final)
  rewards/part-<digest>.parquet   append-only, one file per append
  advantages/part-<digest>.parquet, advantages/options-<digest>.json (the scheme options)
  checkpoints/iter_<k>/           <group>.safetensors + state.json + _published.json
```

Stages are named `"rollout"`, `"completions/<method>"` and `"checkpoint"`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import zarr

from storage import tables
from storage.arrays import StageStore
from storage.errors import (
    AlreadyPublishedError,
    CorruptChunkError,
    NotPublishedError,
    SchemaVersionError,
    StorageError,
)
from storage.publish import (
    acquire_lock,
    canonical_json,
    check_json,
    check_token,
    fresh_partial,
    lock_path,
    options_digest,
    partial_path,
    publish_dir,
    read_published,
    release_lock,
    utc_now,
    write_file_atomic,
)
from storage.schema import (
    ADVANTAGES_KEY,
    ADVANTAGES_SCHEMA,
    ALLOWED_FILE_SUFFIXES,
    COMPLETION,
    IMAGES,
    PUBLISHED_FILE,
    REWARDS_KEY,
    REWARDS_SCHEMA,
    ROLLOUT,
    SCHEMA_VERSION,
    StoreSpec,
    latent_storage_dtype,
)

if TYPE_CHECKING:
    import torch

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # run ids and method names: one path component
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"


def _check_name(name: str, what: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must match {NAME_RE.pattern} (letters, digits, _ . -)")
    return name


def code_version() -> dict[str, Any]:
    """The package version and, when the code is a git checkout, its commit."""
    try:
        version = importlib.metadata.version("stepgrpo")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        commit = out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"package": version, "git_commit": commit}


def _check_schema(found: Any, what: str) -> None:
    if found != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{what} was written with storage schema version {found}; this code reads version "
            f"{SCHEMA_VERSION}. Open it with the stepgrpo version that wrote it (see code_version in "
            "the run's manifest.json), or re-run it with this version."
        )


@dataclass(frozen=True)
class RolloutData:
    """A stored rollout (rows = the trajectories read)."""

    states: np.ndarray  # [n, T+1, C, H, W] float16 or float32 (bf16 runs: float32)
    log_probs: np.ndarray  # [n, T] float32, NaN outside the SDE window
    stds: np.ndarray  # [n, T] float32
    ode_final: np.ndarray  # [n, C, H, W] the ODE sample from each trajectory's x_0 (shared by its group)
    sigmas: np.ndarray  # [T+1] float32
    seeds: np.ndarray  # [n] int64
    prompt_ids: np.ndarray  # [n] int64
    group_ids: np.ndarray  # [n] int64
    kernel: str  # kernel registry name
    kernel_params: dict[str, Any]  # its options
    manifest: dict[str, Any]  # the stage's _published.json (digest, counts, attrs)


@dataclass(frozen=True)
class CompletionData:
    """A stored completion of one method."""

    latents: np.ndarray  # [n, T+1, C, H, W], completion of every state
    method: str
    nfe: int  # transformer rows evaluated for the whole stage
    manifest: dict[str, Any]


@dataclass(frozen=True)
class ImagesData:
    """Stored decoded images of one source."""

    images: np.ndarray  # [n, K, 3, Y, X] uint8
    k: np.ndarray  # [K] int64: the state index of each image along K
    source: str  # "rollout" (x_T only) or "completions/<method>"
    source_digest: str  # digest of the stage the latents were read from
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    """A stored checkpoint."""

    iteration: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group (e.g. "lora", "optimizer") -> name -> tensor
    state: dict[str, Any]  # small JSON state (iteration, RNG states as lists of ints, ...)
    manifest: dict[str, Any]


class StageWriter:
    """Writes one stage into its `.partial` directory, then publishes it atomically.

    Made by `Run.begin_*` (takes the stage lock) or `Run.attach` (another process joining with the
    begin's `token`; it writes its own trajectories and does not own the lock). Use as a context
    manager: leaving it on an exception discards the attempt and releases the lock.
    """

    def __init__(self, run: Run, iteration: int, stage: str, token: str, owner: bool,
                 spec: StoreSpec | None) -> None:
        self.run = run
        self.iteration = iteration
        self.stage = stage
        self.token = token  # pass to `Run.attach` in other writer processes
        self.owner = owner
        self.final = run.stage_path(iteration, stage)
        self.path = partial_path(self.final)  # file stages (checkpoint) write their files here
        self.lock = lock_path(self.final)
        self.spec = spec
        self._store: StageStore | None = None
        self.manifest: dict[str, Any] | None = None

    @property
    def what(self) -> str:
        return f"run {self.run.run_id} iteration {self.iteration} stage {self.stage}"

    def store(self) -> StageStore:
        if self.spec is None:
            raise StorageError(f"{self.what} is a file stage: write files under writer.path")
        if self._store is None:
            self._store = StageStore.open(self.path, self.spec)
        return self._store

    def write(self, start: int, **arrays: Any) -> None:
        """Write trajectories `start .. start+n` of per-trajectory arrays, e.g. `states=[n,T+1,C,H,W]`.

        Writers in different processes may write disjoint ranges of the same stage concurrently.
        """
        check_token(self.lock, self.token, self.what)
        self.store().write(start, arrays)

    def publish(self, attrs: Mapping[str, Any] | None = None, inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Check completeness and checksums, digest, and make the stage visible (one rename).

        `attrs` are added to the store's attrs before digesting (e.g. a completion's `nfe`);
        `inputs` (e.g. the cache-key inputs) are recorded in the manifest, not digested.
        Returns the manifest (`digest`, `counts`, `schema_version`, ...), also `stage_manifest`'s.
        """
        check_token(self.lock, self.token, self.what)
        manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run.run_id,
            "iteration": self.iteration,
            "stage": self.stage,
            "inputs": dict(inputs or {}),
            "published_at": utc_now(),
        }
        if self.spec is not None:
            if attrs:
                check_json(dict(attrs), f"{self.what} attrs")
                zarr.open_group(str(self.path), mode="r+", zarr_format=3).attrs.update(dict(attrs))
            self._store = None
            store = self.store()
            missing = [a for a in self.spec.required_attrs if a not in store.attrs]
            if missing:
                raise ValueError(f"{self.what}: attrs {missing} are required to publish (pass them to publish())")
            digest, nbytes = store.verify_and_digest()
            counts = {"trajectories": store.B, "steps": store.sizes.get("T"), "states": store.sizes.get("T+1", store.sizes.get("K"))}
            manifest.update(
                digest=digest,
                counts={**{k: v for k, v in counts.items() if v is not None}, "bytes": nbytes},
                attrs=store.attrs,
            )
        else:
            if attrs:
                raise ValueError(f"{self.what}: file stages take no attrs; write a JSON file instead")
            digest, nbytes, files = _digest_files(self.path)
            manifest.update(digest=digest, counts={"files": files, "bytes": nbytes})
        publish_dir(self.path, self.final, manifest)
        release_lock(self.lock, self.token)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Discard this attempt: delete the `.partial` directory and release the lock (owner only)."""
        if self.owner and self.manifest is None:
            shutil.rmtree(self.path, ignore_errors=True)
            release_lock(self.lock, self.token)

    def __enter__(self) -> StageWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self.owner and self.manifest is None:
            release_lock(self.lock, self.token)  # left unpublished: the next begin redoes it


def _digest_files(root: Path) -> tuple[str, int, int]:
    """sha256 over the sorted relative paths and bytes of the files under `root`; refuses non-data files."""
    digest = hashlib.sha256()
    total = count = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != PUBLISHED_FILE):
        rel = path.relative_to(root).as_posix()
        if path.suffix not in ALLOWED_FILE_SUFFIXES:
            raise ValueError(
                f"{rel}: a run directory holds data only ({', '.join(ALLOWED_FILE_SUFFIXES)}); "
                "no pickle or code. Save tensors with safetensors and small state as JSON."
            )
        data = path.read_bytes()
        digest.update(canonical_json([rel, len(data)]).encode())
        digest.update(data)
        total += len(data)
        count += 1
    return digest.hexdigest(), total, count


class Run:
    """A run directory. Make one with `Run.create`, open one with `Run.open`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.run_id: str = manifest["run_id"]

    @property
    def config(self) -> dict[str, Any]:
        """The full config the run was created with."""
        return self.manifest["config"]

    # --- create / open ------------------------------------------------------------------------

    @classmethod
    def create(cls, root: str | os.PathLike[str], run_id: str, config: Mapping[str, Any], exist_ok: bool = False) -> Run:
        """Create `root/run_id/` with its manifest. `config` must be plain JSON.

        With `exist_ok`, an existing run with the same config is opened (to resume it); one with a
        different config raises.
        """
        _check_name(run_id, "run id")
        check_json(dict(config), "the run config")
        path = Path(root) / run_id
        if path.exists():
            if not exist_ok:
                raise FileExistsError(f"run {run_id} already exists at {path}; open it with Run.open or pick another id")
            run = cls.open(path)
            if canonical_json(run.config) != canonical_json(dict(config)):
                raise ValueError(f"run {run_id} exists with a different config; use another run id to change it")
            return run
        manifest = {
            "run_id": run_id,
            "schema_version": SCHEMA_VERSION,
            "created_at": utc_now(),
            "code_version": code_version(),
            "config": dict(config),
        }
        tmp = Path(root) / f".{run_id}.{secrets.token_hex(4)}.creating"
        tmp.mkdir(parents=True)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        try:
            os.rename(tmp, path)  # atomic: a run directory always has its manifest
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if exist_ok:
                return cls.create(root, run_id, config, exist_ok=True)
            raise FileExistsError(f"run {run_id} was created concurrently at {path}; open it with Run.open") from None
        return cls(path, manifest)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Run:
        """Open an existing run; raises SchemaVersionError if it was written with another schema."""
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is not a run directory (no {MANIFEST_FILE}); create it with Run.create") from None
        _check_schema(manifest.get("schema_version"), f"run {manifest.get('run_id', path.name)}")
        return cls(path, manifest)

    # --- stages -------------------------------------------------------------------------------

    def stage_path(self, iteration: int, stage: str) -> Path:
        """Where `stage` of `iteration` is published ("rollout", "completions/<method>", "checkpoint")."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if stage == "rollout":
            return self.path / f"iter_{iteration}" / "rollout.zarr"
        if stage.startswith("completions/"):
            method = _check_name(stage.split("/", 1)[1], "completion method")
            return self.path / f"iter_{iteration}" / "completions" / f"{method}.zarr"
        if stage.startswith("images/"):
            source = _check_name(stage.split("/", 1)[1], "image source")
            return self.path / f"iter_{iteration}" / "images" / f"{source}.zarr"
        if stage == "checkpoint":
            return self.path / "checkpoints" / f"iter_{iteration}"
        raise ValueError(
            f"unknown stage {stage!r}; stages are 'rollout', 'completions/<method>', 'images/<source>', 'checkpoint'"
        )

    def stage_manifest(self, iteration: int, stage: str) -> dict[str, Any] | None:
        """The stage's `_published.json` (digest, counts, schema version), or None if not published."""
        manifest = read_published(self.stage_path(iteration, stage))
        if manifest is not None:
            _check_schema(manifest.get("schema_version"), f"{self.run_id} iteration {iteration} {stage}")
        return manifest

    def iterations(self, stage: str = "rollout") -> list[int]:
        """Iterations whose `stage` is published, ascending."""
        found = []
        for d in list(self.path.glob("iter_*")) + list((self.path / "checkpoints").glob("iter_*")):
            try:
                k = int(d.name.removeprefix("iter_"))
            except ValueError:
                continue
            if k not in found and (self.stage_path(k, stage) / PUBLISHED_FILE).exists():
                found.append(k)
        return sorted(found)

    def _begin(self, iteration: int, stage: str, spec: StoreSpec | None) -> StageWriter:
        final = self.stage_path(iteration, stage)
        what = f"run {self.run_id} iteration {iteration} stage {stage}"
        if read_published(final) is not None:
            raise AlreadyPublishedError(f"{what} is already published (stages are immutable); read it instead")
        final.parent.mkdir(parents=True, exist_ok=True)
        token = acquire_lock(lock_path(final), what)
        if read_published(final) is not None:  # published while we waited for the lock
            release_lock(lock_path(final), token)
            raise AlreadyPublishedError(f"{what} is already published (stages are immutable); read it instead")
        fresh_partial(final)  # a crashed attempt's leftovers go
        return StageWriter(self, iteration, stage, token, owner=True, spec=spec)

    def begin_rollout(
        self,
        iteration: int,
        *,
        sigmas: Any,
        seeds: Any,
        prompt_ids: Any,
        group_ids: Any,
        latent_shape: Sequence[int],
        latent_dtype: str,
        kernel: str,
        kernel_params: Mapping[str, Any],
        attrs: Mapping[str, Any] | None = None,
    ) -> StageWriter:
        """Begin the rollout of `iteration`: the plan (`sigmas [T+1]`, `seeds, prompt_ids, group_ids [B]`)
        is written now; `states`, `log_probs`, `stds`, `ode_final` are written per trajectory with `writer.write`.

        `latent_shape` is `(C, H, W)`; `latent_dtype` the compute dtype ("float16", "float32",
        "bfloat16" -> stored as float32). Raises StageLockedError if another writer holds the stage.
        """
        B, T = len(seeds), len(sigmas) - 1
        C, H, W = (int(x) for x in latent_shape)
        stage_attrs = {
            **dict(attrs or {}),
            "kernel": kernel,
            "kernel_params": dict(kernel_params),
            "B": B, "T": T, "C": C, "H": H, "W": W,
            "latent_dtype": latent_storage_dtype(latent_dtype),
            "source_dtype": latent_dtype,
        }
        writer = self._begin(iteration, "rollout", ROLLOUT)
        with _abort_on_error(writer):
            StageStore(writer.path, ROLLOUT, stage_attrs).create(
                {"sigmas": sigmas, "seeds": seeds, "prompt_ids": prompt_ids, "group_ids": group_ids}
            )
        return writer

    def begin_completion(self, iteration: int, method: str, *, latent_dtype: str | None = None,
                         attrs: Mapping[str, Any] | None = None) -> StageWriter:
        """Begin the completion of `iteration`'s rollout by `method`; dims come from the published
        rollout, `latent_dtype` defaults to the rollout's. Write `latents=[n,T+1,C,H,W]` per
        trajectory, then `publish(attrs={"nfe": ...})`.
        """
        rollout = self.stage_manifest(iteration, "rollout")
        if rollout is None:
            raise NotPublishedError(f"run {self.run_id} iteration {iteration}: publish the rollout before completing it")
        r = rollout["attrs"]
        source = latent_dtype or r["source_dtype"]
        stage_attrs = {
            **dict(attrs or {}),
            "method": method,
            **{d: r[d] for d in ("B", "T", "C", "H", "W")},
            "latent_dtype": latent_storage_dtype(source),
            "source_dtype": source,
            "rollout_digest": rollout["digest"],
        }
        writer = self._begin(iteration, f"completions/{method}", COMPLETION)
        with _abort_on_error(writer):
            StageStore(writer.path, COMPLETION, stage_attrs).create({})
        return writer

    def begin_images(self, iteration: int, source: str, *, k: Any, image_shape: Sequence[int],
                     attrs: Mapping[str, Any] | None = None) -> StageWriter:
        """Begin storing decoded images of `iteration` under `images/<name>`.

        `source` is the stage whose latents were decoded: `"rollout"` (its final states) or
        `"completions/<method>"` (every completed state); it must be published, and its digest is
        recorded. `k [K]` are the state indices decoded per trajectory, `image_shape` `(3, Y, X)`.
        Write `images=[n, K, 3, Y, X]` uint8 per trajectory, then `publish()`.
        """
        manifest = self.stage_manifest(iteration, source)
        if manifest is None:
            raise NotPublishedError(f"run {self.run_id} iteration {iteration}: publish {source} before storing its images")
        k = np.asarray(k, dtype=np.int64)
        rgb, y, x = (int(v) for v in image_shape)
        stage_attrs = {**dict(attrs or {}), "source": source, "source_digest": manifest["digest"],
                       "B": int(manifest["attrs"]["B"]), "K": len(k), "RGB": rgb, "Y": y, "X": x}
        writer = self._begin(iteration, self.images_stage(source), IMAGES)
        with _abort_on_error(writer):
            StageStore(writer.path, IMAGES, stage_attrs).create({"k": k})
        return writer

    @staticmethod
    def images_stage(source: str) -> str:
        """The stage name of the images decoded from `source` ("rollout" -> "images/final")."""
        if source == "rollout":
            return "images/final"
        if source.startswith("completions/"):
            return "images/" + source.split("/", 1)[1]
        raise ValueError(f"images are decoded from 'rollout' or 'completions/<method>', not {source!r}")

    def attach(self, iteration: int, stage: str, token: str) -> StageWriter:
        """Join a begun stage from another process with the begin's `writer.token`."""
        spec = _spec_of(stage) if stage != "checkpoint" else None
        writer = StageWriter(self, iteration, stage, token, owner=False, spec=spec)
        check_token(writer.lock, token, writer.what)
        return writer

    def _store(self, iteration: int, stage: str, spec: StoreSpec) -> tuple[StageStore, dict[str, Any]]:
        manifest = self.stage_manifest(iteration, stage)
        if manifest is None:
            raise NotPublishedError(
                f"run {self.run_id} iteration {iteration} stage {stage} is not published; run that stage first"
            )
        return StageStore(self.stage_path(iteration, stage), spec, manifest["attrs"]), manifest

    def read_array(self, iteration: int, stage: str, name: str, trajectories: slice | Sequence[int] | None = None) -> np.ndarray:
        """One array of a published Zarr stage (see `storage.schema`), optionally some trajectories."""
        return self._store(iteration, stage, _spec_of(stage))[0].read(name, trajectories)

    def read_rollout(self, iteration: int, trajectories: slice | Sequence[int] | None = None) -> RolloutData:
        """The published rollout of `iteration` (all trajectories, or those selected)."""
        store, manifest = self._store(iteration, "rollout", ROLLOUT)
        rows = np.arange(store.B)[trajectories] if trajectories is not None else slice(None)
        return RolloutData(
            states=store.read("states", trajectories),
            log_probs=store.read("log_probs", trajectories),
            stds=store.read("stds", trajectories),
            ode_final=store.read("ode_final", trajectories),
            sigmas=store.read("sigmas"),
            seeds=store.read("seeds")[rows],
            prompt_ids=store.read("prompt_ids")[rows],
            group_ids=store.read("group_ids")[rows],
            kernel=store.attrs["kernel"],
            kernel_params=store.attrs["kernel_params"],
            manifest=manifest,
        )

    def read_completion(self, iteration: int, method: str, trajectories: slice | Sequence[int] | None = None) -> CompletionData:
        """The published completion of `iteration` by `method`."""
        store, manifest = self._store(iteration, f"completions/{method}", COMPLETION)
        return CompletionData(
            latents=store.read("latents", trajectories),
            method=store.attrs["method"],
            nfe=int(store.attrs["nfe"]),
            manifest=manifest,
        )

    def read_images(self, iteration: int, source: str, trajectories: slice | Sequence[int] | None = None) -> ImagesData | None:
        """The images stored for `source`'s latents, or None if there are none or they were decoded
        from other content than `source` now holds (then they are not used)."""
        stage = self.images_stage(source)
        if self.stage_manifest(iteration, stage) is None:
            return None
        store, manifest = self._store(iteration, stage, IMAGES)
        source_manifest = self.stage_manifest(iteration, source)
        if source_manifest is None or store.attrs["source_digest"] != source_manifest["digest"]:
            return None
        return ImagesData(images=store.read("images", trajectories), k=store.read("k"), source=source,
                          source_digest=store.attrs["source_digest"], manifest=manifest)

    # --- prompts --------------------------------------------------------------------------------

    def write_prompts(self, prompt_ids: Sequence[int], texts: Sequence[str], splits: Sequence[str],
                      metadata: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Write the run's prompts once; returns `{"digest", "rows", "schema_version"}`."""
        table = tables.prompts_table(prompt_ids, texts, splits, metadata)
        return tables.write_once(self.path / "prompts.parquet", table, f"run {self.run_id} prompts")

    def prompts_manifest(self) -> dict[str, Any] | None:
        """The prompts' `{"digest", "rows", "schema_version"}`, or None if not written."""
        return tables.read_footer(self.path / "prompts.parquet")

    def read_prompts(self) -> pa.Table:
        """The prompts table (`storage.schema.PROMPTS_SCHEMA`; `metadata` is a JSON string)."""
        if self.prompts_manifest() is None:
            raise NotPublishedError(f"run {self.run_id} has no prompts yet; write them with write_prompts")
        import pyarrow.parquet as pq

        return pq.read_table(self.path / "prompts.parquet").replace_schema_metadata(None)

    # --- rewards --------------------------------------------------------------------------------

    def append_rewards(self, iteration: int, reward_name: str, reward_version: str, traj: Any, k: Any, value: Any,
                       strict: Any | None = None, sub: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Append one reward's scores: `traj, k, value` (`strict`, each `sub[name]`) are `[N]`.

        Raises ValueError naming the rows if a value is NaN/inf or a row is already stored.
        Returns `{"file", "rows", "digest"}`.
        """
        table = tables.rewards_table(iteration, reward_name, reward_version, traj, k, value, strict, sub)
        return tables.append_rows(self.path / "rewards", REWARDS_SCHEMA, REWARDS_KEY, table, f"run {self.run_id} rewards")

    def read_rewards(self, iteration: int | None = None, reward_name: str | None = None,
                     reward_version: str | None = None, as_pandas: bool = False) -> Any:
        """Reward rows matching the non-None selectors, sorted by key (pyarrow.Table or pandas)."""
        table = tables.read_rows(self.path / "rewards", REWARDS_SCHEMA, REWARDS_KEY,
                                 {"iteration": iteration, "reward_name": reward_name, "reward_version": reward_version})
        return table.to_pandas() if as_pandas else table

    def _one_version(self, table: pa.Table, column: str, what: str) -> pa.Table:
        versions = sorted(set(table.column(column).to_pylist()))
        if len(versions) > 1:
            raise ValueError(f"{what} has several {column} values {versions}; pass one")
        if not versions:
            raise NotPublishedError(f"{what}: no rows stored")
        return table

    def reward_grid(self, iteration: int, reward_name: str, reward_version: str | None = None,
                    field: str = "value") -> torch.Tensor:
        """Rewards of `iteration` as a `[B, T+1]` float32 tensor, NaN where a state has no row.

        `field` is "value", "strict" or a sub-score name. `reward_version` may be omitted when
        only one version is stored.
        """
        import torch

        what = f"run {self.run_id} iteration {iteration} reward {reward_name!r}"
        table = self._one_version(self.read_rewards(iteration, reward_name, reward_version), "reward_version", what)
        if field in ("value", "strict"):
            values = table.column(field).to_numpy(zero_copy_only=False).astype(np.float64)
        else:
            values = np.array([dict(s).get(field, np.nan) for s in table.column("sub").to_pylist()], np.float64)
        B, T = self._dims(iteration)
        return torch.from_numpy(tables.to_grid(table, B, T + 1, values))

    def rewards_digest(self, iteration: int, reward_name: str, reward_version: str) -> str:
        """Digest of the stored rows of one reward version (credit's cache-key input)."""
        return tables.table_digest(self.read_rewards(iteration, reward_name, reward_version))

    # --- advantages -----------------------------------------------------------------------------

    def append_advantages(self, iteration: int, scheme: str, options: Mapping[str, Any], traj: Any, k: Any,
                          value: Any) -> dict[str, Any]:
        """Append one scheme's advantages (`traj, k, value` `[N]`); rows carry `options_digest(options)`.

        The options themselves are kept in `advantages/options-<digest>.json` (see `scheme_options`).
        Returns `{"file", "rows", "digest", "options_digest"}`.
        """
        check_json(dict(options), f"scheme {scheme} options")
        digest = options_digest(options)
        folder = self.path / "advantages"
        folder.mkdir(parents=True, exist_ok=True)
        sidecar = folder / f"options-{digest}.json"
        if not sidecar.exists():
            write_file_atomic(sidecar, canonical_json({"scheme": scheme, "options": dict(options)}).encode())
        table = tables.advantages_table(iteration, scheme, digest, traj, k, value)
        record = tables.append_rows(folder, ADVANTAGES_SCHEMA, ADVANTAGES_KEY, table, f"run {self.run_id} advantages")
        return {**record, "options_digest": digest}

    def scheme_options(self, options_digest: str) -> dict[str, Any]:
        """`{"scheme", "options"}` stored for an options digest."""
        return json.loads((self.path / "advantages" / f"options-{options_digest}.json").read_text())

    def read_advantages(self, iteration: int | None = None, scheme: str | None = None,
                        options_digest: str | None = None, as_pandas: bool = False) -> Any:
        """Advantage rows matching the non-None selectors, sorted by key (pyarrow.Table or pandas)."""
        table = tables.read_rows(self.path / "advantages", ADVANTAGES_SCHEMA, ADVANTAGES_KEY,
                                 {"iteration": iteration, "scheme": scheme, "options_digest": options_digest})
        return table.to_pandas() if as_pandas else table

    def advantage_grid(self, iteration: int, scheme: str, options_digest: str | None = None) -> torch.Tensor:
        """Advantages of `iteration` under one scheme as a `[B, T]` float32 tensor, NaN where absent."""
        import torch

        what = f"run {self.run_id} iteration {iteration} scheme {scheme!r}"
        table = self._one_version(self.read_advantages(iteration, scheme, options_digest), "options_digest", what)
        B, T = self._dims(iteration)
        return torch.from_numpy(tables.to_grid(table, B, T, table.column("value").to_numpy()))

    def advantages_digest(self, iteration: int, scheme: str, options_digest: str) -> str:
        """Digest of the stored rows of one scheme + options (update's cache-key input)."""
        return tables.table_digest(self.read_advantages(iteration, scheme, options_digest))

    def _dims(self, iteration: int) -> tuple[int, int]:
        rollout = self.stage_manifest(iteration, "rollout")
        if rollout is None:
            raise NotPublishedError(f"run {self.run_id} iteration {iteration}: no published rollout to size the grid")
        return int(rollout["attrs"]["B"]), int(rollout["attrs"]["T"])

    # --- checkpoints ----------------------------------------------------------------------------

    def begin_checkpoint(self, iteration: int) -> StageWriter:
        """Begin a checkpoint directory (write safetensors/JSON files under `writer.path`, then publish)."""
        return self._begin(iteration, "checkpoint", None)

    def save_checkpoint(self, iteration: int, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                        state: Mapping[str, Any]) -> dict[str, Any]:
        """Save tensor groups (`<group>.safetensors`) and JSON `state`, published atomically."""
        from safetensors.torch import save_file

        check_json(dict(state), "checkpoint state")
        with self.begin_checkpoint(iteration) as writer:
            for group, named in tensors.items():
                _check_name(group, "tensor group")
                save_file({n: t.detach().cpu().contiguous() for n, t in named.items()}, str(writer.path / f"{group}.safetensors"))
            (writer.path / STATE_FILE).write_text(json.dumps(dict(state), sort_keys=True) + "\n")
            return writer.publish()

    def latest_checkpoint(self) -> int | None:
        """The highest iteration with a published checkpoint, or None."""
        found = self.iterations("checkpoint")
        return found[-1] if found else None

    def load_checkpoint(self, iteration: int | None = None) -> Checkpoint:
        """Load a published checkpoint (the latest by default)."""
        from safetensors.torch import load_file

        iteration = self.latest_checkpoint() if iteration is None else iteration
        manifest = None if iteration is None else self.stage_manifest(iteration, "checkpoint")
        if manifest is None:
            raise NotPublishedError(f"run {self.run_id}: no published checkpoint for iteration {iteration}")
        path = self.stage_path(iteration, "checkpoint")
        if _digest_files(path)[0] != manifest["digest"]:
            raise CorruptChunkError(
                f"run {self.run_id} checkpoint iteration {iteration}: files do not match the published "
                "digest (damaged or edited); restore it or resume from an earlier checkpoint"
            )
        tensors = {p.stem: load_file(str(p)) for p in sorted(path.glob("*.safetensors"))}
        return Checkpoint(iteration, tensors, json.loads((path / STATE_FILE).read_text()), manifest)


def _spec_of(stage: str) -> StoreSpec:
    if stage == "rollout":
        return ROLLOUT
    if stage.startswith("completions/"):
        return COMPLETION
    if stage.startswith("images/"):
        return IMAGES
    raise ValueError(f"stage {stage!r} is not a Zarr stage ('rollout', 'completions/<method>', 'images/<source>')")


class _abort_on_error:
    """Context manager: abort `writer` if the body raises (used while a stage is being set up)."""

    def __init__(self, writer: StageWriter) -> None:
        self.writer = writer

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.writer.abort()
