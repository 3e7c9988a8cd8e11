"""What the Python entry's training and credit-quality calls return or raise (`stepgrpo.flows.api`): a
finished run's place and measurements, a credit-quality check's result and record. Light to import:
the result types they hold are imported where used."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepgrpo.results import EvaluateResult, Gain, QualityResult


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped a training run; `train` with the same config and `run_dir`
    resumes it at its first unfinished stage."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(f"run {run_dir.name} interrupted")
        self.run_dir = run_dir


@dataclass(frozen=True)
class TrainResult:
    """A finished `train`: where the run is, and what it measured."""

    run_id: str
    run_dir: Path
    tracking_uri: str  # the MLflow store of the run
    evaluations: list[EvaluateResult]  # held-out evaluations, base first
    iterations: list[dict[str, Any]]  # one row per iteration (training reward, PPO diagnostics)

    def gain(self) -> Gain | None:
        """The paired held-out gain of the last evaluation over the base (`Gain`: mean, 95 % interval,
        clustered by prompt), None with fewer than two evaluations."""
        from stepgrpo.reporting.report import paired_gain
        from stepgrpo.results import Gain

        if len(self.evaluations) < 2:
            return None
        found = paired_gain(self.evaluations[0].record(), self.evaluations[-1].record())
        return None if found is None else Gain(*found)


@dataclass(frozen=True)
class QualityCheck:
    """A credit-quality check: its result, the record it stored in the run, and the run's directory."""

    result: QualityResult
    record: Path
    run_dir: Path
