"""Writing one stage: its `.partial` directory, the stage lock, the atomic publish and its digest."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import zarr

from stepgrpo.storage.arrays import StageStore
from stepgrpo.storage.errors import StorageError
from stepgrpo.storage.ledger import LEDGER, close_ledger
from stepgrpo.storage.publish import (
    canonical_json,
    check_json,
    check_token,
    lock_path,
    partial_path,
    publish_dir,
    release_lock,
    utc_now,
)
from stepgrpo.storage.schema import (
    ALLOWED_FILE_SUFFIXES,
    DIGEST_FORMAT,
    EXPORT_FILE,
    PUBLISHED_FILE,
    SCHEMA_VERSION,
    StoreSpec,
)


class StageWriter:
    """Writes one stage into its `.partial` directory, then publishes it atomically.

    Made by `Run.begin_*` (takes the stage lock) or `Run.attach` (another process joining with the
    begin's `token`; it writes its own trajectories and does not own the lock). Use as a context
    manager: leaving it on an exception discards the attempt and releases the lock.
    """

    def __init__(
        self,
        run_id: str,
        final: Path,
        iteration: int,
        stage: str,
        token: str,
        owner: bool,
        spec: StoreSpec | None,
        resume: str | None = None,
        resumed: bool = False,
        digest_format: int = DIGEST_FORMAT,
    ) -> None:
        self.run_id = run_id
        self.digest_format = digest_format  # the run's (`Run.digest_format`)
        self.iteration = iteration
        self.stage = stage
        self.token = token  # pass to `Run.attach` in other writer processes
        self.owner = owner
        self.final = final  # where the stage is published
        self.path = partial_path(self.final)  # file stages (checkpoint) write their files here
        self.lock = lock_path(self.final)
        self.spec = spec
        self.resume = resume  # the key of a resumable stage: an error keeps the partial and its ledger
        self.resumable = resume is not None
        self.resumed = resumed  # the partial is an interrupted attempt's, under the same key
        self.ledger = self.path / LEDGER
        self._store: StageStore | None = None
        self.manifest: dict[str, Any] | None = None

    @property
    def what(self) -> str:
        return f"run {self.run_id} iteration {self.iteration} stage {self.stage}"

    def store(self) -> StageStore:
        if self.spec is None:
            raise StorageError(f"{self.what} is a file stage: write files under writer.path")
        if self._store is None:
            self._store = StageStore.open(self.path, self.spec)
        return self._store

    def drop_store(self) -> None:
        """Forget the opened store (its directory was started over)."""
        self._store = None

    def write(self, start: int, **arrays: Any) -> None:
        """Write trajectories `start .. start+n` of per-trajectory arrays, e.g. `states=[n,T+1,C,H,W]`.

        Writers in different processes may write disjoint ranges of the same stage concurrently.
        """
        check_token(self.lock, self.token, self.what)
        self.store().write(start, arrays)

    def publish(
        self, attrs: Mapping[str, Any] | None = None, inputs: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Check completeness and checksums, digest, and make the stage visible (one rename).

        `attrs` are added to the store's attrs before digesting (e.g. a completion's `nfe`);
        `inputs` (e.g. the cache-key inputs) are recorded in the manifest, not digested.
        Returns the manifest (`digest`, `counts`, `schema_version`, ...), also `stage_manifest`'s.
        """
        check_token(self.lock, self.token, self.what)
        manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "iteration": self.iteration,
            "stage": self.stage,
            "inputs": dict(inputs or {}),
            "published_at": utc_now(),
        }
        close_ledger(self.ledger)  # finished shards are data now, checked below like any chunk
        if self.spec is not None:
            if attrs:
                check_json(dict(attrs), f"{self.what} attrs")
                zarr.open_group(str(self.path), mode="r+", zarr_format=3).attrs.update(dict(attrs))
            self._store = None
            store = self.store()
            store.drop_unwritten_optional()
            missing = [a for a in self.spec.required_attrs if a not in store.attrs]
            if missing:
                raise ValueError(f"{self.what}: attrs {missing} are required to publish (pass them to publish())")
            digest, nbytes = store.verify_and_digest(self.digest_format)
            counts = {
                "trajectories": store.B,
                "steps": store.sizes.get("T"),
                "states": store.sizes.get("T+1", store.sizes.get("K")),
            }
            manifest.update(
                digest=digest,
                digest_format=self.digest_format,
                metadata_digest=metadata_digest(self.path),
                counts={**{k: v for k, v in counts.items() if v is not None}, "bytes": nbytes},
                attrs=store.attrs,
            )
        else:
            if attrs:
                raise ValueError(f"{self.what}: file stages take no attrs; write a JSON file instead")
            digest, nbytes, files = digest_files(self.path)
            manifest.update(digest=digest, counts={"files": files, "bytes": nbytes})
        publish_dir(self.path, self.final, manifest)
        release_lock(self.lock, self.token)
        self.manifest = manifest
        return manifest

    def abort(self) -> None:
        """Discard this attempt: delete the `.partial` directory (kept when resumable) and release
        the lock (owner only)."""
        if self.owner and self.manifest is None:
            if not self.resumable:
                shutil.rmtree(self.path, ignore_errors=True)
            release_lock(self.lock, self.token)

    def __enter__(self) -> StageWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self.owner and self.manifest is None:
            release_lock(self.lock, self.token)  # left unpublished: the next begin redoes it


def metadata_digest(root: Path) -> str:
    """sha256 over a Zarr store's metadata files (`zarr.json` of the group and of every array), by
    relative path: the bytes the content digest does not cover."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("zarr.json")):
        digest.update(canonical_json([path.relative_to(root).as_posix()]).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def digest_files(root: Path) -> tuple[str, int, int]:
    """sha256 over the sorted relative paths and bytes of the files under `root` (not its own
    records); refuses non-data files."""
    digest = hashlib.sha256()
    total = count = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (PUBLISHED_FILE, EXPORT_FILE)):
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


class abort_on_error:
    """Context manager: abort `writer` if the body raises (used while a stage is being set up)."""

    def __init__(self, writer: StageWriter) -> None:
        self.writer = writer

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.writer.abort()
