"""The training flow: iterations of rollout -> complete -> score -> credit -> update.

Every stage is a cached task (see `tasks.keys`); re-running the same run id resumes at the first
unpublished stage. Held-out evaluation runs before training, every `run.eval_every` iterations,
and at the end.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from stepgrpo import report, stages
from stepgrpo.config import load_config
from stepgrpo.tracking import Tracker
from tasks.stages import bind


@flow(name="train", log_prints=True)
def train(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Train a LoRA with GRPO and step-level credit (config file + `key=value` overrides)."""
    cfg = load_config(config_path, overrides or [])
    path = report.resolve_run_dir(cfg, run_dir, run_id)
    run = stages.open_run(cfg, path)
    conf, where, t = cfg.model_dump(mode="json"), str(path), bind(path)

    prompts = t.prompts(where, conf, 0, {})
    psi = t.calibrate(where, conf, 0, {"prompts": prompts["digest"]})["digest"] if cfg.sampler.kernel == "psi" else None
    evals = [t.evaluate(where, conf, -1, {"prompts": prompts["digest"], "checkpoint": "init"})]
    checkpoint, rows, watch = "init", [], report.SignalWatch()
    progress = create_progress_artifact(0.0, description=f"stepgrpo run {run.run_id}: iterations done")

    with Tracker.start(path, cfg.run.name, run.run_id, {"run_dir": where, "run_id": run.run_id}) as tracker:
        tracker.log_params(cfg.flat())
        tracker.log_metrics(report.eval_metrics(evals[0]), step=0)
        tracker.log_artifact(evals[0]["grid"], "eval")
        for i in range(cfg.run.iterations):
            rollout = t.rollout(where, conf, i, {"prompts": prompts["digest"], "checkpoint": checkpoint, "psi": psi})
            clean = t.complete(where, conf, i, {"rollout": rollout["digest"], "checkpoint": checkpoint}) if cfg.completion.method else rollout
            rewards = t.score(where, conf, i, {"clean": clean["digest"], "rollout": rollout["digest"]})
            credit = t.credit(where, conf, i, {"rewards": rewards["digest"], "reward": [rewards["reward_name"], rewards["reward_version"]]})
            update = t.update(where, conf, i, {"advantages": credit["digest"], "rollout": rollout["digest"], "checkpoint": checkpoint,
                                               "scheme": credit["scheme"], "options_digest": credit["options_digest"]})
            checkpoint = update["digest"]

            refs = {"rollout": rollout, "score": rewards, "credit": credit, "update": update}
            refs |= {"complete": clean} if cfg.completion.method else {}
            tracker.log_metrics(report.iteration_metrics(refs), step=i + 1)
            rows.append(report.iteration_row(i, rewards, update))
            print(report.iteration_line(rows[-1]))
            if (warning := watch.see(i, update)) is not None:
                print(warning)
            if i + 1 == cfg.run.iterations or (cfg.run.eval_every and (i + 1) % cfg.run.eval_every == 0):
                evals.append(t.evaluate(where, conf, i, {"prompts": prompts["digest"], "checkpoint": checkpoint}))
                tracker.log_metrics(report.eval_metrics(evals[-1]), step=i + 1)
                tracker.log_artifact(evals[-1]["grid"], "eval")
            update_progress_artifact(progress, 100.0 * (i + 1) / cfg.run.iterations)

        tracker.log_dir(stages.export_lora(run, cfg, cfg.run.iterations - 1), "lora")
        report.publish_artifacts(run.run_id, cfg, rows, evals, {"run directory": where, "MLflow": tracker.uri})
    return {"run_id": run.run_id, "run_dir": where, "tracking_uri": tracker.uri, "evaluations": evals, "iterations": rows}
