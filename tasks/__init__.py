"""The pipeline's stages, one module each, in the order a run meets them:

    prompts -> [calibrate] -> evaluate(base) -> per iteration:
        [draw] -> rollout -> [complete] -> score -> credit -> update -> [evaluate]

Each module holds the Prefect task, the stage body it runs (`execute`, idempotent) and the
result of a published stage read back (`stored`). A task persists nothing: a stage is reused when
its published output verifies under its key (`stepgrpo.tasks.base`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from stepgrpo.config import Config
from stepgrpo.storage.run import Run

if TYPE_CHECKING:
    from prefect import Task

    from stepgrpo.results import (
        CalibrateResult,
        CompleteResult,
        CreditResult,
        DrawResult,
        EvaluateResult,
        PromptsResult,
        RolloutResult,
        ScoreResult,
        UpdateResult,
    )


@dataclass(frozen=True)
class Stages:
    """The stage tasks of one run (`bind`): call them as `stages.rollout(run, cfg, i, ...)`."""

    prompts: Task[..., PromptsResult]  # tasks.prompts.prompts
    calibrate: Task[..., CalibrateResult]  # tasks.calibrate.calibrate
    draw: Task[..., DrawResult]  # tasks.draw.draw
    rollout: Task[..., RolloutResult]  # tasks.rollout.rollout
    complete: Task[..., CompleteResult]  # tasks.complete.complete
    score: Task[..., ScoreResult]  # tasks.score.score
    credit: Task[..., CreditResult]  # tasks.credit.credit
    update: Task[..., UpdateResult]  # tasks.update.update
    evaluate: Task[..., EvaluateResult]  # tasks.evaluate.evaluate


def bind(run: Run, cfg: Config) -> Stages:
    """The stage tasks for `run`, each retried `cfg.scale.stage_retries` times after a failure that
    may pass (`stepgrpo.tasks.base.transient`). They keep no results of their own: the run directory is
    their cache (`stepgrpo.tasks.base`), which is also what makes a retry safe: every stage is idempotent,
    and a retried one reuses what the failed attempt finished (its published shards)."""
    from stepgrpo.tasks.base import with_retries
    from stepgrpo.tasks.calibrate import calibrate
    from stepgrpo.tasks.complete import complete
    from stepgrpo.tasks.credit import credit
    from stepgrpo.tasks.draw import draw
    from stepgrpo.tasks.evaluate import evaluate
    from stepgrpo.tasks.prompts import prompts
    from stepgrpo.tasks.rollout import rollout
    from stepgrpo.tasks.score import score
    from stepgrpo.tasks.update import update

    stages = Stages(prompts, calibrate, draw, rollout, complete, score, credit, update, evaluate)
    return Stages(
        *(
            with_retries(getattr(stages, f.name), cfg.scale.stage_retries, cfg.scale.stage_retry_delay_s)
            for f in fields(Stages)
        )
    )
