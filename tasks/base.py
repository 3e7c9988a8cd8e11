"""What every stage task shares: the Prefect task it is, and the check that its output is published.

A stage task takes `(run, cfg[, iteration], *upstream results)` and returns its typed result
(`stepgrpo.results`), persisted by Prefect with the JSON serializer under the run's
`prefect-results/` (`tasks.bind`) under the key of `tasks.keys`. The stage body behind it is
idempotent: when its output is already published under the same key (a resumed run whose task
record is gone), it returns the stored result without computing. A stage that crashed half-way
left nothing published (storage's atomic publish), so it is simply redone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task

from stepgrpo.errors import StageError
from tasks.keys import cache_key


def stage_task(stage: str) -> Callable[[Callable[..., Any]], Any]:
    """`@stage_task("rollout")`: a cached, persisted Prefect task named after its stage."""
    return task(name=stage, cache_key_fn=cache_key(stage), persist_result=True, result_serializer="json")


def published(manifest: dict[str, Any] | None, key: str, what: str) -> bool:
    """Whether a stage's output is published under `key` (None: not published). Published from
    other inputs is an error: a run's stages are immutable."""
    if manifest is None:
        return False
    stored = manifest.get("inputs", {}).get("key")
    if stored is not None and stored != key:
        raise StageError(
            f"{what} is already published from other inputs (key {stored[:12]} != {key[:12]}); "
            "the run's stages are immutable: start a new run id"
        )
    return True
