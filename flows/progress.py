"""What the training flow tells people, one call per event: MLflow metrics, Prefect artifacts, the console.

`TrainingLog` opens one MLflow run for the flow run (parameters once), then logs each iteration's
stage results and each evaluation; a cached stage still reports its numbers, since only the
results are read. Kept out of `flows/train.py` so that the flow reads like the algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepgrpo.config import Config
from stepgrpo.reporting import report
from stepgrpo.reporting.card import run_note
from stepgrpo.reporting.costs import iteration_cost
from stepgrpo.reporting.live import TrainingView
from stepgrpo.reporting.metrics import BY_NFE, BY_PASSES, eval_metrics, iteration_metrics, iteration_row
from stepgrpo.reporting.tracking import comparison_tags, experiment_name, start_tracker
from stepgrpo.results import (
    CompleteResult,
    CreditResult,
    DrawResult,
    EvaluateResult,
    RolloutResult,
    ScoreResult,
    UpdateResult,
)
from stepgrpo.storage.run import Run


def run_name_from_parameters() -> str:
    """A flow run's name at its start (Prefect's `flow_run_name`): the run id its parameters give
    (`run_id`, `run_dir`'s name, `run`'s name); `name_flow_run` names a new run once its id is made."""
    from pathlib import Path

    from prefect.runtime import flow_run

    params = flow_run.parameters
    for key in ("run_id", "run_dir", "run"):
        if params.get(key):
            return Path(str(params[key])).name
    return f"new {flow_run.flow_name} run"


def name_flow_run(name: str) -> None:
    """Name the current flow run (`name`: the run id, and what the flow does to it), so that the
    Prefect UI lists runs by what they are, not by a random name."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    run_id = flow_run.get_id()
    if run_id is None:  # not inside a flow run
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(run_id, name=name)


def log_offline(
    run: Run,
    cfg: Config,
    kind: str,
    label: str,
    params: dict[str, Any],
    rows: list[dict[str, Any]],
    metrics: list[str],
    artifacts: list[str] | None = None,
) -> None:
    """What an offline flow (`rescore`, `credit`, `evaluate`) computed on a stored run, as a tracked
    run of its own beside the training run's, in the run's backend (MLflow:
    `stepgrpo.reporting.offline.write`; W&B: `wandb_tracker.log_offline_record`): tagged with its
    parent, `metrics` of each row logged at its iteration, all rows as a table. Logging again under
    the same `label` continues the same tracked run."""
    from stepgrpo.reporting import offline

    record = {
        "kind": kind,
        "experiment": experiment_name(),
        "name": f"{run.run_id} {kind} {label}",
        "tags": {**comparison_tags(cfg), "stepgrpo.parent_run_id": run.run_id, "stepgrpo.kind": kind},
        "params": {k: str(v) for k, v in params.items()},
        "rows": rows,
        "metrics": metrics,
        "artifacts": list(artifacts or []),  # folders logged as they are (an evidence bundle)
    }
    if cfg.tracking.backend == "wandb":  # the training run's backend takes its offline results too
        from stepgrpo.reporting.wandb_tracker import log_offline_record

        log_offline_record(run.path, cfg.tracking.project or record["experiment"], record)
        return
    offline.log(run.path, run.run_id, record)


def evaluation_record(run: Run, ev: EvaluateResult) -> dict[str, Any]:
    """An evaluation as a flow returns it: JSON, with the image grid's full path."""
    return ev.record() | {"grid": str(Path(run.path) / ev.grid)}


class TrainingLog:
    """One MLflow run, the Prefect progress and summary artifacts, and the console lines of a training flow."""

    def __init__(self, run: Run, cfg: Config) -> None:
        self.run, self.cfg = run, cfg
        self.rows: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        self.watch = report.SignalWatch()
        self.freed = 0
        # cumulative transformer NFEs, training seconds and forward-equivalent passes (a backward = 2
        # forwards: `stepgrpo.reporting.costs`), cached iterations too
        self.cost = [0.0, 0.0, 0.0]

    def __enter__(self) -> TrainingLog:
        from prefect.artifacts import create_progress_artifact

        where = str(self.run.path)
        self.tracker = start_tracker(
            self.cfg,
            self.run.path,
            self.run.run_id,
            {"run_dir": where, "run_id": self.run.run_id, **comparison_tags(self.cfg)},
        )
        self.tracker.__enter__()
        if not self.tracker.resumed:  # a resumed run has the same config, so the same params
            self.tracker.log_params(self.cfg.flat())
        import torch

        # what this process runs with (a deployed run's worker may differ from the CLI's shell)
        self.tracker.set_tags({"stepgrpo.torch_threads": str(torch.get_num_threads())})
        self.progress = create_progress_artifact(0.0, description=f"stepgrpo run {self.run.run_id}: iterations done")
        self.view = TrainingView(self.run.run_id, self.cfg.run.iterations).__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.view.__exit__(*exc)
        self.tracker.__exit__(*exc)

    def resuming(self, done: int, stored: int) -> None:
        """The run resumes with `done` iterations finished and `stored` stages already in it; the bar
        shows the last held-out reward it stored."""
        from stepgrpo.inspection import evaluations

        self.view.started(done)
        stored_evals, _ = evaluations(self.run)
        if stored_evals:
            self.view.evaluated(stored_evals[-1].reward_mean)
        self.view.say(
            f"resuming run {self.run.run_id} at iteration {done} of {self.cfg.run.iterations} "
            f"({stored} stored stages reused where they verify)"
        )

    def evaluation(self, step: int, ev: EvaluateResult) -> None:
        """A held-out evaluation, logged at `step` (updates done: 0 for the base model) with the
        cumulative training NFEs and seconds before it (`eval/nfe_total`, `eval/seconds_total`); its
        grid's first 16 captioned tiles, 4 x 4 (`images.preview`), go to MLflow's image history
        `eval` at the same step; the whole grid stays in the run's `eval/`."""
        from PIL import Image

        from stepgrpo.images import preview

        self.evaluations.append(evaluation_record(self.run, ev))
        self.tracker.set_note(run_note(self.cfg, self.evaluations, self.cost[0]))
        self.view.evaluated(ev.reward_mean)
        # the training compute spent before this evaluation, at its step: plot eval/* against these
        cost = {"eval/nfe_total": self.cost[0], "eval/seconds_total": self.cost[1], "eval/passes_total": self.cost[2]}
        self.tracker.log_metrics(eval_metrics(ev) | cost, step=step)
        # the same held-out reward with the cumulative training NFEs as its step: MLflow's default
        # x-axis (step) then compares runs of any scheme at equal compute, with no chart settings
        self.tracker.log_by_compute(BY_NFE, ev.reward_mean, self.cost[0], step)
        self.tracker.log_by_compute(BY_PASSES, ev.reward_mean, self.cost[2], step, unit="passes")  # objectives compare
        with Image.open(self.evaluations[-1]["grid"]) as grid:
            self.tracker.log_image(preview(grid).convert("RGB"), key="eval", step=step)

    def iteration(
        self,
        i: int,
        rollout: RolloutResult,
        clean: CompleteResult | RolloutResult,
        rewards: ScoreResult,
        credit: CreditResult,
        update: UpdateResult,
        draw: DrawResult | None = None,
    ) -> None:
        """Iteration `i`'s stage results: metrics, its row and console line, the signal check."""
        from prefect.artifacts import update_progress_artifact

        step_rewards = self.cfg.completion.method is not None
        metrics = iteration_metrics(rollout, clean, rewards, credit, update, draw, step_rewards)
        cost = iteration_cost(self.run, i)  # what the stored stages say, as `compare` reads them
        passes = cost["passes"] if cost["passes"] is not None else cost["nfe"]
        self.cost = [self.cost[0] + cost["nfe"], self.cost[1] + cost["seconds"], self.cost[2] + passes]
        # compare any two runs at equal compute in the MLflow UI: plot against these, not the step
        metrics |= {
            "cost/nfe_total": self.cost[0],
            "cost/seconds_total": self.cost[1],
            "cost/passes_total": self.cost[2],
        }
        self.tracker.log_metrics(metrics, step=i)
        self.rows.append(iteration_row(i, rewards, update))
        print(report.iteration_line(self.rows[-1]))  # the log's line (the live view shows the reward)
        self.view.iteration(i, rewards.reward_mean)
        if (warning := self.watch.see(i, update.stats)) is not None:
            self.view.say(warning)
        update_progress_artifact(self.progress, 100.0 * (i + 1) / self.cfg.run.iterations)
        report.publish_reward_table(self.run.run_id, self.rows)

    def pruned(self, report: Any) -> None:
        """What retention removed after an iteration (`stepgrpo.storage.retention`): a console line, and
        the bytes freed so far as a metric."""
        if report.stages:
            print(report.describe())
            self.freed += report.freed
            self.tracker.log_metrics({"storage/freed_mib": self.freed / 2**20}, step=report.stages[-1][0])

    def finish(self, lora_dir: Path) -> dict[str, Any]:
        """Log the exported LoRA, publish the run's summary artifacts; returns the flow's result."""
        where = str(self.run.path)
        if self.cfg.model.finetune == "full":  # the transformer: gigabytes at paper scale, kept in the run only
            self.tracker.set_tags({"stepgrpo.transformer": str(lora_dir)})
        else:
            self.tracker.log_dir(lora_dir, "lora")
        report.publish_summary(
            self.run.run_id, self.cfg, self.evaluations, {"run directory": where, "MLflow": self.tracker.uri}
        )
        return {
            "run_id": self.run.run_id,
            "run_dir": where,
            "tracking_uri": self.tracker.uri,
            "evaluations": self.evaluations,
            "iterations": self.rows,
        }
