"""DenseGRPO exploration calibration: the per-step noise table `psi` of a run's `psi` kernel."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.checks import check_config
from stepgrpo.config import load_config
from stepgrpo.runs import open_run, owned, resolve_run_dir
from tasks import bind


@flow(name="calibrate", log_prints=True)
def calibrate(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """Calibrate `psi` into the run (created if new); `stepgrpo train` with the same run then uses it."""
    cfg = load_config(config_path, overrides or [])
    check_config(cfg, calibrated=True)
    with owned(resolve_run_dir(cfg, run_dir, run_id)) as path:
        run = open_run(cfg, path)
        stage = bind(run)
        result = stage.calibrate(run, cfg, stage.prompts(run, cfg))
    print(f"psi after {len(result.rounds)} rounds: {[round(p, 4) for p in result.psi]}")
    return {"run_dir": str(run.path), **result.record()}
