"""DenseGRPO exploration calibration: the per-step noise table `psi` of a run's `psi` kernel."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.checks import check_config
from stepgrpo.config import Config, config_from
from stepgrpo.flows.progress import name_flow_run, run_name_from_parameters
from stepgrpo.runs import open_run, owned, resolve_run_dir
from stepgrpo.runtime import environment
from stepgrpo.tasks import bind


@flow(name="calibrate", log_prints=True, flow_run_name=run_name_from_parameters)
def calibrate(
    config: Config | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    run_id: str | None = None,
    run_dir: str | None = None,
) -> dict[str, Any]:
    """Calibrate `psi` into the run (created if new); `stepgrpo train` with the same run then uses it.

    Args:
        config: The run's config, field by field (the run form).
        config_path: Or a YAML config file, instead of `config`.
        overrides: `key=value` changes on top of either.
        run_id: The run under `run.runs_root`; None: a new `<run.name>-<UTC time>`.
        run_dir: Or the run directory itself, instead of `run_id`.
    """
    cfg = config_from(config, config_path, overrides or [])
    environment.apply(cfg.scale.threads)
    check_config(cfg, calibrated=True)
    with owned(resolve_run_dir(cfg, run_dir, run_id)) as path:
        run = open_run(cfg, path)
        name_flow_run(f"{run.run_id} calibrate")
        stage = bind(run, cfg)
        result = stage.calibrate(run, cfg, stage.prompts(run, cfg))
    start = result.rounds[0]["psi"] if result.rounds and result.rounds[0].get("round") == -1 else None
    done = sum(1 for r in result.rounds if r.get("round", 0) >= 0)
    if start is not None:
        print(f"psi before: {[round(p, 4) for p in start]}")
    print(f"psi after {done} rounds: {[round(p, 4) for p in result.psi]}")
    return {"run_dir": str(run.path), **result.record()}
