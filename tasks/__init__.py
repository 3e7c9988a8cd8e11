"""The pipeline's stages, one module each, in the order a run meets them:

    prompts -> [calibrate] -> evaluate(base) -> per iteration:
        rollout -> [complete] -> score -> credit -> update -> [evaluate]

Each module holds the Prefect task, the stage body it runs (`execute`, idempotent) and the
result of a published stage read back (`stored`). `bind(run)` gives the tasks with their results
persisted inside the run directory, so a run carries its own task cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from storage.run import Run

if TYPE_CHECKING:
    from prefect import Task

    from stepgrpo.results import (
        CalibrateResult,
        CompleteResult,
        CreditResult,
        EvaluateResult,
        PromptsResult,
        RolloutResult,
        ScoreResult,
        UpdateResult,
    )

RESULTS_DIR = "prefect-results"  # inside the run directory


@dataclass(frozen=True)
class Stages:
    """The stage tasks of one run (`bind`): call them as `stages.rollout(run, cfg, i, ...)`."""

    prompts: Task[..., PromptsResult]  # tasks.prompts.prompts
    calibrate: Task[..., CalibrateResult]  # tasks.calibrate.calibrate
    rollout: Task[..., RolloutResult]  # tasks.rollout.rollout
    complete: Task[..., CompleteResult]  # tasks.complete.complete
    score: Task[..., ScoreResult]  # tasks.score.score
    credit: Task[..., CreditResult]  # tasks.credit.credit
    update: Task[..., UpdateResult]  # tasks.update.update
    evaluate: Task[..., EvaluateResult]  # tasks.evaluate.evaluate


def bind(run: Run) -> Stages:
    """The stage tasks with their results persisted under `<run>/prefect-results/`."""
    from tasks.calibrate import calibrate
    from tasks.complete import complete
    from tasks.credit import credit
    from tasks.evaluate import evaluate
    from tasks.prompts import prompts
    from tasks.rollout import rollout
    from tasks.score import score
    from tasks.update import update

    storage = Path(run.path).resolve() / RESULTS_DIR
    tasks = (prompts, calibrate, rollout, complete, score, credit, update, evaluate)
    return Stages(**{t.name: t.with_options(result_storage=storage) for t in tasks})
