"""The marks retention leaves: a pruned stage's `_pruned.json` record (what was removed, when, why),
and the error a read of removed data raises. Below every reader of a stage (arrays, checkpoints,
the run); the pruning policy itself is `stepgrpo.storage.retention`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepgrpo.storage.errors import CorruptChunkError, StorageError
from stepgrpo.storage.publish import read_json

PRUNED_FILE = "_pruned.json"


class PrunedError(StorageError):
    """A read of data that retention removed; the message names the stage and the setting."""


def pruned(path: Path) -> dict[str, Any] | None:
    """The `_pruned.json` record of the stage directory at `path`, or None."""
    f = path / PRUNED_FILE
    if not f.is_file():
        return None
    record = read_json(f, "retention record")
    fields_ok = isinstance(record, dict) and isinstance(record.get("removed"), list)
    fields_ok = fields_ok and all(isinstance(record.get(f), str) for f in ("why", "pruned_at"))
    if not fields_ok or not all(isinstance(n, str) for n in record["removed"]):
        raise CorruptChunkError(f"{f} is not a retention record (a list of removed arrays): it is damaged")
    return record


def check_not_pruned(path: Path, names: list[str] | None, what: str) -> None:
    """A `PrunedError` if any of `names` (arrays or tensor groups; None: any) was pruned from the
    stage at `path`."""
    record = pruned(path)
    if record is None:
        return
    gone = sorted(set(record["removed"]) if names is None else set(names) & set(record["removed"]))
    if gone:
        raise PrunedError(
            f"{what}: {', '.join(gone)} were pruned on {record['pruned_at']} ({record['why']}); this needs them. "
            "A pruned run still resumes and recomputes advantages (`stepgrpo credit`); to re-score, complete "
            "or evaluate it again, rerun those iterations in a new run with storage.keep: all (and "
            "storage.checkpoint_every: 0)"
        )
