"""The prompts stage: the run's prompt table (train and held-out splits), written once."""

from __future__ import annotations

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.prompts import prompt_source
from stepgrpo.results import PromptsResult
from stepgrpo.storage.errors import CorruptChunkError
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import stage_task, warn


@stage_task("prompts")
def prompts(run: Run, cfg: Config) -> PromptsResult:
    """Write the run's prompt table from the config's source (once)."""
    return execute(run, cfg)


def execute(run: Run, cfg: Config) -> PromptsResult:
    try:
        manifest = run.tables.prompts_manifest()
    except CorruptChunkError:
        manifest = {}  # unreadable: verify_prompts below says so, and it is written again
    if manifest is not None:
        try:
            run.verify_prompts()
            return PromptsResult(digest=manifest["digest"], rows=manifest["rows"])
        except CorruptChunkError as err:
            warn(f"{err}; kept aside as {run.set_aside_file(run.path / 'prompts.parquet').name}, writing it again")
    return compute(run, cfg)


def compute(run: Run, cfg: Config) -> PromptsResult:
    source = prompt_source(cfg)
    if "train" not in source.splits:
        raise StageError(f"run.prompts {cfg.run.prompts!r} holds no training prompts")
    manifest = run.tables.write_prompts(list(range(len(source.texts))), source.texts, source.splits, source.metadata)
    return PromptsResult(digest=manifest["digest"], rows=manifest["rows"])
