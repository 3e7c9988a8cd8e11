"""The ledger of a sharded stage: one JSON record per finished shard, so a stage resumes shard by shard.

A Zarr stage's ledger is the `_shards/` directory of its `.partial` directory (removed before it
is published); other stages keep theirs beside their output. `stage.json` holds the key the stage
is computed under; a record `{"key", "start", "stop", "result"}` is written atomically after the
shard's data. A shard whose record carries the stage's key is not computed again; a shard killed
half-way has no record and is redone whole. Records are JSON: data, never code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from stepgrpo.storage.publish import canonical_json, partial_path, write_file_atomic

LEDGER = "_shards"  # the ledger's directory inside a stage's `.partial` directory


def record_path(ledger: Path, shard: range) -> Path:
    return ledger / f"shard-{shard.start:07d}-{shard.stop:07d}.json"


def finished(ledger: Path, shard: range, key: str) -> dict[str, Any] | None:
    """The result a finished shard recorded under `key`, or None (not finished, or other inputs)."""
    try:
        record = json.loads(record_path(ledger, shard).read_text())
    except (FileNotFoundError, ValueError, RecursionError):  # a damaged record: the shard is computed again
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    return record.get("result")


def record(ledger: Path, shard: range, key: str, result: dict[str, Any]) -> None:
    """Mark `shard` finished under `key` (after its data are written)."""
    ledger.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "start": shard.start, "stop": shard.stop, "result": result}
    write_file_atomic(record_path(ledger, shard), canonical_json(data).encode())


def open_ledger(ledger: Path, key: str) -> None:
    """Start or continue the ledger of a stage computed under `key`; another key's records go."""
    if stage_key(ledger) == key:
        return
    shutil.rmtree(ledger, ignore_errors=True)
    ledger.mkdir(parents=True)
    write_file_atomic(ledger / "stage.json", canonical_json({"key": key}).encode())


def close_ledger(ledger: Path) -> None:
    shutil.rmtree(ledger, ignore_errors=True)


def stage_key(ledger: Path) -> str | None:
    try:
        found = json.loads((ledger / "stage.json").read_text())
    except (FileNotFoundError, ValueError, RecursionError):  # a damaged record: the shard is computed again
        return None
    return found.get("key") if isinstance(found, dict) else None


def resumable(final: Path, key: str) -> bool:
    """Whether the `.partial` directory of the stage published at `final` was begun under `key`."""
    return stage_key(partial_path(final) / LEDGER) == key
