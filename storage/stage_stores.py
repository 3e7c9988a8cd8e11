"""The Zarr stages of a run: rollouts, completions and decoded images (begin, write, read).

`StageStores` is a part of `stepgrpo.storage.run.Run`; see `storage` for the API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stepgrpo.storage.arrays import StageStore
from stepgrpo.storage.errors import NotPublishedError
from stepgrpo.storage.ledger import open_ledger
from stepgrpo.storage.pruned import pruned
from stepgrpo.storage.publish import fresh_partial
from stepgrpo.storage.schema import (
    BY_NODE,
    COMPLETION,
    IMAGES,
    NODE_ROWS,
    ROLLOUT,
    StoreSpec,
    completion_stage,
    latent_storage_dtype,
)
from stepgrpo.storage.writer import StageWriter, abort_on_error

if TYPE_CHECKING:
    from stepgrpo.storage.owner import RunDir


@dataclass(frozen=True)
class RolloutData:
    """A stored rollout (rows = the trajectories read)."""

    states: np.ndarray  # [n, T+1, C, H, W] float16 or float32 (bf16 runs: float32)
    log_probs: np.ndarray  # [n, T] float32, NaN outside the SDE window
    stds: np.ndarray  # [n, T] float32
    ode_final: np.ndarray | None  # [n, C, H, W] the ODE sample from each trajectory's x_0; None: not sampled
    velocities: np.ndarray | None  # [n, T, C, H, W] the velocity of each step at x_k; None: not stored (older runs)
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


class StageStores:
    """A run's Zarr stages: rollouts, completions, decoded images (`Run.stages`)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

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
        resume: str | None = None,
        omit: Sequence[str] = (),
        by_node: bool = False,
    ) -> StageWriter:
        """Begin the rollout of `iteration`: the plan (`sigmas [T+1]`, `seeds, prompt_ids, group_ids [B]`)
        is written now; `states`, `log_probs`, `stds`, `ode_final`, `velocities` are written per trajectory
        with `writer.write`, less the optional arrays in `omit` (the stage is made without them).

        `latent_shape` is `(C, H, W)`; `latent_dtype` the compute dtype ("float16", "float32",
        "bfloat16" -> stored as float32). Raises StageLockedError if another writer holds the stage.
        `resume`: the stage's key, to continue an interrupted sharded attempt (`Run._begin`).
        `by_node`: store each distinct state once (a branched rollout's shared prefix; `BY_NODE`).
        """
        B, T = len(seeds), len(sigmas) - 1
        C, H, W = (int(x) for x in latent_shape)
        stage_attrs = {
            **dict(attrs or {}),
            "kernel": kernel,
            "kernel_params": dict(kernel_params),
            "B": B,
            "T": T,
            "C": C,
            "H": H,
            "W": W,
            "latent_dtype": latent_storage_dtype(latent_dtype),
            "source_dtype": latent_dtype,
            **({BY_NODE: True} if by_node else {}),
        }
        tables = [t for a, t in NODE_ROWS.items() if not by_node or a in omit]  # a table only beside its array
        omit = (*omit, *tables)
        writer = self.run._begin(iteration, "rollout", ROLLOUT, resume)
        with abort_on_error(writer):
            _create(
                writer,
                ROLLOUT,
                stage_attrs,
                {"sigmas": sigmas, "seeds": seeds, "prompt_ids": prompt_ids, "group_ids": group_ids},
                omit,
            )
        return writer

    def begin_completion(
        self,
        iteration: int,
        method: str,
        *,
        latent_dtype: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        resume: str | None = None,
    ) -> StageWriter:
        """Begin the completion of `iteration`'s rollout by `method` (`substeps:5`, stored as
        `completions/substeps-5`); dims come from the published rollout, `latent_dtype` defaults to the
        rollout's. Write `latents=[n,T+1,C,H,W]` per trajectory, then `publish(attrs={"nfe": ...})`.
        """
        stage = completion_stage(method)
        rollout = self.run.stage_manifest(iteration, "rollout")
        if rollout is None:
            raise NotPublishedError(
                f"run {self.run.run_id} iteration {iteration}: publish the rollout before completing it"
            )
        r = rollout["attrs"]
        source = latent_dtype or r["source_dtype"]
        stage_attrs = {
            **dict(attrs or {}),
            "method": stage.removeprefix("completions/"),
            **{d: r[d] for d in ("B", "T", "C", "H", "W")},
            "latent_dtype": latent_storage_dtype(source),
            "source_dtype": source,
            "rollout_digest": rollout["digest"],
        }
        writer = self.run._begin(iteration, stage, COMPLETION, resume)
        with abort_on_error(writer):
            _create(writer, COMPLETION, stage_attrs, {})
        return writer

    def begin_images(
        self,
        iteration: int,
        source: str,
        *,
        k: Any,
        image_shape: Sequence[int],
        attrs: Mapping[str, Any] | None = None,
        resume: str | None = None,
    ) -> StageWriter:
        """Begin storing decoded images of `iteration` under `images/<name>`.

        `source` is the stage whose latents were decoded: `"rollout"` (its final states) or
        `"completions/<method>"` (every completed state); it must be published, and its digest is
        recorded. `k [K]` are the state indices decoded per trajectory, `image_shape` `(3, Y, X)`.
        Write `images=[n, K, 3, Y, X]` uint8 per trajectory, then `publish()`.
        """
        manifest = self.run.stage_manifest(iteration, source)
        if manifest is None:
            raise NotPublishedError(
                f"run {self.run.run_id} iteration {iteration}: publish {source} before storing its images"
            )
        k = np.asarray(k, dtype=np.int64)
        rgb, y, x = (int(v) for v in image_shape)
        stage_attrs = {
            **dict(attrs or {}),
            "source": source,
            "source_digest": manifest["digest"],
            "B": int(manifest["attrs"]["B"]),
            "K": len(k),
            "RGB": rgb,
            "Y": y,
            "X": x,
        }
        writer = self.run._begin(iteration, self.images_stage(source), IMAGES, resume)
        with abort_on_error(writer):
            _create(writer, IMAGES, stage_attrs, {"k": k})
        return writer

    @staticmethod
    def images_stage(source: str) -> str:
        """The stage name of the images decoded from `source` ("rollout" -> "images/final")."""
        if source == "rollout":
            return "images/final"
        if source.startswith("completions/"):
            return "images/" + source.split("/", 1)[1]
        raise ValueError(f"images are decoded from 'rollout' or 'completions/<method>', not {source!r}")

    def _store(self, iteration: int, stage: str, spec: StoreSpec) -> tuple[StageStore, dict[str, Any]]:
        manifest = self.run.stage_manifest(iteration, stage)
        if manifest is None:
            raise NotPublishedError(
                f"run {self.run.run_id} iteration {iteration} stage {stage} is not published; run that stage first"
            )
        path = self.run.stage_path(iteration, stage)
        limits = self.run.dim_limits()  # type: ignore[attr-defined]
        return StageStore(path, spec, manifest.get("attrs") or {}, removed=_removed(path), limits=limits), manifest

    def has_array(self, iteration: int, stage: str, name: str) -> bool:
        """Whether a published Zarr stage holds array `name` (an optional one may be absent)."""
        return self._store(iteration, stage, spec_of(stage))[0].has(name)

    def read_array(
        self, iteration: int, stage: str, name: str, trajectories: slice | Sequence[int] | None = None
    ) -> np.ndarray:
        """One array of a published Zarr stage (see `stepgrpo.storage.schema`), optionally some trajectories."""
        return self._store(iteration, stage, spec_of(stage))[0].read(name, trajectories)

    def read_rollout(self, iteration: int, trajectories: slice | Sequence[int] | None = None) -> RolloutData:
        """The published rollout of `iteration` (all trajectories, or those selected)."""
        store, manifest = self._store(iteration, "rollout", ROLLOUT)
        rows = np.arange(store.B)[trajectories] if trajectories is not None else slice(None)
        return RolloutData(
            states=store.read("states", trajectories),
            log_probs=store.read("log_probs", trajectories),
            stds=store.read("stds", trajectories),
            ode_final=store.read("ode_final", trajectories) if store.has("ode_final") else None,
            velocities=store.read("velocities", trajectories) if store.has("velocities") else None,
            sigmas=store.read("sigmas"),
            seeds=store.read("seeds")[rows],
            prompt_ids=store.read("prompt_ids")[rows],
            group_ids=store.read("group_ids")[rows],
            kernel=store.attrs["kernel"],
            kernel_params=store.attrs["kernel_params"],
            manifest=manifest,
        )

    def read_completion(
        self, iteration: int, method: str, trajectories: slice | Sequence[int] | None = None
    ) -> CompletionData:
        """The published completion of `iteration` by `method` (`substeps:5`, or its stored name `substeps-5`)."""
        store, manifest = self._store(iteration, completion_stage(method), COMPLETION)
        return CompletionData(
            latents=store.read("latents", trajectories),
            method=store.attrs["method"],
            nfe=int(store.attrs["nfe"]),
            manifest=manifest,
        )

    def read_images(
        self, iteration: int, source: str, trajectories: slice | Sequence[int] | None = None
    ) -> ImagesData | None:
        """The images stored for `source`'s latents, or None if there are none or they were decoded
        from other content than `source` now holds (then they are not used)."""
        stage = self.images_stage(source)
        if (
            self.run.stage_manifest(iteration, stage) is None
            or pruned(self.run.stage_path(iteration, stage)) is not None
        ):
            return None
        store, manifest = self._store(iteration, stage, IMAGES)
        source_manifest = self.run.stage_manifest(iteration, source)
        if source_manifest is None or store.attrs["source_digest"] != source_manifest["digest"]:
            return None
        return ImagesData(
            images=store.read("images", trajectories),
            k=store.read("k"),
            source=source,
            source_digest=store.attrs["source_digest"],
            manifest=manifest,
        )


def _create(
    writer: StageWriter, spec: StoreSpec, attrs: dict[str, Any], whole: Mapping[str, Any], omit: Sequence[str] = ()
) -> None:
    """Write a new stage's metadata. A resumed attempt's partial keeps its shards only if it was
    begun with the same attributes; otherwise (it cannot be, under the same key, unless the code
    changed) it is started over: an unpublished attempt is not data anyone read."""
    if writer.resumed:
        try:
            same = StageStore.open(writer.path, spec).attrs == json.loads(json.dumps(attrs))
        except Exception:  # its metadata do not parse
            same = False
        if same:
            return
        fresh_partial(writer.final)
        writer.resumed = False
        writer.drop_store()
    StageStore(writer.path, spec, attrs).create(whole, omit)  # zarr clears the directory: the ledger comes after
    if writer.resume is not None:
        open_ledger(writer.ledger, writer.resume)


def _removed(path: Path) -> dict[str, str]:
    """Arrays retention removed from the stage at `path` -> why (for the reader's error)."""
    record = pruned(path)
    return {} if record is None else {n: f"{record['why']}, {record['pruned_at']}" for n in record["removed"]}


def spec_of(stage: str) -> StoreSpec:
    if stage == "rollout":
        return ROLLOUT
    if stage.startswith("completions/"):
        return COMPLETION
    if stage.startswith("images/"):
        return IMAGES
    raise ValueError(f"stage {stage!r} is not a Zarr stage ('rollout', 'completions/<method>', 'images/<source>')")
