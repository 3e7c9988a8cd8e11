"""The training flow: iterations of [draw] -> rollout -> complete -> score -> credit -> update.

Every stage is a cached task (`tasks`, keys in `stepgrpo.tasks.keys`); re-running the same run id resumes
at the first unpublished stage. Held-out evaluation runs before training, every `run.eval_every`
iterations, and at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from stepgrpo.checks import check_config
from stepgrpo.config import Config, config_from
from stepgrpo.flows.progress import TrainingLog, name_flow_run, run_name_from_parameters
from stepgrpo.loops.update import export_lora, kept_ranks
from stepgrpo.runs import apply_retention, open_run, owned, resolve_run_dir, resume_point
from stepgrpo.runtime import environment
from stepgrpo.runtime.workers import workers
from stepgrpo.storage.run import Run
from stepgrpo.tasks import bind
from stepgrpo_core.kernels import KERNELS


@flow(name="train", log_prints=True, flow_run_name=run_name_from_parameters)
def train(
    config: Config | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    run_id: str | None = None,
    run_dir: str | None = None,
) -> dict[str, Any]:
    """Train a LoRA with GRPO and step-level credit.

    Args:
        config: The run's config, field by field (the run form; see `stepgrpo config show`).
        config_path: Or a YAML config file (relative to the working directory), instead of `config`.
        overrides: `key=value` changes on top of either, e.g. `optim.lr=1e-4`.
        run_id: The run under `run.runs_root` (resumed if it exists); None: a new `<run.name>-<UTC time>`.
        run_dir: Or the run directory itself, instead of `run_id`.
    """
    cfg = config_from(config, config_path, overrides or [])
    environment.apply(cfg.scale.threads)
    check_config(cfg)  # before anything is made (a deployment's parameters arrive here unchecked)
    with owned(resolve_run_dir(cfg, run_dir, run_id)) as path:  # one process at a time
        run = open_run(cfg, path)
        name_flow_run(run.run_id)
        with workers(cfg, path), kept_ranks():  # scale.update_processes > 1: ranks that live for the run
            return iterate(run, cfg)


RETENTION_WHY = "the run's storage.keep / storage.checkpoint_every"


def under_protocol(run: Run, cfg: Config, iteration: int) -> None:
    """With `run.eval_protocol`: the policy after `iteration` (-1: the base) under that protocol,
    its evidence bundle in the run's `evidence/` (reused when it is there and verifies)."""
    if cfg.run.eval_protocol is None:
        return
    from stepgrpo.flows.evaluate import protocol_bundle, protocol_config

    name = cfg.run.eval_protocol
    final, report = protocol_bundle(run, protocol_config(cfg, name), name, iteration, [])
    head = report["results"]["headline"]
    print(f"{name} ({report['label']}): {head['name']} {head['value']:.4f}; evidence {final.name}")


def iterate(run: Run, cfg: Config) -> dict[str, Any]:
    """The algorithm, on a run this process owns."""
    stage = bind(run, cfg)

    prompts = stage.prompts(run, cfg)
    psi = stage.calibrate(run, cfg, prompts) if KERNELS.facts(cfg.sampler.kernel)["calibrated"] else None
    checkpoint = None  # the base model
    with TrainingLog(run, cfg) as log:
        if (resumed := resume_point(run, cfg.run.iterations)) is not None:
            log.resuming(*resumed)
        log.evaluation(0, stage.evaluate(run, cfg, -1, prompts, checkpoint))
        under_protocol(run, cfg, -1)
        for i in range(cfg.run.iterations):
            drawn = stage.draw(run, cfg, i, prompts) if cfg.curriculum.draw != "uniform" else None
            rollout = stage.rollout(run, cfg, i, prompts, checkpoint, psi, drawn)
            clean = stage.complete(run, cfg, i, rollout, checkpoint) if cfg.completion.method else rollout
            rewards = stage.score(run, cfg, i, clean, rollout)
            credit = stage.credit(run, cfg, i, rewards)
            checkpoint = stage.update(run, cfg, i, credit, rollout, checkpoint)
            log.iteration(i, rollout, clean, rewards, credit, checkpoint, drawn)
            if cfg.run.evaluates_after(i):
                log.evaluation(i + 1, stage.evaluate(run, cfg, i, prompts, checkpoint))
                under_protocol(run, cfg, i)
            log.pruned(apply_retention(run, cfg.storage, RETENTION_WHY))
        last = log.evaluations[-1] if log.evaluations else None
        grid = Path(last["grid"]) if last else None
        return log.finish(export_lora(run, cfg, cfg.run.iterations - 1, log.evaluations, grid))
