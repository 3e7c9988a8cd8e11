"""What every stage task shares: the Prefect task it is, and when a published stage may be reused.

The run directory is the truth (docs/PIPELINE.md, "Caching and restart"): a stage task keeps no
result of its own (Prefect
caches and persists nothing), so nothing in or out of a run directory is ever decoded by a format
that can run code. Its body asks `reuse` whether the stage is published under its key and its data
still verify against the stage's manifest; if so it reads the result back (cheap), else it
computes. Damaged data are moved aside, never deleted, and recomputed: a stage is deterministic
given its key, so a recomputed stage has the digest its downstream stages were keyed on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from prefect import task
from prefect.cache_policies import NO_CACHE

from stepgrpo.errors import StageError
from stepgrpo.storage.errors import CorruptChunkError, StorageError
from stepgrpo.storage.ledger import finished as ledger_result
from stepgrpo.storage.run import Run
from stepgrpo.tasks.keys import Key

# What to do about a damaged stage that a flow reads but cannot compute (rescore, credit, evaluate).
RESUME_FIX = "resume the run with `stepgrpo train` and its config to compute it again, or restore it from a copy"


def stage_task(stage: str) -> Callable[[Callable[..., Any]], Any]:
    """`@stage_task("rollout")`: a Prefect task named after its stage that caches nothing; its
    runs are named after the stage and iteration (`rollout iter_3`, `evaluate base`). On a GPU its
    result carries the call's peak memory (`Result.peak_memory_gib`)."""

    def decorate(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            _pin_threads(args)
            device = _cuda_device(args)
            if device is None:
                return fn(*args, **kwargs)
            import torch

            torch.cuda.reset_peak_memory_stats(device)
            result = fn(*args, **kwargs)
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            return result.model_copy(update={"peak_memory_gib": peak}) if hasattr(result, "model_copy") else result

        return task(name=stage, cache_policy=NO_CACHE, persist_result=False, task_run_name=_run_name(stage))(measured)

    return decorate


def _pin_threads(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
    """Compute with the thread count the stage's run recorded (`stepgrpo.runtime.environment.pin_threads`)."""
    from stepgrpo.runtime.environment import pin_threads

    run = args[0] if args else (kwargs or {}).get("run")
    if isinstance(run, Run):
        pin_threads(run)


def _cuda_device(args: tuple[Any, ...]) -> Any:
    """The CUDA device of the stage's config (its second argument) when it runs on one, else None."""
    import torch

    from stepgrpo.config import Config

    cfg = args[1] if len(args) > 1 and isinstance(args[1], Config) else None
    if cfg is None or not cfg.model.device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.device(cfg.model.device)


def _run_name(stage: str) -> Callable[[], str]:
    def name() -> str:
        from prefect.runtime import task_run

        params = task_run.parameters
        i, shard = params.get("iteration"), params.get("shard")
        out = stage if i is None else f"{stage} base" if i < 0 else f"{stage} iter_{i}"
        return out + (f" rows {shard.start}-{shard.stop - 1}" if isinstance(shard, range) else "")

    return name


def transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry a failure that may pass (a lost worker, out of memory, a
    reward server that did not answer), not one that the same inputs give again: bad input, a
    stage published from other inputs, damaged data (`stepgrpo_cli`'s expected errors)."""
    from stepgrpo.config import ConfigError
    from stepgrpo_core.registry import UnknownNameError

    deterministic = (ConfigError, StageError, StorageError, UnknownNameError, ValueError, TypeError, KeyError)
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # the failure itself could not be read back: let the retry policy decide
        return True
    return not isinstance(error, deterministic)


def with_retries(stage: Any, retries: int, delay_s: float) -> Any:
    """`stage` retried `retries` times, `delay_s` seconds after a transient failure (`transient`)."""
    if not retries:
        return stage
    return stage.with_options(retries=retries, retry_delay_seconds=delay_s, retry_condition_fn=transient)


def shard_task(stage: str) -> Callable[[Callable[..., Any]], Any]:
    """`@shard_task("rollout")`: the Prefect task of one shard of a stage (`stepgrpo.runtime.workers`). It
    writes its rows and then its ledger record (`stepgrpo.storage.ledger`); it returns nothing. On a Ray
    worker as in this process it computes with the thread count its run recorded (`_pin_threads`)."""

    def decorate(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def shard(*args: Any, **kwargs: Any) -> None:
            _pin_threads(args, kwargs)
            return fn(*args, **kwargs)

        return task(
            name=f"{stage}-shard",
            cache_policy=NO_CACHE,
            persist_result=False,
            task_run_name=_run_name(f"{stage}-shard"),
        )(shard)

    return decorate


def fan_out(
    shard: Any,
    ledger: Path,
    key: str,
    shards: list[range],
    params: dict[str, Any],
    what: str,
    intact: Callable[[range], bool] | None = None,
    unit: str = "rows",
) -> Shards:
    """Run `shard` for every shard not finished under `key` (its record missing, or its rows no
    longer `intact`) on the flow's workers."""
    from stepgrpo.runtime.workers import run_shards

    def todo(r: range) -> bool:
        return ledger_result(ledger, r, key) is None or (intact is not None and not intact(r))

    pending = [r for r in shards if todo(r)]
    run_shards(shard, pending, {**params, "key": key}, what, unit)
    results = [ledger_result(ledger, r, key) for r in shards]
    missing = [f"{r.start}-{r.stop - 1}" for r, res in zip(shards, results) if res is None]
    if missing:
        raise StageError(f"{what}: shard(s) of {unit} {', '.join(missing)} finished without recording it")
    summary = {
        "total": len(shards),
        "computed": [[r.start, r.stop] for r in pending],
        "seconds": [res.get("seconds") for res in results],  # each shard's own time (the stage's minus them: overhead)
        "workers": [res.get("worker") for res in results],  # who computed each shard, with its model loads
    }
    return Shards(results, summary)  # type: ignore[arg-type]


class Shards(NamedTuple):
    """What `fan_out` returns: each shard's recorded result, and which shards this call computed
    (recorded in the stage's manifest: a resumed stage says what it did not redo)."""

    results: list[dict[str, Any]]
    summary: dict[str, Any]


def warn(message: str) -> None:
    print(f"warning: {message}")


def check_key(recorded: str | None, key: Key, what: str) -> None:
    """A stage published from other inputs is an error: a run's stages are immutable."""
    if not key.accepts(recorded):
        raise StageError(
            f"{what} is already published from other inputs (stored key {recorded}, this run's key {key.value}); "
            "the run's stages are immutable: start a new run id, or if the stored stage was edited, move it aside"
        )


def reuse(run: Run, iteration: int, stage: str, key: Key, what: str) -> bool:
    """Whether `stage` of `iteration` is published under `key` and verifies; a damaged one is set
    aside (and so recomputed by the caller)."""
    try:
        manifest = run.stage_manifest(iteration, stage)
        if manifest is None:
            return False
        check_key(manifest.get("inputs", {}).get("key"), key, what)
    except CorruptChunkError as err:
        return _set_aside(run, iteration, stage, err)
    return intact(run, iteration, stage)


def intact(run: Run, iteration: int, stage: str) -> bool:
    """Whether a published stage verifies; a damaged one is set aside (so it is computed again)."""
    try:
        run.verify(iteration, stage)
    except CorruptChunkError as err:
        return _set_aside(run, iteration, stage, err)
    return True


def _set_aside(run: Run, iteration: int, stage: str, err: Exception) -> bool:
    moved = run.set_aside(iteration, stage)
    warn(f"{err}; kept aside as {moved.name}, computing it again")
    return False


def manifest(run: Run, iteration: int, stage: str, what: str, verify: bool = False) -> dict[str, Any]:
    """A published stage's manifest, for reading its result back (`verify`: check its data first,
    for flows that read a stage but cannot compute it)."""
    found = run.stage_manifest(iteration, stage)
    if found is None:
        raise StageError(f"run {run.run_id}: {what} is not published")
    if verify:
        verified(run, iteration, stage, what, RESUME_FIX)
    return found


def verified(run: Run, iteration: int, stage: str, what: str, fix: str) -> None:
    """For flows that read a stage but cannot recompute it: a clear error if it does not verify."""
    try:
        run.verify(iteration, stage)
    except StorageError as err:
        raise StageError(f"{what}: {err}; {fix}") from None


def repair_table(run: Run, table: str) -> None:
    """Set aside the parts of a table (`rewards`, `advantages`) that do not match their digests,
    so the stage that appended them appends them again."""
    for part in run.tables.damaged_parts(table):
        moved = run.set_aside_file(part)
        warn(f"{part} does not match the digest in its name; kept aside as {moved.name}, its rows are computed again")
