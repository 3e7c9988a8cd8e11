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

import importlib.metadata
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepgrpo.storage import tables
from stepgrpo.storage.arrays import StageStore
from stepgrpo.storage.checkpoints import Checkpoint, Checkpoints
from stepgrpo.storage.errors import (
    AlreadyPublishedError,
    CorruptChunkError,
    NotPublishedError,
    SchemaVersionError,
    StorageError,
)
from stepgrpo.storage.ledger import resumable
from stepgrpo.storage.pruned import pruned
from stepgrpo.storage.publish import (
    SEAL_KEY,
    acquire_lock,
    canonical_json,
    check_json,
    check_token,
    fresh_partial,
    lock_path,
    no_links,
    read_json,
    read_published,
    release_lock,
    seal,
    utc_now,
    write_file_atomic,
)
from stepgrpo.storage.run_tables import RunTables
from stepgrpo.storage.schema import (
    DIGEST_FORMAT,
    DIGEST_FORMATS,
    EXPORT_FILE,
    PUBLISHED_FILE,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    StoreSpec,
    check_name,
    known_digest_format,
    store_sizes,
)
from stepgrpo.storage.stage_stores import CompletionData, ImagesData, RolloutData, StageStores, spec_of
from stepgrpo.storage.writer import StageWriter, digest_files, metadata_digest

__all__ = [
    "Checkpoint",
    "CompletionData",
    "ImagesData",
    "RolloutData",
    "Run",
    "StageWriter",
    "code_version",
    "find_run",
    "spec_of",
]

MANIFEST_FILE = "manifest.json"
FILE_STAGES = ("checkpoint", "draw")  # stages of plain files, digested as files (not Zarr stores)
DRAW_FILE = "draw.json"


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
    if found not in READABLE_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            f"{what} was written with storage schema version {found}; this code reads version "
            f"{SCHEMA_VERSION}. Open it with the stepgrpo version that wrote it (see code_version in "
            "the run's manifest.json), or re-run it with this version."
        )


class Run:
    """A run directory. Make one with `Run.create`, open one with `Run.open`.

    Its own surface: the manifest, config and facts, stage paths and manifests, verification and
    setting aside damaged files. Its data through three parts: `stages` (the Zarr stages:
    rollouts, completions, decoded images), `tables` (the Parquet tables: prompts, rewards,
    advantages) and `checkpoints` (safetensors weights with a JSON state)."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.run_id: str = manifest["run_id"]
        self.stages = StageStores(self)
        self.tables = RunTables(self)
        self.checkpoints = Checkpoints(self)

    @property
    def digest_format(self) -> int:
        """How the run's Zarr stages are digested (`stepgrpo.storage.schema.DIGEST_FORMAT`), fixed when the run
        was made (runs made before format 2: 1), so that a stage computed again has the digest its
        downstream stages were keyed on."""
        return self.manifest.get("digest_format", 1)

    @property
    def config(self) -> dict[str, Any]:
        """The full config the run was created with."""
        return self.manifest["config"]

    # --- create / open ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        run_id: str,
        config: Mapping[str, Any],
        exist_ok: bool = False,
        facts: Mapping[str, str] | None = None,
    ) -> Run:
        """Create `root/run_id/` with its manifest. `config` must be plain JSON; `facts` are
        strings the pipeline derives once per run (e.g. the model's fingerprint, `fact(name)`).

        With `exist_ok`, an existing run with the same config is opened (to resume it); one with a
        different config raises.
        """
        check_name(run_id, "run id")
        check_json(dict(config), "the run config")
        path = Path(root) / run_id
        if path.exists():
            if not exist_ok:
                raise FileExistsError(
                    f"run {run_id} already exists at {path}; open it with Run.open or pick another id"
                )
            run = cls.open(path)
            if canonical_json(run.config) != canonical_json(dict(config)):
                raise ValueError(f"run {run_id} exists with a different config; use another run id to change it")
            return run
        manifest = {
            "run_id": run_id,
            "schema_version": SCHEMA_VERSION,
            "digest_format": DIGEST_FORMAT,  # every Zarr stage of the run is digested so, recomputed ones too
            "created_at": utc_now(),
            "code_version": code_version(),
            "config": dict(config),
            "facts": dict(facts or {}),
        }
        check_json(manifest["facts"], "the run facts")
        tmp = Path(root) / f".{run_id}.{secrets.token_hex(4)}.creating"
        tmp.mkdir(parents=True)
        (tmp / MANIFEST_FILE).write_text(json.dumps(seal(manifest), indent=1, sort_keys=True) + "\n")
        try:
            os.rename(tmp, path)  # atomic: a run directory always has its manifest
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if exist_ok:
                return cls.create(root, run_id, config, exist_ok=True, facts=facts)
            raise FileExistsError(f"run {run_id} was created concurrently at {path}; open it with Run.open") from None
        return cls(path, manifest)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Run:
        """Open an existing run; raises SchemaVersionError if it was written with another schema."""
        path = Path(path)
        try:
            manifest = read_json(path / MANIFEST_FILE, "run manifest")
        except CorruptChunkError as err:
            raise StorageError(
                f"{err}; the run cannot be opened until its manifest.json is restored (from a copy of the run)"
            ) from None
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} is not a run directory (no {MANIFEST_FILE}); create it with Run.create"
            ) from None
        if not isinstance(manifest, dict) or "run_id" not in manifest or not isinstance(manifest.get("config"), dict):
            raise StorageError(f"{path / MANIFEST_FILE} is not a run manifest (no run_id / config); restore it")
        manifest.pop(SEAL_KEY, None)  # checked by read_json: an edited manifest is refused, named
        _check_schema(manifest.get("schema_version"), f"run {manifest.get('run_id', path.name)}")
        if not known_digest_format(manifest.get("digest_format", 1)):
            raise SchemaVersionError(
                f"run {manifest['run_id']} digests its stages in format {manifest['digest_format']!r}; this code "
                f"reads formats {DIGEST_FORMATS}. Open it with the stepgrpo version that wrote it (see code_version "
                "in the run's manifest.json)."
            )
        return cls(path, manifest)

    def inside(self, path: str | os.PathLike[str]) -> Path:
        """`path` (under the run directory) for a write: refused when a part of it is a symbolic link,
        which would take the write out of the run (`stepgrpo.storage.publish.no_links`)."""
        return no_links(self.path, Path(path))

    def dim_limits(self) -> dict[str, int]:
        """Upper bounds of a stored stage's dims from the run's config (`B`: the trajectories of an
        iteration, `T`: its steps, `K`: its states), checked before a store is read, so that dims a
        damaged or hostile metadata file declares never size an allocation or a loop."""
        P, G, T = (_positive_int(self.config, s, f) for s, f in CONFIG_DIMS)
        limits = {"B": P * G} if P and G else {}
        if T:
            limits.update(T=T, K=T + 1)
        return limits

    def fact(self, name: str) -> str | None:
        """A fact recorded in the manifest (`create(facts=...)`, `record_fact`), or None."""
        return self.manifest.get("facts", {}).get(name)

    def record_fact(self, name: str, value: str) -> None:
        """Add a fact to the manifest of a run created without it (the manifest is rewritten
        atomically; a recorded fact is never changed)."""
        known = self.fact(name)
        if known is not None:
            if known != value:
                raise ValueError(f"run {self.run_id}: fact {name!r} is recorded as {known!r}, not {value!r}")
            return
        manifest = {**self.manifest, "facts": {**self.manifest.get("facts", {}), name: value}}
        data = json.dumps(seal(manifest), indent=1, sort_keys=True) + "\n"
        write_file_atomic(self.path / MANIFEST_FILE, data.encode())
        self.manifest = manifest

    # --- stages -------------------------------------------------------------------------------

    def stage_path(self, iteration: int, stage: str) -> Path:
        """Where `stage` of `iteration` is published ("rollout", "completions/<method>", "checkpoint")."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if stage == "rollout":
            return self.path / f"iter_{iteration}" / "rollout.zarr"
        if stage.startswith("completions/"):
            method = check_name(stage.split("/", 1)[1], "completion method")
            return self.path / f"iter_{iteration}" / "completions" / f"{method}.zarr"
        if stage.startswith("images/"):
            source = check_name(stage.split("/", 1)[1], "image source")
            return self.path / f"iter_{iteration}" / "images" / f"{source}.zarr"
        if stage == "checkpoint":
            return self.path / "checkpoints" / f"iter_{iteration}"
        if stage == "draw":
            return self.path / f"iter_{iteration}" / "draw"
        raise ValueError(
            f"unknown stage {stage!r}; stages are 'rollout', 'completions/<method>', 'images/<source>', "
            "'checkpoint', 'draw'"
        )

    def stage_manifest(self, iteration: int, stage: str) -> dict[str, Any] | None:
        """The stage's `_published.json` (digest, counts, schema version), or None if not published."""
        manifest = read_published(self.stage_path(iteration, stage))
        if manifest is not None:
            what = f"run {self.run_id} iteration {iteration} {stage}"
            _check_schema(manifest.get("schema_version"), what)
            if stage not in FILE_STAGES:  # a Zarr stage: its dims bounded before any reader sizes anything by them
                try:
                    store_sizes(spec_of(stage), manifest.get("attrs") or {}, self.dim_limits())
                except ValueError as err:
                    raise CorruptChunkError(f"{what}: its manifest's {err} (damaged or edited)") from None
        return manifest

    def iterations(self, stage: str = "rollout") -> list[int]:
        """Iterations whose `stage` is published, ascending."""
        found = []
        for d in list(self.path.glob("iter_*")) + list((self.path / "checkpoints").glob("iter_*")):
            digits = d.name.removeprefix("iter_")
            if not (digits.isdecimal() and digits.isascii()):
                continue  # not a stage folder (`iter_-1`, `iter_x`): not read
            k = int(digits)
            if k not in found and (self.stage_path(k, stage) / PUBLISHED_FILE).exists():
                found.append(k)
        return sorted(found)

    def _begin(self, iteration: int, stage: str, spec: StoreSpec | None, resume: str | None = None) -> StageWriter:
        """Take the stage's lock and start its `.partial` directory. With `resume` (the stage's
        key), a partial left by an interrupted attempt under the same key is kept with its
        finished shards (`stepgrpo.runtime.sharding`), and an error keeps it for the next attempt."""
        final = self.inside(self.stage_path(iteration, stage))
        what = f"run {self.run_id} iteration {iteration} stage {stage}"
        if read_published(final) is not None:
            raise AlreadyPublishedError(f"{what} is already published (stages are immutable); read it instead")
        final.parent.mkdir(parents=True, exist_ok=True)
        token = acquire_lock(lock_path(final), what)
        if read_published(final) is not None:  # published while we waited for the lock
            release_lock(lock_path(final), token)
            raise AlreadyPublishedError(f"{what} is already published (stages are immutable); read it instead")
        resumed = resume is not None and resumable(final, resume)
        if not resumed:
            fresh_partial(final)  # a crashed attempt's leftovers go (its ledger is opened after the metadata)
        if final.exists():  # a directory under the final name without its manifest: kept aside, never deleted
            self.set_aside(iteration, stage)
        return StageWriter(
            self.run_id,
            final,
            iteration,
            stage,
            token,
            owner=True,
            spec=spec,
            resume=resume,
            resumed=resumed,
            digest_format=self.digest_format,
        )

    # --- prompt draws (the curriculum) ------------------------------------------------------------

    def save_draw(self, iteration: int, record: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Publish the prompts drawn for `iteration` (a JSON `record`); `inputs` (the cache key)
        go in the manifest."""
        check_json(dict(record), "draw record")
        with self._begin(iteration, "draw", None) as writer:
            (writer.path / DRAW_FILE).write_text(json.dumps(dict(record), sort_keys=True) + "\n")
            return writer.publish(inputs=inputs)

    def read_draw(self, iteration: int) -> dict[str, Any]:
        """The published draw of `iteration`, checked against its digest."""
        self.verify(iteration, "draw")
        return read_json(self.stage_path(iteration, "draw") / DRAW_FILE, "draw record")

    # --- verification ---------------------------------------------------------------------------

    def verify(self, iteration: int, stage: str) -> None:
        """Check a published stage against its manifest: every chunk's checksum, the store's
        attributes and its content digest (Zarr stages), the files' digest (checkpoints). Raises
        `CorruptChunkError` naming the stage and what differs, `NotPublishedError` if unpublished."""
        manifest = self.stage_manifest(iteration, stage)
        what = f"run {self.run_id} iteration {iteration} {stage}"
        if manifest is None:
            raise NotPublishedError(f"{what} is not published")
        path = self.stage_path(iteration, stage)
        if pruned(path) is not None:
            return self._verify_pruned(iteration, stage, manifest)
        if stage in FILE_STAGES:
            found = digest_files(path)[0]
        else:
            try:
                store = StageStore.open(path, spec_of(stage), self.dim_limits())
            except Exception as err:  # zarr metadata that does not parse, or dims out of bounds
                raise CorruptChunkError(f"{what}: its Zarr metadata cannot be read ({err})") from None
            if store.attrs != manifest.get("attrs"):
                raise CorruptChunkError(f"{what}: the store's attributes differ from its published manifest")
            recorded = manifest.get("metadata_digest")  # stages published before it was recorded have none
            if recorded is not None and metadata_digest(path) != recorded:
                raise CorruptChunkError(f"{what}: a zarr.json metadata file differs from the one published")
            digest_format = manifest.get("digest_format", 1)  # stages published before format 2 record none
            if not known_digest_format(digest_format):
                raise CorruptChunkError(
                    f"{what}: its manifest names digest format {digest_format!r}, not one this version reads "
                    f"{DIGEST_FORMATS}: open the run with the stepgrpo version that wrote it"
                )
            found = store.verify_and_digest(digest_format)[0]  # a bad chunk raises, naming the array and chunk
        if found != manifest.get("digest"):
            raise CorruptChunkError(f"{what}: its content no longer matches its published digest (damaged or edited)")
        if stage == "checkpoint":
            self.check_checkpoint_number(iteration)

    def check_checkpoint_number(self, iteration: int) -> None:
        """A checkpoint's sealed state names the iteration it was written for: one copied under another
        number (`cp -a checkpoints/iter_1 checkpoints/iter_7`) verifies byte for byte, and is still not
        iteration 7's."""
        state = read_json(self.stage_path(iteration, "checkpoint") / "state.json", "checkpoint state")
        written = state.get("iteration") if isinstance(state, dict) else None
        if written is not None and written != iteration:
            raise CorruptChunkError(
                f"run {self.run_id} checkpoints/iter_{iteration} holds the checkpoint of iteration {written} "
                "(copied or renamed); move it aside: it is not this iteration's"
            )

    def _verify_pruned(self, iteration: int, stage: str, manifest: dict[str, Any]) -> None:
        """A pruned stage (`stepgrpo.storage.retention`): what it kept still passes its checks (the attrs,
        every chunk's crc32c; a checkpoint's state); its digest covered what is gone."""
        what = f"run {self.run_id} iteration {iteration} {stage} (pruned)"
        path = self.stage_path(iteration, stage)
        if stage == "checkpoint":
            try:
                read_json(path / "state.json", "checkpoint state")
            except (OSError, StorageError) as err:
                raise CorruptChunkError(f"{what}: its state.json cannot be read ({err})") from None
            self.check_checkpoint_number(iteration)
            return
        try:
            store = StageStore.open(path, spec_of(stage), self.dim_limits())
        except Exception as err:
            raise CorruptChunkError(f"{what}: its Zarr metadata cannot be read ({err})") from None
        if store.attrs != manifest.get("attrs"):
            raise CorruptChunkError(f"{what}: the store's attributes differ from its published manifest")
        gone = set(pruned(path)["removed"])
        for spec in store.arrays():
            if spec.name not in gone:
                store.read(spec.name)

    def pruned(self, iteration: int, stage: str) -> dict[str, Any] | None:
        """The retention record of a pruned stage (`stepgrpo.storage.retention`), or None."""
        return pruned(self.stage_path(iteration, stage))

    def stored_items(self) -> list[tuple[str, Any]]:
        """Everything the run stores that has a digest: `("prompts", None)`, `(f"iteration {k} {stage}",
        (k, stage))` for each published stage, `("rewards/part-...", path)` for each table part."""
        items: list[tuple[str, Any]] = []
        if self.tables.prompts_manifest() is not None:
            items.append(("prompts", None))
        stages = {"rollout", *FILE_STAGES}
        for d in self.path.glob("iter_*/*/*.zarr"):
            stages.add(f"{d.parent.name}/{d.stem}")
        for stage in sorted(stages):
            items += [(f"iteration {k} {stage}", (k, stage)) for k in self.iterations(stage)]
        for table in ("rewards", "advantages"):
            items += [(f"{table}/{p.name}", p) for p in sorted((self.path / table).glob("part-*.parquet"))]
        items += [(name, ("export", name)) for name in self.EXPORTS if (self.path / name / EXPORT_FILE).is_file()]
        for folder in self.RECORDS:
            items += [(f"{folder}/{p.name}", ("record", p)) for p in sorted((self.path / folder).glob("*.json"))]
        evidence = self.path / self.EVIDENCE_DIR
        items += [
            (f"{self.EVIDENCE_DIR}/{p.name}", ("bundle", p))
            for p in sorted(evidence.glob("[!.]*"))
            if p.is_dir() and ".damaged-" not in p.name  # a damaged bundle kept aside is known to be
        ]
        return items

    EXPORTS = ("lora", "transformer")  # the run's exported weights (`stepgrpo.loops.update.export_lora`)
    EVAL_DIR = "eval"  # held-out evaluations (`stepgrpo.tasks.evaluate`)
    QUALITY_DIR = "credit_quality"  # credit-quality checks (`stepgrpo.tasks.quality`)
    RECORDS = (EVAL_DIR, QUALITY_DIR)  # folders of sealed JSON records (`stepgrpo.storage.publish.seal`)
    EVIDENCE_DIR = "evidence"  # evaluations under a protocol, with their evidence (`stepgrpo.storage.bundle`)

    # --- the readers callers would otherwise compose paths for ----------------------------------

    def completion_stages(self, iteration: int | None = None) -> list[str]:
        """The completion stages stored (`completions/<method>`, published or not) for `iteration`,
        or for any iteration when None."""
        where = f"iter_{iteration}" if iteration is not None else "iter_*"
        return sorted({f"completions/{d.stem}" for d in self.path.glob(f"{where}/completions/*.zarr")})

    def published_completions(self, iteration: int) -> list[str]:
        """The completion methods (their stored names, `substeps-5`) published for `iteration`."""
        return [
            stage.split("/", 1)[1]
            for stage in self.completion_stages(iteration)
            if (self.stage_path(iteration, stage) / PUBLISHED_FILE).is_file()
        ]

    def checkpoint_state(self, iteration: int) -> dict[str, Any]:
        """The JSON part of `iteration`'s checkpoint (`state.json`: its update's statistics);
        `FileNotFoundError` when there is none, `CorruptChunkError` when it does not parse."""
        state = read_json(self.stage_path(iteration, "checkpoint") / "state.json", "checkpoint state")
        if not isinstance(state, dict):
            raise CorruptChunkError(f"run {self.run_id} iteration {iteration}: its checkpoint state is not a mapping")
        return state

    def record_path(self, folder: str, name: str) -> Path:
        """Where record `name` of `folder` (`EVAL_DIR`, `QUALITY_DIR`) is kept."""
        if folder not in self.RECORDS:
            raise ValueError(f"unknown record folder {folder!r}; one of {', '.join(self.RECORDS)}")
        return self.path / folder / f"{check_name(name, 'record')}.json"

    def record_paths(self, folder: str, pattern: str = "*") -> list[Path]:
        """The records of `folder` (`EVAL_DIR`, `QUALITY_DIR`) whose names match `pattern`, by name."""
        if folder not in self.RECORDS:
            raise ValueError(f"unknown record folder {folder!r}; one of {', '.join(self.RECORDS)}")
        return sorted((self.path / folder).glob(f"{pattern}.json"))

    def seal_export(self, name: str) -> dict[str, Any]:
        """Record the digest of the export folder `name` (in it, as `_export.json`), so that a
        damaged or truncated export is found by `verify_all`."""
        folder = self.inside(self.path / name)
        digest, size, count = digest_files(folder)
        record = seal({"digest": digest, "bytes": size, "files": count})  # no time: equal exports, equal bytes
        data = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
        target = folder / EXPORT_FILE
        if not (target.is_file() and target.read_bytes() == data):  # an unchanged export is not rewritten
            write_file_atomic(target, data)
        return record

    def verify_export(self, name: str) -> None:
        """The export folder `name` against its recorded digest (`CorruptChunkError` if it differs)."""
        folder = self.path / name
        record = read_json(folder / EXPORT_FILE, f"{name} export record")
        if not isinstance(record, dict) or digest_files(folder)[0] != record.get("digest"):
            raise CorruptChunkError(f"{folder}: its files no longer match their recorded digest (damaged or edited)")

    def verify_all(self) -> list[tuple[str, str]]:
        """Check every stored item (`stored_items`); returns `(item, what is wrong)` for those that fail."""
        from stepgrpo.storage.run_tables import TABLES

        problems = []
        for what, item in self.stored_items():
            try:
                if item is None:
                    self.verify_prompts()
                elif isinstance(item, Path):
                    tables.verify_part(item, *TABLES[item.parent.name])
                elif item[0] == "export":
                    self.verify_export(item[1])
                elif item[0] == "record":
                    read_json(item[1], "record")  # parses, and matches its seal
                elif item[0] == "bundle":
                    from stepgrpo.storage.bundle import verify_bundle, verify_owner

                    verify_bundle(item[1])
                    verify_owner(item[1], self.run_id)
                else:
                    self.verify(*item)
            except StorageError as err:
                problems.append((what, str(err)))
        return problems

    def verify_prompts(self) -> None:
        """Check the prompt table against the digest in its footer (`CorruptChunkError` if not)."""
        self.tables.read_prompts()  # it checks the digest

    def set_aside_file(self, path: Path) -> Path:
        """Move a damaged file of the run out of the way (never deleted); returns its new path."""
        target = path.with_name(_damaged_name(path.name))
        os.rename(path, target)
        return target

    def set_aside(self, iteration: int, stage: str) -> Path:
        """Move a damaged (or unpublished) stage directory out of the way, never deleting it:
        `<name>.damaged-<UTC time>-<token>` beside it. Returns the new path."""
        final = self.stage_path(iteration, stage)
        target = final.with_name(_damaged_name(final.name))
        os.rename(final, target)
        return target

    def attach(self, iteration: int, stage: str, token: str) -> StageWriter:
        """Join a begun stage from another process with the begin's `writer.token`."""
        spec = spec_of(stage) if stage != "checkpoint" else None
        writer = StageWriter(
            self.run_id,
            self.stage_path(iteration, stage),
            iteration,
            stage,
            token,
            owner=False,
            spec=spec,
            digest_format=self.digest_format,
        )
        check_token(writer.lock, token, writer.what)
        return writer


# The config fields that bound a stage's dims: prompts and group size (B), steps (T).
CONFIG_DIMS = (("run", "prompts_per_iteration"), ("run", "group_size"), ("sampler", "steps"))


def _positive_int(config: Mapping[str, Any], section: str, field: str) -> int | None:
    """`config[section][field]` if it is a positive int (a stored config is data: anything else is None)."""
    value = config.get(section, {}).get(field) if isinstance(config.get(section), Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def find_run(run: str | os.PathLike[str], runs_root: str | os.PathLike[str] = "runs") -> Path:
    """A run directory given as a path, or as a run id under `runs_root` (resolved)."""
    for candidate in (Path(run), Path(runs_root) / str(run)):
        if (candidate / MANIFEST_FILE).is_file():
            return candidate.resolve()
    raise NotPublishedError(
        f"no run {str(run)!r}: neither a run directory nor a run id under {runs_root}/ (see `stepgrpo runs`)"
    )


def _damaged_name(name: str) -> str:
    """`<name>.damaged-<UTC time>-<token>`: where damaged data are kept aside."""
    return f"{name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(2)}"
